"""Answers built to hurt the parser: nested deeper than Python's JSON parser goes, or packed with
values that take 20 times their bytes once parsed. They count as no JSON at all: `wait-ready`
keeps polling (and times out with exit 4, not `internal error: RecursionError`), and no answer
costs much more memory than its size. The weights checker's cap is the one SECURITY.md states."""

from __future__ import annotations

import re
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest
from conftest import invoke
from fake_server import Behaviour, FakeServer

from ckptctl import bounded_http
from ckptctl import weights_checker as verify
from ckptctl.inference_server import ServerAddress, parse_json_object

SECURITY = Path(__file__).resolve().parents[2] / "SECURITY.md"
# 3,000 levels: past the parser's recursion limit, yet few enough values to be parsed.
DEEP = b'{"weight_version": ' + b"[" * 3000 + b"]" * 3000 + b"}"
# The 500,000 levels (1 MB, under the 1 MiB cap).
DEEPER = b"[" * 500_000 + b"]" * 500_000


@pytest.mark.parametrize("body", [DEEP, DEEPER], ids=["deep", "deeper"])
def test_wait_ready_keeps_polling_past_a_deeply_nested_answer(body: bytes) -> None:
    behaviour = Behaviour(weights_loaded=True, weight_version="v1")
    for path in ("/model_info", "/get_weight_version", "/get_model_info"):  # every place
        behaviour.routes[("GET", path)] = lambda _doc: (200, body)
    with FakeServer(behaviour) as s:
        r = invoke(
            "wait-ready", "--endpoint", s.endpoint, "--weight-version", "v1", "--timeout", "3",
            "--interval", "0.05", "--attempt-timeout", "0.5", "--json",
        )  # fmt: skip
        answered = s.behaviour.statuses("/model_info")
    assert r.exit_code == 4, r.stderr
    assert "internal error" not in r.stderr and "Recursion" not in r.stderr
    assert "/get_model_info answered without a weight_version" in r.stderr
    assert answered and set(answered) == {200}


def _response(body: bytes) -> httpx.Response:
    return httpx.Response(200, content=body)


def test_a_deep_answer_is_no_json_object() -> None:
    assert parse_json_object(_response(DEEP)) is None
    assert parse_json_object(_response(b'{"a": ' + b"[" * 500 + b"]" * 500 + b"}")) is not None


def _checksums(entries: int) -> bytes:
    names = ",".join(f'"model.layers.{i}.mlp.weight": "{i:016x}"' for i in range(entries))
    return ('{"success": true, "checksums": {' + names + "}}").encode()


def test_a_packed_answer_is_refused_before_anything_is_built() -> None:
    packed = b'{"a": [' + b"[]," * 1_400_000 + b"[]]}"  # 4 MB, 1.4 million lists
    tracemalloc.start()
    try:
        parsed = parse_json_object(_response(packed))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parsed is None
    assert peak < len(packed) // 4  # (parsed, the lists alone took 20 times its size)
    # A real checksum answer of the same size is read: 30+ bytes an entry.
    real = _checksums(80_000)
    assert len(real) > 4_000_000
    doc = parse_json_object(_response(real))
    assert doc is not None and len(doc["checksums"]) == 80_000


def test_the_checkers_cap_is_the_one_security_md_states() -> None:
    text = " ".join(SECURITY.read_text().split())
    caps = re.search(r"a cap on the answer \((\d+) MiB; (\d+) MiB for the weights checker's", text)
    assert caps is not None
    assert int(caps[1]) << 20 == bounded_http.MAX_RESPONSE_BYTES
    assert int(caps[2]) << 20 == verify.MAX_ANSWER_BYTES == 16 << 20


def test_a_checker_answer_past_the_cap_is_refused() -> None:
    behaviour = Behaviour(profile="sglang-0.5.23", weights_loaded=True)
    over = b" " * (verify.MAX_ANSWER_BYTES - 2) + b"{}"
    behaviour.routes[("POST", "/weights_checker")] = lambda _doc: (200, over + b" ")
    with FakeServer(behaviour) as s:
        checker = verify.Checker(ServerAddress(endpoint=s.endpoint), time.monotonic() + 30)
        with pytest.raises(verify.OperationFailed, match="more than 16 MiB"):
            checker.ask("checksum")
        behaviour.routes[("POST", "/weights_checker")] = lambda _doc: (200, over)
        assert checker.ask("checksum").doc == {}  # exactly at the cap: read

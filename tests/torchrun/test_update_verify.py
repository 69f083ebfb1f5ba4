"""`ckptctl update --verify` / `--verify-round-trip` across real torchrun ranks on CPU, with
checkpoint-engine's ParameterServer stood in (tests/support/cpu_ps_rank.py) and real servers on
loopback that hold the tensors they would have received and answer SGLang's weights checker
version by version (tests/support/fake_checker.py): a server that silently drops or corrupts one tensor
must fail the update, naming it."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from cpu_jobs import update_in_one_process, update_on_cpu
from fake_checker import HeldWeights
from fake_server import Behaviour, FakeServer
from locations import TINY

Q = "model.layers.0.self_attn.q_proj.weight"
LM = "lm_head.weight"

pytestmark = pytest.mark.slow


def _receiving(profile: str, held: HeldWeights) -> FakeServer:
    """A server that holds what an update with TINY would have given it (minus injections)."""
    return FakeServer(
        Behaviour(profile=profile, held=held, on_update=lambda _h, _d: held.receive(TINY))
    )


def _result(r: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return json.loads(r.stdout)


def _posts(server: FakeServer, path: str) -> list[dict[str, Any]]:
    return [
        json.loads(q["body"] or b"null")
        for q in server.behaviour.requests
        if q["method"] == "POST" and q["path"] == path
    ]


def test_compare_checksum_proves_every_tensor_then_names_a_dropped_one() -> None:
    """Both ranks' tensors are proven; the dropped one is named (by a job of one process: the
    server's answer is the subject there, not the ranks)."""
    good, bad = HeldWeights(tp_size=2), HeldWeights(drop={Q})
    with _receiving("sglang-pr17009", good) as s:
        ok = update_on_cpu(
            "--json", "--inference-parallel-size", "2", "--endpoint", s.endpoint, "--verify"
        )
        sent = _posts(s, "/weights_checker")[-1]
    with _receiving("sglang-pr17009", bad) as s:
        failed = update_in_one_process(
            "--json", "--inference-parallel-size", "1", "--endpoint", s.endpoint, "--verify"
        )
    assert ok.returncode == 0, ok.stderr
    doc = _result(ok)
    assert doc["verified"] == "checksum"
    assert doc["verification"]["tensor_count"] == len(sent["checksums"]) == 25
    assert sent["action"] == "compare_checksum"
    assert failed.returncode != 0
    assert _result(failed)["exit_code"] == 1
    assert f"does not hold the checkpoint: 1 tensor(s) differ from what was sent: {Q}" in (
        failed.stderr
    )


def test_two_servers_agree_per_engine_and_a_corrupting_one_is_named() -> None:
    """Two TP1 servers fed by one job (released SGLang: no compare_checksum)."""
    helds = [HeldWeights(), HeldWeights()]
    with _receiving("sglang-0.5.23", helds[0]) as a, _receiving("sglang-0.5.23", helds[1]) as b:
        ok = update_on_cpu("--json",
            "--inference-parallel-size", "1", "--endpoint", a.endpoint, "--endpoint", b.endpoint,
            "--verify",
        )  # fmt: skip
        helds[1].corrupt = {LM}
        failed = update_on_cpu("--json",
            "--inference-parallel-size", "1", "--endpoint", a.endpoint, "--endpoint", b.endpoint,
            "--verify",
        )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    doc = _result(ok)
    assert doc["verified"] == "per-engine" and doc["verification"]["server_count"] == 2
    assert failed.returncode != 0 and _result(failed)["exit_code"] == 1
    assert "hold different weights" in failed.stderr
    assert f"disagree (no majority) in 1 parameter(s): dp0/pp0/tp0 {LM}" in failed.stderr


@pytest.mark.parametrize(
    ("profile", "why", "ranks"),
    [
        ("sglang-0.5.4", "has no weights checker", 1),
        ("sglang-0.5.9", "offers only snapshot/reset_tensors/compare", 1),
        ("sglang-0.5.23", "this job feeds one server", 2),  # (and both ranks end before it)
    ],
)
def test_a_server_that_cannot_prove_it_ends_with_exit_3_before_the_push(
    profile: str, why: str, ranks: int
) -> None:
    with _receiving(profile, HeldWeights(tp_size=ranks)) as s:
        run = update_on_cpu if ranks == 2 else update_in_one_process
        r = run(
            "--json", "--inference-parallel-size", str(ranks), "--endpoint", s.endpoint, "--verify"
        )
        updates = _posts(s, "/update_weights_from_ipc")
    assert r.returncode != 0 and _result(r)["exit_code"] == 3
    assert why in r.stderr and "nothing was pushed" in r.stderr
    assert updates == []


def test_the_round_trip_needs_its_confirmation() -> None:
    unconfirmed = update_in_one_process("--json", "--verify-round-trip")
    assert unconfirmed.returncode == 2 and _result(unconfirmed)["exit_code"] == 2
    assert "--reset-served-weights" in unconfirmed.stderr


def test_the_round_trip_passes_then_catches_a_dropped_tensor() -> None:
    # (Three torchrun jobs in one test came close to pytest's timeout on a busy machine.)
    flags = ("--verify-round-trip", "--reset-served-weights")
    good = HeldWeights.started_from(TINY, tp_size=2)
    with _receiving("sglang-0.5.23", good) as s:
        ok = update_on_cpu(
            "--json", "--inference-parallel-size", "2", "--endpoint", s.endpoint, *flags
        )
        actions = [p["action"] for p in _posts(s, "/weights_checker")]
    assert ok.returncode == 0, ok.stderr
    assert _result(ok)["verified"] == "round-trip"
    assert actions[-3:] == ["snapshot", "reset_tensors", "compare"]

    bad = HeldWeights.started_from(TINY)  # (fed by one process: the server is the subject)
    bad.drop = {Q}
    with _receiving("sglang-0.5.23", bad) as s:
        failed = update_in_one_process(
            "--json", "--inference-parallel-size", "1", "--endpoint", s.endpoint, *flags
        )
    assert failed.returncode != 0 and _result(failed)["exit_code"] == 1
    assert f"1 parameter(s) differ: {Q}" in failed.stderr


def test_the_round_trip_refuses_a_server_that_would_lose_its_rope_caches() -> None:
    held = HeldWeights.started_from(TINY)
    flags = ("--verify-round-trip", "--reset-served-weights")
    with _receiving("sglang-0.5.9", held) as s:
        r = update_in_one_process(
            "--json", "--inference-parallel-size", "1", "--endpoint", s.endpoint, *flags
        )
        actions = [p["action"] for p in _posts(s, "/weights_checker")]
        updates = _posts(s, "/update_weights_from_ipc")
    assert _result(r)["exit_code"] == 3, r.stderr
    assert "resets its RoPE caches too" in r.stderr
    assert "snapshot" not in actions and "reset_tensors" not in actions and updates == []

"""Every HTTP exchange has a total deadline and a capped answer (issue 14, item 4).

httpx's timeouts are per read: a server that sends its headers, or its body, one byte at a
time never trips them, and one that streams an endless body fills memory. Here real servers
on 127.0.0.1 (and a Unix socket) misbehave that way, against the real `wait-ready` script, the
update request and the weight-version read-back. Each case asserts the outcome, that the call
ended (a generous guard, never a tight wall-clock bound), and what the server saw: the client
hung up, and no more than a bounded number of bytes went out.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import run_script, wait_until
from fake_server import Behaviour, FakeServer
from locations import CPU_PS_RANK, TINY

from ckptctl.bounded_http import MAX_RESPONSE_BYTES, ResponseTooLarge, bounded_client, deadline
from ckptctl.inference_server import CONTRACTS, ServerAddress, make_client, push_update
from ckptctl.readiness import read_weight_version

GUARD_S = 60  # what used to run for ever must end well inside this
TRICKLES = ["trickle_headers", "trickle_body"]
FLOODS = ["endless_body", "huge_length"]
# Kernel socket buffers take some of a flood before the client hangs up; far less than this.
BYTES_PER_CONNECTION = 64 << 20


def _ended(call: Callable[[], Any]) -> Any:
    """Run `call` in a thread; return what it returned or raised, failing if it never ends."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GUARD_S)
    assert not thread.is_alive(), f"still running after {GUARD_S}s"
    return box.get("error", box.get("value"))


def _wait_for_hang_up(server: FakeServer) -> None:
    """A trickling server notices the client gone at its next byte."""
    wait_until(lambda: server.behaviour.disconnects >= 1, 20, "the client to hang up")


def _bounded_flood(server: FakeServer) -> None:
    connections = max(len(server.behaviour.requests), 1)
    assert server.behaviour.bytes_sent / connections < BYTES_PER_CONNECTION


# -- wait-ready, the installed script ---------------------------------------------------------


@pytest.mark.parametrize("mode", TRICKLES + FLOODS)
def test_wait_ready_ends_at_its_timeout_with_exit_4(mode: str) -> None:
    with FakeServer(Behaviour(mode=mode)) as s:
        r = run_script(
            "wait-ready", "--endpoint", s.endpoint, "--timeout", "2", "--json", timeout=GUARD_S
        )
        assert r.returncode == 4, r.stderr
        doc = json.loads(r.stdout)
        assert doc["ready"] is False
        if mode in TRICKLES:
            assert "no answer within" in doc["last_status"]
            _wait_for_hang_up(s)
        else:
            assert "more than 1 MiB" in doc["last_status"]
            _bounded_flood(s)
    assert "Traceback" not in r.stderr


def test_wait_ready_over_a_unix_socket_is_bounded_too(short_tmp: Path) -> None:
    path = str(short_tmp / "s.sock")
    with FakeServer(Behaviour(mode="trickle_body"), uds=path) as s:
        r = run_script(
            "wait-ready", "--uds", path, "--endpoint", s.endpoint, "--timeout", "2",
            timeout=GUARD_S,
        )  # fmt: skip
        assert r.returncode == 4, r.stderr
        assert "no answer within" in r.stderr
        _wait_for_hang_up(s)


def test_a_trickle_longer_than_the_attempt_timeout_is_one_failed_attempt() -> None:
    """--attempt-timeout bounds a whole attempt, not each read: several attempts fit in the
    overall timeout, each cut off at its own deadline."""
    with FakeServer(Behaviour(mode="trickle_headers")) as s:
        r = run_script(
            "wait-ready", "--endpoint", s.endpoint, "--timeout", "4", "--attempt-timeout", "0.5",
            "--interval", "0.05", "--json", timeout=GUARD_S,
        )  # fmt: skip
    assert r.returncode == 4
    # The first attempt ended at its own 0.5 s (not at the 4 s of the whole wait).
    assert "no answer within 0.5s" in r.stderr and json.loads(r.stdout)["attempts"] >= 1


# -- the update request and the read-back ------------------------------------------------------


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("mode", TRICKLES + FLOODS)
def test_the_update_request_is_bounded(mode: str, engine: str) -> None:
    with FakeServer(
        Behaviour(mode=mode, profile="vllm" if engine == "vllm" else "sglang-0.5.23")
    ) as s:
        outcome = _ended(
            lambda: push_update(
                ServerAddress(s.endpoint), engine, {"GPU-a": "ipc://@a"}, weight_version=None,
                timeout=2.0,
            )
        )  # fmt: skip
        if mode in TRICKLES:
            assert isinstance(outcome, httpx.TimeoutException), outcome
            _wait_for_hang_up(s)
        else:
            assert isinstance(outcome, ResponseTooLarge), outcome
            _bounded_flood(s)


@pytest.mark.parametrize("mode", TRICKLES + FLOODS)
def test_the_weight_version_read_back_is_bounded(mode: str) -> None:
    with FakeServer(Behaviour(mode=mode, weights_loaded=True)) as s:

        def read() -> Any:
            with make_client(ServerAddress(s.endpoint), timeout=2.0) as client:
                return read_weight_version(client, CONTRACTS["sglang"])

        outcome = _ended(read)
        expected = httpx.TimeoutException if mode in TRICKLES else ResponseTooLarge
        assert isinstance(outcome, expected), outcome


def test_a_flooding_read_back_ends_the_update_with_one_line() -> None:
    """The real update CLI (one process, the ParameterServer stood in): the push succeeds, the
    read-back floods; the job ends at once with exit 1 and says why (it used to read until
    --timeout ran out)."""
    paths = ("/model_info", "/get_weight_version", "/get_model_info")
    with FakeServer(Behaviour(mode="endless_body", mode_paths=paths)) as s:
        r = subprocess.run(
            [
                sys.executable, CPU_PS_RANK, "update", "--checkpoint-path", str(TINY),
                "--inference-parallel-size", "1", "--endpoint", s.endpoint,
                "--weight-version", "v1", "--timeout", "600",
            ],
            capture_output=True, text=True, timeout=GUARD_S, env={**os.environ, "RANK": "0"},
        )  # fmt: skip
        _bounded_flood(s)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "reading the weight version back" in errors[0]
    assert "more than 1 MiB" in errors[0]


# -- the client on its own (what the serve control client uses) ---------------------------------


def test_a_huge_content_length_is_refused_before_the_body_is_read() -> None:
    with (
        FakeServer(Behaviour(mode="huge_length")) as s,
        bounded_client(s.endpoint, timeout=30) as c,
    ):
        with pytest.raises(ResponseTooLarge):
            c.get("/ping")
        _bounded_flood(s)


def test_the_cap_can_be_set_and_an_answer_within_it_is_read() -> None:
    with FakeServer(Behaviour(weights_loaded=True)) as s:
        with bounded_client(s.endpoint, timeout=5) as c:
            assert c.get("/model_info").json()["weight_version"] == "default"
        small = bounded_client(s.endpoint, timeout=5, max_response_bytes=20)
        with small, pytest.raises(ResponseTooLarge, match="larger than 20 bytes"):
            small.get("/model_info")
    assert MAX_RESPONSE_BYTES >= 1 << 20


def test_one_deadline_bounds_several_requests_together() -> None:
    """`deadline()` covers a probe's several requests: each request's own timeout is long, the
    block's is short; the first uses it up, and the second is never sent."""
    with (
        FakeServer(Behaviour(mode="trickle_body")) as s,
        bounded_client(s.endpoint, timeout=30) as c,
    ):

        def two_requests() -> Any:
            with deadline(1.0):
                for _ in range(2):
                    try:
                        c.get("/ping")
                    except httpx.TimeoutException as exc:
                        last = exc
            return last

        assert isinstance(_ended(two_requests), httpx.ConnectTimeout)
        assert len(s.behaviour.requests) == 1


@pytest.mark.slow
def test_serve_a_trickling_server_fails_only_that_push(short_tmp: Path) -> None:
    """A serve job (one process, ParameterServer stood in): the server trickles its answer to
    the update, the push fails at --push-timeout with exit 4, and the job serves the next push."""
    from conftest import cpu_serve_job, wait_for_path

    sock = str(short_tmp / "serve.sock")
    paths = ("/update_weights_from_ipc",)
    # (--push-timeout bounds the job's start too: 20 s lets it start on a busy machine; the
    # trickled push still ends there, well inside GUARD_S.)
    with (
        FakeServer(Behaviour(mode="trickle_body", mode_paths=paths)) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--push-timeout", "20", ranks=1) as job,
    ):
        assert wait_for_path(sock)
        push = ("push", "--control-socket", sock, "--checkpoint-path", str(TINY))
        slow = run_script(*push, timeout=GUARD_S)
        assert slow.returncode == 4, slow.stderr
        _wait_for_hang_up(s)
        s.behaviour.mode = None
        again = run_script(*push, "--weight-version", "v2", timeout=GUARD_S)
        assert again.returncode == 0, again.stderr
        assert s.behaviour.weight_version == "v2"
        with bounded_client("http://serve", uds=sock, timeout=10) as client:
            client.post("/stop")
        _, err = job.communicate(timeout=30)
    assert job.returncode == 0, err


def test_a_caller_that_expects_more_raises_the_cap() -> None:
    """The weights checker's checksum answer lists every parameter (about 1 MB for
    DeepSeek-V3 on TP8): it reads up to its own cap, not the default 1 MiB."""
    from ckptctl.weights_checker import MAX_ANSWER_BYTES, Checker

    big = {"success": True, "checksums": {f"layers.{i}.w": "0" * 64 for i in range(30_000)}}
    routes = {("POST", "/weights_checker"): lambda doc: (200, big)}
    with FakeServer(Behaviour(routes=routes)) as s:
        answer = _ended(lambda: Checker(ServerAddress(s.endpoint), time.monotonic() + 30).ask("x"))
    assert MAX_ANSWER_BYTES > MAX_RESPONSE_BYTES
    assert not isinstance(answer, BaseException), answer
    assert answer.status == 200 and len(answer.doc["checksums"]) == 30_000


def _gzip(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


def _bomb_server(decoded_bytes: int) -> tuple[socket.socket, int, list[bytes]]:
    """Answers every request with a small body that decodes to `decoded_bytes` (gzip in gzip);
    records each request's head."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    inner = b"".join(c.compress(b"\0" * (1 << 20)) for _ in range(decoded_bytes >> 20)) + c.flush()
    body = _gzip(inner)
    assert len(body) < 64 * 1024  # far below the 1 MiB cap on an answer
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    heads: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
                heads.append(buf)
                head = (
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    f"Content-Encoding: gzip, gzip\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                with contextlib.suppress(OSError):  # (the client may hang up first)
                    conn.sendall(head.encode() + body)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1], heads


def test_a_compressed_answer_is_never_decoded() -> None:
    """A few kB that decode to 256 MiB: before, wait-ready decoded all of it (2.1 GB RSS for a
    1 GiB bomb) and called the server ready. Now it asks for plain answers and reads nothing
    else: the server is never ready, and the wait ends at its deadline."""
    srv, port, heads = _bomb_server(256 << 20)
    try:
        r = run_script(
            "wait-ready", "--endpoint", f"http://127.0.0.1:{port}", "--timeout", "3", "--json"
        )
    finally:
        srv.close()
    assert r.returncode == 4, r.stdout + r.stderr
    assert "compressed" in r.stderr
    assert heads and all(b"accept-encoding: identity" in h.lower() for h in heads)

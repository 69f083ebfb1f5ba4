"""`wait-ready` tells SGLang and vLLM from a foreign server; a server's words stay one clean line;
a wait without a terminal shows it is alive (issue 15, item 4).

The foreign server is the real thing: Python's own `http.server`, which answers 404 (with an
HTML page) on every path SGLang and vLLM answer, and 501 to every POST.

Decision: a 404 on the readiness path fails at once with exit 1 ("the operation failed"), not at
--timeout: both engines answer that path in every version from the moment they listen, so a
server that answers it with 404 is not one of them, and waiting longer cannot change that.
"""

from __future__ import annotations

import json

import pytest
from conftest import invoke, run_script
from cpu_jobs import update_in_one_process
from fake_server import Behaviour, FakeServer

import ckptctl.cli.wait_ready as wait_ready_cli
from ckptctl.inference_server import MESSAGE_CHARS, ServerAddress, UpdateRefused, push_update

FOREIGN = "this does not answer like SGLang or vLLM (check --endpoint)"


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize(
    "args",
    [[], ["--for", "healthy"], ["--engine", "vllm"], ["--engine", "vllm", "--for", "healthy"]],
)
def test_a_foreign_server_is_never_ready_and_fails_fast(http_server: str, args: list[str]) -> None:
    # --timeout far beyond the 60 s guard: only failing fast passes.
    r = run_script(
        "wait-ready", "--endpoint", http_server, "--timeout", "600", "--json", *args, timeout=60
    )
    assert r.returncode == 1, r.stderr
    (line,) = _error_lines(r.stderr)
    assert FOREIGN in line and "HTTP 404" in line
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["exit_code"] == 1 and FOREIGN in doc["error"]


def test_a_fake_sglang_is_still_ready(server: FakeServer) -> None:
    """The engines themselves: 503 before weights is listening, as before."""
    r = invoke("wait-ready", "--endpoint", server.endpoint, "--timeout", "10")
    assert r.exit_code == 0, r.stderr


def test_the_update_request_to_a_foreign_server_says_so_in_one_clean_line(
    http_server: str,
) -> None:
    """http.server answers the POST with a 501 HTML page: the message carries its words, not
    its markup, on one bounded line."""
    with pytest.raises(UpdateRefused) as refused:
        push_update(
            ServerAddress(http_server), "sglang", {"GPU-a": "ipc://@a"}, weight_version=None,
            timeout=10,
        )  # fmt: skip
    message = str(refused.value)
    assert message.startswith("HTTP 501")
    assert "Unsupported method" in message
    assert "<" not in message and "\n" not in message


@pytest.mark.slow
def test_update_against_a_foreign_server_stops_before_the_push(http_server: str) -> None:
    """The real CLI (ParameterServer stood in): the wait for the server ends at once with the
    reason, and no update is POSTed."""
    r = update_in_one_process("--inference-parallel-size", "1", "--endpoint", http_server)
    assert r.returncode == 1, r.stderr  # (not 4: the wait ended at once, not at --timeout)
    assert FOREIGN in r.stderr
    assert "<html" not in r.stderr.lower() and "POST" not in r.stderr


# -- what a server says, in our lines ----------------------------------------------------------

HOSTILE = (
    "<!DOCTYPE html><html><head><title>Oops</title><style>p{color:red}</style>"
    "<script>alert('x')</script></head><body><h1>Bad \x1b[31mthings\x1b[0m</h1>\n<p>line\r\n"
    "bare\x07controls\x00of\x9bC0 and C1\x8d "
    "two &amp; more</p>" + "<p>padding</p>" * 2000 + "</body></html>"
)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_servers_error_text_is_one_bounded_line(engine: str) -> None:
    behaviour = Behaviour(
        profile="vllm" if engine == "vllm" else "sglang-0.5.23",
        update_status=500,
        update_message=HOSTILE,
    )
    with FakeServer(behaviour) as s, pytest.raises(UpdateRefused) as refused:
        push_update(ServerAddress(s.endpoint), engine, {"a": "b"}, weight_version=None, timeout=10)
    message = str(refused.value)
    assert "Bad things" in message and "two & more" in message
    for bad in ("<", "\x1b", "\n", "\r", "\x07", "\x00", "\x9b", "\x8d", "alert(", "color:red"):
        assert bad not in message
    assert len(message) < MESSAGE_CHARS + 100


# -- a wait without a terminal shows it is alive ---------------------------------------------


def test_without_a_terminal_a_line_comes_while_nothing_changes(
    server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: one line, then silence until the timeout. Now a line every HEARTBEAT_S (made
    short here; the attempts are bounded, so one comes after every period that passes)."""
    assert wait_ready_cli.HEARTBEAT_S <= 10
    monkeypatch.setattr(wait_ready_cli, "HEARTBEAT_S", 0.3)
    r = invoke(
        "wait-ready", "--endpoint", server.endpoint, "--for", "healthy", "--timeout", "2",
        "--interval", "0.05", "--attempt-timeout", "0.5",
    )  # fmt: skip
    assert r.exit_code == 4
    alive = [line for line in r.stderr.splitlines() if "still waiting" in line]
    assert len(alive) >= 2, r.stderr
    assert all("HTTP 503" in line for line in alive)

"""`ckptctl wait-ready` against real HTTP servers that answer like SGLang / vLLM, and misbehave."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import ckptctl_script, invoke, read_until, run_script, wait_until
from fake_server import Behaviour, FakeServer, reserved_port

from ckptctl.readiness import Probe, wait_ready

FAST = ["--interval", "0.05", "--attempt-timeout", "0.5"]
# For a wait that must run out and still have seen the server's answer: the first attempt has
# this long for it, however busy the machine (a hung server's attempts end at once, see FAST).
ANSWERED = "3"
# For a test of what the first attempt saw: it too has that long, however busy the machine.
ONE_ATTEMPT = ["--interval", "0.05", "--attempt-timeout", ANSWERED]


def _json(result) -> dict:  # type: ignore[no-untyped-def]
    docs = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(docs) == 1, f"expected one JSON document on stdout, got {result.stdout!r}"
    return json.loads(docs[0])


# -- readiness semantics per engine version ---------------------------------------------------


@pytest.mark.parametrize("profile", ["sglang-0.5.4", "sglang-0.5.22", "sglang-0.5.23", "vllm"])
def test_listening_counts_any_answer_even_503_before_weights(profile: str) -> None:
    with FakeServer(Behaviour(profile=profile)) as s:
        r = invoke(
            "wait-ready",
            "--endpoint",
            s.endpoint,
            "--engine",
            "vllm" if profile == "vllm" else "sglang",
            "--timeout",
            "5",
            "--json",
            *ONE_ATTEMPT,
        )
        seen = len(s.behaviour.requests)
    assert r.exit_code == 0, r.stderr
    doc = _json(r)
    assert doc["ready"] is True and doc["attempts"] == 1 and seen == 1  # the first answer did


def _after_first(server: FakeServer, path: str, status: int, change) -> threading.Thread:  # type: ignore[no-untyped-def]
    """Change the server once it has answered `path` with `status` (not after some time: on a
    busy machine the client may not have asked yet), so the client sees both states."""

    def run() -> None:
        wait_until(lambda: status in server.behaviour.statuses(path), what=f"{path} {status}")
        change()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_healthy_waits_for_weights_then_succeeds(server: FakeServer) -> None:
    def load_weights() -> None:
        server.behaviour.weights_loaded = True

    _after_first(server, "/health", 503, load_weights)
    r = invoke(
        "wait-ready",
        "--endpoint",
        server.endpoint,
        "--for",
        "healthy",
        "--timeout",
        "60",
        "--json",
        *FAST,
    )
    assert r.exit_code == 0, r.stderr
    doc = _json(r)
    # It waited through the 503s and stopped at the first 200, one request per attempt.
    answers = server.behaviour.statuses("/health")
    assert answers[0] == 503 and answers[-1] == 200 and answers.count(200) == 1
    assert doc["ready"] is True and doc["attempts"] == len(answers) > 1


def test_healthy_times_out_with_exit_4_and_json(server: FakeServer) -> None:
    r = invoke(
        "wait-ready",
        "--endpoint",
        server.endpoint,
        "--for",
        "healthy",
        "--timeout",
        ANSWERED,
        "--json",
        *FAST,
    )
    assert r.exit_code == 4
    doc = _json(r)
    assert doc["ready"] is False and doc["attempts"] >= 1
    assert doc["elapsed_s"] >= 3  # it gives up only once the deadline has passed
    answers = server.behaviour.statuses("/health")  # (a last attempt cut short may lack one)
    assert answers[0] == 503 and set(answers) == {503} and len(answers) <= doc["attempts"]
    assert "HTTP 503" in r.stderr
    assert r.stderr.count("error:") == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("profile", ["sglang-0.5.4", "sglang-0.5.14", "sglang-0.5.23"])
def test_weight_version_read_back_on_each_sglang_version(profile: str) -> None:
    with FakeServer(Behaviour(profile=profile, weights_loaded=True, weight_version="v1")) as s:
        ok = invoke(
            "wait-ready",
            "--endpoint",
            s.endpoint,
            "--weight-version",
            "v1",
            "--timeout",
            "3",
            "--json",
            *FAST,
        )
        assert ok.exit_code == 0, ok.stderr
        assert _json(ok)["weight_version"] == "v1"
        wrong = invoke(
            "wait-ready",
            "--endpoint",
            s.endpoint,
            "--weight-version",
            "v2",
            "--timeout",
            ANSWERED,
            *FAST,
        )
        assert wrong.exit_code == 4
        assert "weight version 'v1'" in wrong.stderr


def test_weight_version_becomes_ready_when_server_updates() -> None:
    with FakeServer(Behaviour(weights_loaded=True, weight_version="old")) as s:

        def bump() -> None:
            s.behaviour.weight_version = "new"

        _after_first(s, "/model_info", 200, bump)
        r = invoke(
            "wait-ready",
            "--endpoint",
            s.endpoint,
            "--weight-version",
            "new",
            "--timeout",
            "60",
            *FAST,
        )
    assert r.exit_code == 0, r.stderr
    assert "weight version 'old'" in r.stderr and "weight version 'new'" in r.stderr


def test_weight_version_with_vllm_is_a_usage_error() -> None:
    r = invoke("wait-ready", "--engine", "vllm", "--weight-version", "v1", "--timeout", "1")
    assert r.exit_code == 2
    assert "vLLM" in r.stderr


def test_vllm_healthy_uses_health_endpoint() -> None:
    with FakeServer(Behaviour(profile="vllm")) as s:
        r = invoke(
            "wait-ready",
            "--engine",
            "vllm",
            "--for",
            "healthy",
            "--endpoint",
            s.endpoint,
            "--timeout",
            "3",
            *FAST,
        )
        assert r.exit_code == 0, r.stderr
        assert s.behaviour.requests[0]["path"] == "/health"


# -- misbehaving servers -------------------------------------------------------------------------


def test_nothing_listening_times_out(refused_endpoint: str) -> None:
    r = invoke("wait-ready", "--endpoint", refused_endpoint, "--timeout", "0.7", *FAST)
    assert r.exit_code == 4
    assert "connection refused" in r.stderr


class _Clock:
    """A clock that moves only when a probe takes time: deadlines checked without waiting."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _SlowProber:
    """Every attempt uses all the time it is given (a server that never answers)."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.given: list[float] = []

    def probe(self, attempt_timeout: float) -> Probe:
        self.given.append(attempt_timeout)
        self.clock.now += attempt_timeout
        return Probe(False, f"no answer within {attempt_timeout:g}s")


@pytest.mark.parametrize(
    ("timeout", "attempt_timeout", "given"),
    [(1.0, 0.375, [0.375, 0.375, 0.25]), (0.75, 30.0, [0.75])],  # (exact binary fractions)
)
def test_every_attempt_is_clipped_to_the_deadline(
    timeout: float, attempt_timeout: float, given: list[float]
) -> None:
    """What keeps every wait-ready bounded, checked on a clock of its own rather than the
    wall clock: an attempt never gets more than what is left of --timeout, none starts after
    it, and the result says when it gave up."""
    clock = _Clock()
    prober = _SlowProber(clock)
    result = wait_ready(
        prober,  # type: ignore[arg-type]
        timeout=timeout,
        interval=0.001,
        attempt_timeout=attempt_timeout,
        clock=clock,
    )
    assert not result.ready
    assert prober.given == given and result.attempts == len(given)
    assert result.elapsed_s == timeout


class _AnswersThenStalls:
    """A server that answers 503 at once, then (a busy machine) not within the last attempt."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def probe(self, attempt_timeout: float) -> Probe:
        if self.clock.now < 0.5:
            self.clock.now += 0.125
            return Probe(False, "HTTP 503", 503)
        self.clock.now += attempt_timeout
        return Probe(False, f"no answer within {attempt_timeout:g}s")


def test_an_attempt_cut_short_by_the_deadline_does_not_hide_an_earlier_answer() -> None:
    """The last attempt gets only what is left of --timeout; its "no answer" would advise
    checking that the server runs, when the attempts before it saw it answer."""
    clock = _Clock()
    result = wait_ready(
        _AnswersThenStalls(clock),  # type: ignore[arg-type]
        timeout=1.0,
        interval=0.001,
        attempt_timeout=0.75,
        clock=clock,
    )
    assert not result.ready and result.last_status == "HTTP 503"


def _attempt_timeouts(stderr: str) -> list[float]:
    return [float(x) for x in re.findall(r"no answer within ([0-9.]+)s", stderr)]


def test_port_that_opens_late() -> None:
    """Refused first, then listening on the same port (it was held, never free for others)."""
    with reserved_port() as sock:
        port = sock.getsockname()[1]
        proc = subprocess.Popen(
            [ckptctl_script(), "wait-ready", "--endpoint", f"http://127.0.0.1:{port}"]
            + ["--timeout", "60", "--json", *FAST],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            early = read_until(proc, "connection refused")
            with FakeServer(listen_on=sock) as s:
                out, err = proc.communicate(timeout=60)
                seen = list(s.behaviour.requests)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, early + err
    doc = json.loads(out)
    assert doc["ready"] is True and doc["attempts"] > 1
    assert len(seen) == 1  # refused until the port opened; ready on the first answer


def test_server_that_never_answers_is_bounded_by_attempt_timeout() -> None:
    with FakeServer(Behaviour(mode="hang")) as s:
        r = invoke(
            "wait-ready",
            "--endpoint",
            s.endpoint,
            "--timeout",
            "1.0",
            "--interval",
            "0.1",
            "--attempt-timeout",
            "0.3",
        )
    assert r.exit_code == 4
    # Each attempt gave up after its 0.3 s (or what was left of the 1 s).
    assert _attempt_timeouts(r.stderr)[0] == 0.3
    assert all(t <= 0.3 for t in _attempt_timeouts(r.stderr))


def test_server_that_hangs_longer_than_the_whole_timeout() -> None:
    # attempt timeout 30 s, overall 0.8 s: the attempt is clipped to the deadline.
    with FakeServer(Behaviour(mode="hang")) as s:
        r = invoke(
            "wait-ready", "--endpoint", s.endpoint, "--timeout", "0.8", "--attempt-timeout", "30"
        )
    assert r.exit_code == 4
    assert _attempt_timeouts(r.stderr) and all(t <= 0.8 for t in _attempt_timeouts(r.stderr))


@pytest.mark.parametrize(
    ("mode", "status"),
    [("reset", "connection"), ("garbage", "connection closed without a valid HTTP answer")],
)
def test_resets_and_garbage_are_not_ready(mode: str, status: str) -> None:
    with FakeServer(Behaviour(mode=mode)) as s:
        r = invoke("wait-ready", "--endpoint", s.endpoint, "--timeout", ANSWERED, *FAST)
    assert r.exit_code == 4
    assert status in r.stderr
    assert "Traceback" not in r.stderr


def test_5xx_counts_as_listening_but_not_healthy() -> None:
    with FakeServer(Behaviour(mode="http500")) as s:
        listening = invoke("wait-ready", "--endpoint", s.endpoint, "--timeout", "2", *FAST)
        healthy = invoke(
            "wait-ready", "--endpoint", s.endpoint, "--for", "healthy", "--timeout", ANSWERED, *FAST
        )
    assert listening.exit_code == 0
    assert healthy.exit_code == 4 and "HTTP 500" in healthy.stderr


def test_garbage_body_where_a_weight_version_is_expected() -> None:
    with FakeServer(Behaviour(mode="bad_json", weights_loaded=True)) as s:
        r = invoke(
            "wait-ready",
            "--endpoint",
            s.endpoint,
            "--weight-version",
            "v1",
            "--timeout",
            ANSWERED,
            *FAST,
        )
    assert r.exit_code == 4
    assert "without a weight_version" in r.stderr


# -- Unix sockets ------------------------------------------------------------------------------


def test_unix_socket(short_tmp: Path) -> None:
    path = str(short_tmp / "sglang.sock")
    with FakeServer(Behaviour(weights_loaded=True), uds=path) as s:
        r = invoke(
            "wait-ready",
            "--uds",
            path,
            "--endpoint",
            s.endpoint,
            "--for",
            "healthy",
            "--timeout",
            "3",
            *FAST,
        )
    assert r.exit_code == 0, r.stderr


def test_missing_unix_socket(short_tmp: Path) -> None:
    path = str(short_tmp / "nobody-home.sock")
    r = invoke("wait-ready", "--uds", path, "--timeout", "0.4", *FAST)
    assert r.exit_code == 4
    assert f"no Unix socket at {path}" in r.stderr


# -- API key ------------------------------------------------------------------------------------


def test_api_key_goes_with_the_weight_version_read_only_and_is_never_printed() -> None:
    """The probes (/ping, /health) go without the key: SGLang asks for none there, and a
    server still starting (or whoever took its port first) would get it with every poll. The
    weight version read, which SGLang guards, carries it."""
    secret = "sk-very-secret-123"
    with FakeServer(Behaviour(api_key=secret, weights_loaded=True, weight_version="v7")) as s:
        ok = invoke(
            "wait-ready", "--endpoint", s.endpoint, "--for", "healthy", "--weight-version", "v7",
            "--timeout", "3", *FAST, env={"CKPTCTL_API_KEY": secret},
        )  # fmt: skip
        assert ok.exit_code == 0, ok.stderr
        sent = {r["path"]: r["headers"].get("Authorization") for r in s.behaviour.requests}
        assert sent == {"/health": None, "/model_info": f"Bearer {secret}"}
        s.behaviour.requests.clear()
        listening = invoke(
            "wait-ready", "--endpoint", s.endpoint, "--timeout", "3", *FAST,
            env={"CKPTCTL_API_KEY": secret},
        )  # fmt: skip
        assert listening.exit_code == 0, listening.stderr  # its 401 on /ping is an answer
        assert [r["headers"].get("Authorization") for r in s.behaviour.requests] == [None]
        bad = invoke(
            "wait-ready", "--endpoint", s.endpoint, "--for", "healthy", "--weight-version", "v7",
            "--timeout", ANSWERED, "--api-key", "sk-wrong-456", *FAST,
            env={"CKPTCTL_DEBUG": "1"},
        )  # fmt: skip
    assert bad.exit_code == 4 and "HTTP 401" in bad.stderr
    for r in (ok, listening, bad):
        assert secret not in r.stdout + r.stderr
        assert "sk-wrong-456" not in r.stdout + r.stderr


# -- output discipline ----------------------------------------------------------------------------


def test_one_line_per_state_change_not_per_poll(refused_endpoint: str) -> None:
    r = invoke("wait-ready", "--endpoint", refused_endpoint, "--timeout", "1", "--interval", "0.02")
    assert r.exit_code == 4
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    # "waiting up to...", one "connection refused" line for dozens of polls, the error line
    # (and at most one more state: a last attempt the deadline cut short has no answer).
    assert lines[0].startswith("waiting up to 1s (--timeout) for "), lines  # the flag, first
    assert lines[-1].startswith("error:"), lines
    states = lines[1:-1]
    assert sum("connection refused" in line for line in states) == 1 and len(states) <= 2, lines
    assert r.stdout == ""


def test_quiet_prints_only_the_error(refused_endpoint: str) -> None:
    r = invoke("wait-ready", "--endpoint", refused_endpoint, "--timeout", "0.3", "-q", *FAST)
    assert r.exit_code == 4
    assert [line.startswith("error:") for line in r.stderr.splitlines()] == [True]


@pytest.mark.parametrize(
    "args", [["--for", "ready"], ["--interval", "0"], ["--engine", "tgi"], ["--bogus"]]
)
def test_bad_flags_exit_2(args: list[str]) -> None:
    r = invoke("wait-ready", *args)
    assert r.exit_code == 2


# -- the installed script -------------------------------------------------------------------------


def test_installed_script_json_and_exit_codes(server: FakeServer) -> None:
    r = run_script("wait-ready", "--endpoint", server.endpoint, "--json", "--timeout", "5")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ready"] is True
    r = run_script(
        "wait-ready",
        "--endpoint",
        server.endpoint,
        "--for",
        "healthy",
        "--json",
        "--timeout",
        "0.3",
        "--interval",
        "0.05",
    )
    assert r.returncode == 4
    assert json.loads(r.stdout)["ready"] is False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_exits_130_without_traceback(sig: int, refused_endpoint: str) -> None:
    # A shell starts a background job with SIGINT ignored, and children inherit that: if the
    # suite runs in one (`make test &`), Ctrl-C's default comes back for this process only.
    default_sigint = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", default_sigint, ckptctl_script(), "wait-ready"]
        + ["--endpoint", refused_endpoint, "--timeout", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Its first probe has been answered: the command runs, its handlers are in place.
        early = read_until(proc, "connection refused")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = early + err
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted" in err


def test_python_dash_m_runs_the_same_cli(refused_endpoint: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ckptctl", "wait-ready", "--timeout", "0.2"]
        + ["--endpoint", refused_endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert r.returncode == 4
    assert "error:" in r.stderr


@pytest.mark.parametrize("bad", ["localhost:19730", "http://[bad", "unix:///tmp/x.sock"])
def test_malformed_endpoint_is_a_usage_error_at_once(bad: str) -> None:
    r = invoke("wait-ready", "--endpoint", bad, "--timeout", "30")
    assert r.exit_code == 2 and "is not an http(s) URL" in r.stderr  # a wait would end in 4


# -- what the lines say (issue 25, item 8) -----------------------------------------------------


def test_a_running_but_unhealthy_server_is_not_called_down(server: FakeServer) -> None:
    """SGLang answers /health with 503 until it has weights: it is running, and the advice says
    what to do about the 503, not to check that it runs."""
    r = invoke(
        "wait-ready", "--endpoint", server.endpoint, "--for", "healthy", "--timeout", ANSWERED,
        "--interval", "0.05", "--attempt-timeout", ANSWERED,  # (its 503s seen on a busy machine)
    )  # fmt: skip
    assert r.exit_code == 4
    error = r.stderr.splitlines()[-1]
    assert "check that the server is running" not in error
    assert "the server is running but not healthy: SGLang answers 503 until it has weights" in (
        error
    )


def test_a_refused_connection_still_says_to_check_the_server(refused_endpoint: str) -> None:
    r = invoke("wait-ready", "--endpoint", refused_endpoint, "--timeout", "0.2", *FAST)
    assert r.exit_code == 4
    assert "check that the server is running" in r.stderr.splitlines()[-1]


def test_success_says_what_it_waited_for_in_good_english(server: FakeServer) -> None:
    r = invoke("wait-ready", "--endpoint", server.endpoint, "--timeout", "10", *ONE_ATTEMPT)
    assert r.exit_code == 0, r.stderr
    last = r.stdout.splitlines()[-1]  # the result: stdout
    assert re.fullmatch(
        rf"{re.escape(server.endpoint)} is listening after \d+\.\ds \(1 attempt; it answered "
        r"HTTP 503\)",
        last,
    ), last

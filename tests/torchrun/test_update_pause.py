"""`update --pause MODE` into servers that are generating (issue 35), on CPU: the real CLI with
checkpoint-engine's ParameterServer stood in (cpu_ps_rank.py), one process or a torchrun job,
against stand-in servers on loopback whose generations hold SGLang's model-update reader lock
and honour each engine's pause modes (tests/support/fake_generation.py).

Every assertion is on what the servers saw and in which order (the stand-in numbers every
request's arrival and answer across servers) and on the counts of requests completed, aborted,
retracted and held - never on time. Generations run "for ever" until the test ends them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest
from conftest import invoke, wait_until
from fake_generation import in_flight
from fake_server import Behaviour, FakeServer, rank_pid, run_torchrun, torchrun_job
from locations import CPU_PS_RANK, TINY

pytestmark = pytest.mark.slow


def update_cmd(*servers: FakeServer, engine: str = "sglang", timeout: int = 60) -> list[str]:
    endpoints = [a for s in servers for a in ("--endpoint", s.endpoint)]
    return [
        "update", "--checkpoint-path", str(TINY), "--inference-parallel-size", "1",
        *endpoints, "--engine", engine, "--timeout", str(timeout), "--json",
    ]  # fmt: skip


def update(server: FakeServer, *flags: str, engine: str = "sglang") -> Popen:
    """A one-process `update` into `server`, under way."""
    return subprocess.Popen(
        [sys.executable, CPU_PS_RANK, *update_cmd(server, engine=engine), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


Popen = subprocess.Popen  # (of str)


def ended(proc: Popen) -> tuple[int, dict[str, Any], str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, json.loads(out), err


def generating(server: FakeServer, count: int = 3) -> Any:
    """`count` generations in flight for the whole block (they end when the test ends them);
    their answers, once they came."""
    return in_flight(server.endpoint, server.behaviour.generations(), count)


def requests(server: FakeServer, path: str) -> list[dict[str, Any]]:
    return [r for r in server.behaviour.requests if r["path"].split("?")[0] == path]


def finish_reasons(answers: list[dict[str, Any]]) -> set[str]:
    if answers and "choices" in answers[0]:
        return {a["choices"][0]["finish_reason"] for a in answers}
    return {a["meta_info"]["finish_reason"]["type"] for a in answers}


# (profile, mode) -> what the stand-in counts of the 3 generations in flight, and whether the
# update asked SGLang to flush its cache.
MODES = {
    ("sglang-0.5.23", "abort"): ({"aborted": 3}, True),
    ("sglang-0.5.23", "retract"): ({"retracted": 3, "completed": 3}, True),
    ("sglang-0.5.23", "in_place"): ({"held": 3, "completed": 3}, False),
    ("sglang-0.5.14", "retract"): ({"retracted": 3, "completed": 3}, False),  # (0.5.10-0.5.20)
    ("vllm", "abort"): ({"aborted": 3}, None),
    ("vllm", "wait"): ({"completed": 3}, None),
    ("vllm", "keep"): ({"retracted": 3, "completed": 3}, None),  # (clear_cache: preempted)
}


@pytest.mark.parametrize(("profile", "mode"), list(MODES))
def test_each_mode_pauses_before_the_weights_and_resumes_after(profile: str, mode: str) -> None:
    counts, flush = MODES[(profile, mode)]
    engine = "vllm" if profile == "vllm" else "sglang"
    update_path = "/collective_rpc" if engine == "vllm" else "/update_weights_from_ipc"
    resume_path = "/resume" if engine == "vllm" else "/continue_generation"
    with FakeServer(Behaviour(profile=profile, abort_poll_s=0.01)) as s:
        gen = s.behaviour.generations()
        with generating(s) as answers:
            job = update(s, "--pause", mode, engine=engine)
            if mode == "wait":  # vLLM answers the pause once its generations have ended
                wait_until(lambda: requests(s, "/pause"), what="the pause to arrive")
                gen.finish_all()
            code, doc, err = ended(job)
            assert code == 0, err[-3000:]
            after = gen.snapshot()
            if mode in ("retract", "in_place", "keep"):  # held over the push, going on after
                assert after["running"] == 3 and after["completed"] == 0, after
        snapshot = gen.snapshot()
        assert {k: snapshot[k] for k in counts} == counts, snapshot
        lost = 0 if mode != "abort" else 3
        assert snapshot["aborted"] == lost and len(answers) == 3
        assert finish_reasons(answers) == {"abort" if lost else "length"}
        assert not snapshot["paused"]
        (pause,) = requests(s, "/pause_generation" if engine == "sglang" else "/pause")
        (pushed,) = requests(s, update_path)
        (resumed,) = requests(s, resume_path)
        assert pause["answered"] < pushed["arrived"] and pushed["answered"] < resumed["arrived"]
        if flush is not None:
            assert json.loads(pushed["body"])["flush_cache"] is flush
    stages = doc["ranks"][0]["stages"]
    assert f"{s.endpoint}: paused ({mode})" in stages["pause"]["detail"]
    assert stages["resume"]["detail"] == f"{s.endpoint}: resumed"
    assert "drain" not in stages  # (nothing to drain: the server was paused)


def test_without_a_pause_the_update_waits_for_the_generations_and_says_how_long() -> None:
    """--pause none (the default): SGLang's update takes its writer lock, after every generation
    in flight; the wait is the "drain" stage, apart from the transfer."""
    with FakeServer(Behaviour()) as s:
        gen = s.behaviour.generations()
        with generating(s) as answers:
            job = update(s, "--weight-version", "v2")
            wait_until(lambda: gen.snapshot()["update_waiting"], what="the update to wait")
            assert gen.snapshot()["completed"] == 0
            gen.finish_all()
            code, doc, err = ended(job)
        assert code == 0, err[-3000:]
        (pushed,) = requests(s, "/update_weights_from_ipc")
        assert all(g["answered"] < pushed["answered"] for g in requests(s, "/generate"))
        assert gen.snapshot()["completed"] == 3 and finish_reasons(answers) == {"length"}
        assert not requests(s, "/pause_generation") and not requests(s, "/continue_generation")
    stages = doc["ranks"][0]["stages"]
    assert "pause" not in stages and "resume" not in stages
    assert stages["drain"]["wall_s"] <= stages["update"]["wall_s"]
    assert "waiting for the generations in flight" in err  # (the live view's line)
    assert "of it the drain" in stages["update"]["detail"]


def test_a_mode_the_engine_lacks_is_exit_2_before_any_request() -> None:
    with FakeServer(Behaviour(profile="vllm")) as s:
        r = invoke(*update_cmd(s, engine="vllm"), "--pause", "retract")
        assert r.exit_code == 2, r.stderr
        assert (
            "--pause retract is not one of vllm's pause modes: none, abort, wait, keep"
            in (json.loads(r.stdout)["error"])
        )
        r = invoke(*update_cmd(s), "--pause", "bogus")
        assert r.exit_code == 2
        assert s.behaviour.requests == []


@pytest.mark.parametrize(
    ("version", "mode", "said"),
    [
        ("0.5.9", "in_place", "runs sglang 0.5.9, which deadlocks an IPC update"),
        ("0.5.5.post3", "retract", "runs sglang 0.5.5.post3, which takes any mode and aborts"),
    ],
)
def test_a_mode_the_server_s_version_cannot_honour_is_refused_before_anything_is_sent(
    version: str, mode: str, said: str
) -> None:
    with FakeServer(Behaviour(version=version)) as s:
        with generating(s, 1):
            code, doc, err = ended(update(s, "--pause", mode))
        assert code == 1, err[-3000:]
        assert said in doc["error"] and f"--pause {mode} is refused" in doc["error"]
        asked = {r["path"] for r in s.behaviour.requests if r["path"] != "/generate"}
        assert asked <= {"/ping", "/get_server_info"}, asked  # no pause, no weights


def test_a_pause_refused_sends_no_weight_and_leaves_no_server_paused() -> None:
    """Two servers, one job: the second refuses the pause (HTTP 500). Nothing is pushed to
    either, the error names it, and both are resumed (the first may have been paused)."""
    with FakeServer(Behaviour()) as a, FakeServer(Behaviour()) as b:
        b.behaviour.mode, b.behaviour.mode_paths = "http500", ("/pause_generation",)
        r = run_torchrun(CPU_PS_RANK, *update_cmd(a, b), "--pause", "retract", nproc=2)
        assert r.returncode == 1, r.stderr[-3000:]
        assert f"{b.endpoint} refused the pause (--pause retract): HTTP 500" in r.stdout
        for s in (a, b):
            assert not requests(s, "/update_weights_from_ipc")
            assert requests(s, "/continue_generation")  # (resuming is idempotent)
            assert not s.behaviour.generations().snapshot()["paused"]
        # (Each rank pauses its own server at once: b's refusal may end the job before a's pause
        # left, or while it was on its way. Either way a was never left paused, nor pushed.)
        assert all(p["status"] == 200 for p in requests(a, "/pause_generation"))


def test_no_server_takes_weights_before_every_server_is_paused() -> None:
    """Two servers; the second never answers its pause. The first, paused at once, gets no
    update all the same (SGLang #25319: a pause that comes while an update waits for the
    writer lock deadlocks it); the job ends at its deadline with both resumed."""
    with FakeServer(Behaviour()) as a, FakeServer(Behaviour()) as b:
        b.behaviour.mode, b.behaviour.mode_paths = "hang", ("/pause_generation",)
        r = run_torchrun(CPU_PS_RANK, *update_cmd(a, b, timeout=8), "--pause", "retract", nproc=2)
        assert r.returncode != 0 and json.loads(r.stdout)["exit_code"] == 4, r.stderr[-3000:]
        assert requests(a, "/pause_generation")[0]["status"] == 200
        assert not requests(a, "/update_weights_from_ipc")
        for s in (a, b):
            assert requests(s, "/continue_generation")
        assert not a.behaviour.generations().snapshot()["paused"]


def test_a_pause_route_the_server_lacks_is_a_refusal_and_nothing_is_pushed() -> None:
    """A server reporting no version ckptctl can read: abort is tried (every SGLang with the
    route aborts), and the 404 refuses the push."""
    with FakeServer(Behaviour(version="dev-build")) as s:
        code, doc, err = ended(update(s, "--pause", "abort"))
        assert code == 1, err[-3000:]
        assert "refused the pause (--pause abort): HTTP 404 on /pause_generation" in doc["error"]
        assert not requests(s, "/update_weights_from_ipc")


def test_a_resume_is_retried_and_one_that_keeps_failing_fails_the_update() -> None:
    with FakeServer(Behaviour()) as s:
        b = s.behaviour
        b.mode, b.mode_paths, b.mode_times = "http500", ("/continue_generation",), 2
        code, doc, err = ended(update(s, "--pause", "in_place"))
        assert code == 0, err[-3000:]
        assert b.statuses("/continue_generation") == [500, 500, 200]
        assert "(3 attempts)" in doc["ranks"][0]["stages"]["resume"]["detail"]

        b.mode, b.mode_times = "reset", None  # it never answers a resume again
        code, doc, err = ended(update(s, "--pause", "in_place", "--weight-version", "v3"))
        assert code == 1, err[-3000:]
        assert doc["error"].startswith("the weights went in, but ")
        assert f"{s.endpoint} did not resume its generation (4 attempts)" in doc["error"]
        assert f"resume it by hand (POST {s.endpoint}/continue_generation)" in doc["error"]
        assert b.weight_version == "v3"  # (the push itself went through)
        assert b.generations().snapshot()["paused"]  # the stand-in really is left paused


@pytest.mark.parametrize(("sig", "rank"), [(signal.SIGTERM, 1), (signal.SIGKILL, 0)])
def test_a_job_killed_while_its_servers_are_paused_resumes_every_one(
    sig: signal.Signals, rank: int
) -> None:
    """Two servers; the first never answers the update (it hangs), so the job sits with both
    paused. SIGTERM to rank 1 ends the job, and on their way out the ranks resume both; SIGKILL
    to rank 0 leaves no chance to the first server's own leader, and the other rank of the
    node resumes it too (torchrun ends that rank with SIGTERM)."""
    with FakeServer(Behaviour()) as a, FakeServer(Behaviour()) as b:
        a.behaviour.mode, a.behaviour.mode_paths = "hang", ("/update_weights_from_ipc",)
        with torchrun_job(CPU_PS_RANK, *update_cmd(a, b), "--pause", "in_place", nproc=2) as job:
            wait_until(lambda: requests(a, "/update_weights_from_ipc"), what="the update")
            assert all(s.behaviour.generations().snapshot()["paused"] for s in (a, b))
            os.kill(rank_pid(job, rank), sig)
            _, err = job.communicate(timeout=120)
        assert job.returncode != 0
        assert "interrupted by SIGTERM" in err, err[-3000:]
        for s in (a, b):
            assert requests(s, "/continue_generation"), err[-3000:]
            assert not s.behaviour.generations().snapshot()["paused"]


def test_a_failure_after_the_pause_resumes_the_server_on_the_way_out() -> None:
    """The weight version cannot be read back (the server answers HTML): the update fails on
    its own rank, after the push, and still resumes the server it paused."""
    with FakeServer(Behaviour(mode="bad_json")) as s:
        code, doc, err = ended(update(s, "--pause", "in_place", "--weight-version", "v2"))
        assert code == 1 and "after the update, not 'v2'" in doc["error"], err[-3000:]
        assert requests(s, "/continue_generation")
        assert not s.behaviour.generations().snapshot()["paused"]


def test_the_deadline_of_an_update_whose_server_is_paused_resumes_it() -> None:
    with FakeServer(Behaviour()) as s:
        s.behaviour.mode, s.behaviour.mode_paths = "hang", ("/update_weights_from_ipc",)
        code, doc, err = ended(update(s, "--pause", "retract", "--timeout", "5"))
        assert code == 4, err[-3000:]
        assert requests(s, "/continue_generation")
        assert not s.behaviour.generations().snapshot()["paused"]


def test_a_pause_that_never_answers_names_the_flag_that_bounds_it() -> None:
    """The pause is a wait (SGLang's abort and vLLM's wait answer once the generations in
    flight have ended): its first line names its bound, and running out says what to raise."""
    with FakeServer(Behaviour()) as s:
        s.behaviour.mode, s.behaviour.mode_paths = "hang", ("/pause_generation",)
        code, doc, err = ended(update(s, "--pause", "abort", "--timeout", "8"))
        assert code == 4, err[-3000:]
        assert "did not answer the pause" in doc["error"] and "raise --timeout" in doc["error"]
        (line,) = [x for x in err.splitlines() if x.startswith("pausing generation")]
        assert "(--timeout)" in line, line
        assert requests(s, "/continue_generation")

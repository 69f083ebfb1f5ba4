"""`serve --pause` and `push --pause` (issue 35): a serve job on CPU (torchrun, the real
ParameterServerSession around a CPU engine speaking checkpoint-engine's IPC protocol over zmq:
cpu_ps_rank.py, CPU_PS_TRANSFER=zmq) pushing into stand-in servers that are generating
(tests/support/fake_generation.py), one transaction across every server of the job.

Assertions are on what the servers saw and in which order (the stand-ins number every request's
arrival and answer, across servers), on the counts of generations completed, aborted, retracted
and held, and on the job's answers - never on time."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import run_script, wait_for_path, wait_until
from fake_generation import start
from fake_server import Behaviour, FakeServer, free_master_port, job_of_ranks
from fake_worker import ZmqWorkers
from locations import CPU_PS_RANK
from test_serve_faults import push, push_in_background, status, stop

pytestmark = pytest.mark.slow


class Site:
    """A stand-in SGLang whose workers take the weights over zmq, and its generations."""

    def __init__(self) -> None:
        self.workers = ZmqWorkers()
        self.server = FakeServer(Behaviour(on_update=self.workers, abort_poll_s=0.01)).start()
        self.endpoint = self.server.endpoint
        self.gen = self.server.behaviour.generations()
        self._threads: list[threading.Thread] = []

    def requests(self, path: str) -> list[dict[str, Any]]:
        return [r for r in self.server.behaviour.requests if r["path"].split("?")[0] == path]

    def generate(self, count: int) -> None:
        """`count` generations in flight from now on, until `finish`."""
        threads, _ = start(self.endpoint, self.gen, count)
        self._threads += threads

    def finish(self) -> None:
        self.gen.finish_all()
        for t in self._threads:
            t.join(timeout=60)
        self._threads.clear()

    def close(self) -> None:
        self.workers.die()
        self.finish()
        self.server.stop()


@contextmanager
def serve_job(
    short_tmp: Path, sites: list[Site], tp: int, *flags: str
) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A serve job feeding `sites`, each of TP `tp`: under torchrun, or one process where that
    is one rank (the pause of one server is the subject there, not the ranks)."""
    sock = str(short_tmp / "serve.sock")
    endpoints = [a for s in sites for a in ("--endpoint", s.endpoint)]
    program = (
        CPU_PS_RANK, "serve", "--inference-parallel-size", str(tp), *endpoints,
        "--control-socket", sock, "--push-timeout", "300", *flags,
    )  # fmt: skip
    env = {"CPU_PS_TRANSFER": "zmq", "CPU_PS_BUCKETS": "4"}
    try:
        with job_of_ranks(tp * len(sites), *program, env=env) as job:
            assert wait_for_path(sock), "the serve job did not open its control socket"
            yield job, sock
    finally:
        for site in sites:
            site.close()


def answer(proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any], str]:
    """A push started with push_in_background, once it ended: (exit code, its answer, stderr)."""
    out, err = proc.communicate(timeout=180)
    return proc.returncode, json.loads(out), err


def test_three_servers_are_one_transaction(short_tmp: Path) -> None:
    """Three servers (three TP1 ranks), serve --pause retract: every push pauses all three
    before any takes weights and resumes them after; a mode SGLang lacks is refused before
    anything is sent; `status` shows the servers paused while a push holds them; and when one
    server fails mid-push, all three are restored to the last whole push before any of them
    is resumed, and the push names the one that failed."""
    sites = [Site(), Site(), Site()]
    a, b, c = sites
    with serve_job(short_tmp, sites, 1, "--pause", "retract") as (job, sock):
        for site in sites:
            site.generate(2)
        code, first, err = push(sock, "--weight-version", "v1")
        assert code == 0, err
        for site in sites:
            (paused,) = site.requests("/pause_generation")
            (pushed,) = site.requests("/update_weights_from_ipc")
            (resumed,) = site.requests("/continue_generation")
            assert json.loads(paused["body"]) == {"mode": "retract"}
            # no server took weights before every server was paused
            assert (
                max(s.requests("/pause_generation")[0]["answered"] for s in sites)
                < (pushed["arrived"])
            )
            # and none was resumed before every one had them
            assert (
                max(s.requests("/update_weights_from_ipc")[0]["answered"] for s in sites)
                < (resumed["arrived"])
            )
            snapshot = site.gen.snapshot()
            assert snapshot["retracted"] == 2 and snapshot["aborted"] == 0, snapshot
            assert snapshot["running"] == 2 and not snapshot["paused"]  # they go on
            site.finish()
            assert site.gen.snapshot()["completed"] == 2
        assert {r["figures"]["stages"]["resume"]["detail"] for r in first["ranks"]} == {
            f"{s.endpoint}: resumed" for s in sites
        }

        seen = sum(len(s.server.behaviour.requests) for s in sites)
        code, refused, err = push(sock, "--pause", "keep")
        assert code == 2, err
        assert "pause keep is not one of sglang's pause modes" in refused["error"]
        assert sum(len(s.server.behaviour.requests) for s in sites) == seen  # nothing sent

        a.workers.hold_at_bucket = 2
        held = push_in_background(sock, "--weight-version", "v2")
        wait_until(a.workers.holding.is_set, what="the first server's worker to hold a bucket")
        paused = status(sock)["paused"]
        assert paused["mode"] == "retract" and paused["since"] and not paused["resume_failed"]
        assert paused["servers"] == [s.endpoint for s in sites]
        human = run_script("status", "--control-socket", sock, timeout=30).stdout
        assert "generation paused (retract) since " in human, human
        a.workers.release()
        code, _, err = answer(held)
        assert code == 0, err
        assert status(sock)["paused"] is None

        b.workers.fail_at_bucket = 2
        code, failed, err = push(sock, "--weight-version", "v3")
        assert code == 1, err
        assert failed["error"].startswith(f"{b.endpoint}'s worker failed while loading")
        assert "injected failure" in failed["error"]
        assert "server weights: whole again (restored push 2)" in failed["error"]
        assert failed["failed_server"] == b.endpoint and failed["server_weights"] == "whole"
        restored = [s.requests("/update_weights_from_ipc")[-1] for s in sites]
        resumed = [s.requests("/continue_generation")[-1] for s in sites]
        assert all(r["status"] == 200 for r in restored)
        assert max(r["answered"] for r in restored) < min(r["arrived"] for r in resumed)
        for site in sites:
            assert len(site.requests("/pause_generation")) == 3  # once per push: not to restore
            assert site.server.behaviour.weight_version == "v2"
            assert not site.gen.snapshot()["paused"]
        stop(job, sock)


def test_a_push_s_own_mode_its_stages_and_a_stop_while_paused(short_tmp: Path) -> None:
    """One TP2 server (its second rank pauses nothing and waits for the first's pause), serve
    --pause none (the default): a push waits for the generations in flight (its "drain" stage);
    `push --pause in_place` holds them instead (no flush of the cache, which SGLang would
    refuse), its pause and resume in the figures, the trace and the metrics; a server that does
    not resume fails the push and is resumed by the next one; and `ckptctl stop` while a push
    holds the server paused (its update request unanswered) ends the job with the server
    resumed."""
    from test_observe_metrics import _first_scrape, _value

    site = Site()
    port = free_master_port()
    trace = short_tmp / "push.json"
    with serve_job(short_tmp, [site], 2, "--metrics-port", str(port)) as (job, sock):
        url = f"http://127.0.0.1:{port}/metrics"
        site.generate(2)
        waited = push_in_background(sock, "--weight-version", "v1")
        wait_until(lambda: site.gen.snapshot()["update_waiting"], what="the update to wait")
        site.finish()
        code, doc, err = answer(waited)
        assert code == 0, err
        stages = doc["ranks"][0]["figures"]["stages"]
        assert stages["drain"]["detail"] == "until the server's worker connected"
        assert "pause" not in stages and "resume" not in stages
        assert not site.requests("/pause_generation")

        site.generate(3)
        code, doc, err = push(sock, "--pause", "in_place", "--trace", str(trace))
        assert code == 0, err
        snapshot = site.gen.snapshot()
        assert snapshot["held"] == 3 and snapshot["running"] == 3 and not snapshot["paused"]
        assert (
            json.loads(site.requests("/update_weights_from_ipc")[-1]["body"])["flush_cache"]
            is False
        )
        stages = doc["ranks"][0]["figures"]["stages"]
        assert "drain" not in stages and stages["resume"]["detail"] == f"{site.endpoint}: resumed"
        assert stages["pause"]["detail"].endswith("paused (in_place)")
        spans = [e["name"] for e in json.loads(trace.read_text())["traceEvents"]
                 if e["ph"] == "X" and e["pid"] == 0 and e["tid"] == 1]  # fmt: skip
        assert spans.index("pause") < spans.index("update") < spans.index("resume"), spans
        site.finish()
        samples = _first_scrape(url)
        for stage in ("drain", "pause", "resume"):
            assert _value(samples, "ckptctl_push_stage_duration_seconds_count", stage=stage) == 1

        # A server that does not resume: the push went in whole, and fails (exit 1) saying so;
        # status keeps its weights as that push's and shows it left paused; the next command
        # resumes it.
        b = site.server.behaviour
        b.mode, b.mode_paths = "reset", ("/continue_generation",)
        code, doc, err = push(sock, "--pause", "abort", "--weight-version", "v3")
        assert code == 1, err
        assert doc["error"].startswith("the weights went in whole, but "), doc["error"]
        assert f"resume it by hand (POST {site.endpoint}/continue_generation)" in doc["error"]
        st = status(sock)
        assert st["server_weights"] == "whole" and st["weights"]["weight_version"] == "v3", st
        assert st["paused"]["resume_failed"] and st["paused"]["servers"] == [site.endpoint]
        from ckptctl import client

        assert client.status(control_socket=sock, history=True)["pushes"][-1]["outcome"] == (
            "failed"  # (not "restored": nothing was restored)
        )
        assert site.gen.snapshot()["paused"]
        b.mode = None
        code, _, err = push(sock, "--weight-version", "v4")  # (--pause none: resumed after all)
        assert code == 0, err
        assert status(sock)["paused"] is None and not site.gen.snapshot()["paused"]

        # The server takes the next update's request and never answers it, nor connects.
        site.server.behaviour.mode = "hang"
        site.server.behaviour.mode_paths = ("/update_weights_from_ipc",)
        pushes = len(site.requests("/update_weights_from_ipc"))
        held = push_in_background(sock, "--pause", "retract")
        wait_until(
            lambda: len(site.requests("/update_weights_from_ipc")) > pushes, what="the update"
        )
        assert site.gen.snapshot()["paused"]
        stop(job, sock)
        code, doc, _ = answer(held)
        assert code == 1 and doc["error"].startswith("stopped"), doc
        assert doc["server_weights"] is None  # (no worker took anything: nothing to restore)
        assert site.requests("/continue_generation")[-1]["status"] == 200
        assert not site.gen.snapshot()["paused"]


def test_a_restore_after_a_push_without_a_pause_leaves_no_server_paused(short_tmp: Path) -> None:
    """serve --pause retract, `push --pause none` that fails mid-transfer: the restore after it
    keeps the push's mode (it pauses nothing), and no server is left paused after the command
    (a restore that paused with the job's mode went unresumed: the resume read the push's)."""
    site = Site()
    with serve_job(short_tmp, [site], 1, "--pause", "retract") as (job, sock):
        code, _, err = push(sock, "--weight-version", "v1")
        assert code == 0, err
        site.workers.fail_at_bucket = 2
        code, failed, err = push(sock, "--pause", "none", "--weight-version", "v2")
        assert code == 1, err
        assert "server weights: whole again (restored push 1)" in failed["error"], failed
        assert status(sock)["paused"] is None
        assert not site.gen.snapshot()["paused"]
        assert len(site.requests("/pause_generation")) == 1  # (the first push's only)
        stop(job, sock)


def test_status_shows_a_server_of_another_rank_left_paused(short_tmp: Path) -> None:
    """Two servers (two TP1 ranks); the second, whose leader is rank 1, does not resume: the
    push fails naming it, and `status` (answered by rank 0) shows it LEFT PAUSED until the
    next command resumes it."""
    a, b = Site(), Site()
    with serve_job(short_tmp, [a, b], 1, "--pause", "retract") as (job, sock):
        behaviour = b.server.behaviour
        behaviour.mode, behaviour.mode_paths = "reset", ("/continue_generation",)
        code, doc, err = push(sock, "--weight-version", "v1")
        assert code == 1, err
        assert doc["not_resumed"] and b.endpoint in doc["not_resumed"][0], doc
        assert b.gen.snapshot()["paused"] and not a.gen.snapshot()["paused"]
        paused = status(sock)["paused"]
        assert paused is not None and paused["resume_failed"], paused
        assert paused["servers"] == [b.endpoint] and paused["mode"] == "retract"
        behaviour.mode = None
        code, _, err = push(sock, "--weight-version", "v2")
        assert code == 0, err
        assert status(sock)["paused"] is None and not b.gen.snapshot()["paused"]
        stop(job, sock)

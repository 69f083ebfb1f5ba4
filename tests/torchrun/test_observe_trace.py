"""`update --trace FILE` and `push --trace FILE`: a Chrome trace-event timeline of every rank,
from real torchrun jobs on CPU (2 ranks, real HTTP to a fake SGLang whose workers speak
checkpoint-engine's bucket protocol over real zmq sockets: tests/fake_worker.ZmqWorkers), with
only checkpoint-engine's ParameterServer stood in (tests/cpu_ps_rank.py)."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import cpu_serve_job, run_script, wait_for_path
from fake_server import Behaviour, FakeServer, run_torchrun
from fake_worker import ZmqWorkers
from locations import CPU_PS_RANK as SCRIPT
from locations import TINY

ZMQ = {"CPU_PS_TRANSFER": "zmq", "CPU_PS_BUCKETS": "3", "OMP_NUM_THREADS": "1"}
# The tracks of each rank (ckptctl.observe.timeline).
STAGES, BACKGROUND, BUCKETS, COPIES, WORKER, REQUEST, BUFFERS = 1, 2, 3, 4, 5, 6, 7
EXCHANGES = [  # a transfer's exchange with the server's worker, in order
    "worker connects, takes the IPC handle",
    "worker releases the IPC buffer",
    "ParameterServer frees its transfer buffers",
    "worker runs its post-hook",
]


def _spans(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _check_sane(doc: dict[str, Any]) -> None:
    """Times are whole, non-negative microseconds; on each track (rank, thread) two events
    are either one after the other or one inside the other."""
    spans = _spans(doc)
    assert spans
    for e in spans:
        assert isinstance(e["ts"], int) and isinstance(e["dur"], int)
        assert e["ts"] >= 0 and e["dur"] >= 0, e
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in spans:
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for events in tracks.values():
        for i, a in enumerate(events):
            for b in events[i + 1 :]:
                a0, a1, b0, b1 = a["ts"], a["ts"] + a["dur"], b["ts"], b["ts"] + b["dur"]
                apart = a1 <= b0 or b1 <= a0
                nested = a0 <= b0 and b1 <= a1 or b0 <= a0 and a1 <= b1
                assert apart or nested, (a, b)


def _on(doc: dict[str, Any], rank: int, tid: int) -> list[dict[str, Any]]:
    return [e for e in _spans(doc) if e["pid"] == rank and e["tid"] == tid]


@pytest.mark.slow
def test_update_writes_one_trace_with_every_ranks_stages_and_buckets(tmp_path: Path) -> None:
    trace = tmp_path / "update.json"
    with FakeServer(Behaviour(on_update=ZmqWorkers())) as s:
        r = run_torchrun(
            SCRIPT, "update", "--checkpoint-path", str(TINY), "--timeout", "60",
            "--inference-parallel-size", "2", "--endpoint", s.endpoint,
            "--weight-version", "v1", "--trace", str(trace),
            env={**os.environ, **ZMQ},
        )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"trace: {trace} (" in r.stderr
    doc = json.loads(trace.read_text())
    _check_sane(doc)
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    for rank in (0, 1):
        stages = _on(doc, rank, STAGES)
        order = ["split", "start", "register", "wait_server", "group", "gather_metas", "update"]
        assert [e["name"] for e in stages if e["name"] != "drain"][:7] == order, stages
        assert [e["name"] for e in _on(doc, rank, BACKGROUND)] == ["read", "pin"]
        buckets = _on(doc, rank, BUCKETS)
        assert [e["name"] for e in buckets] == ["bucket 0", "bucket 1", "bucket 2"]
        assert all(e["args"]["bytes"] > 0 for e in buckets)
        update = next(e for e in stages if e["name"] == "update")
        for b in buckets:  # every bucket went out and came back within the update
            assert update["ts"] <= b["ts"] and b["ts"] + b["dur"] <= update["ts"] + update["dur"]
        # --pause none: the leader waited for the server to take the weights (the drain), within
        # the update, before the first bucket went out
        drains = [e for e in stages if e["name"] == "drain"]
        assert len(drains) == (rank == 0), stages
        for d in drains:
            assert update["ts"] <= d["ts"] and d["ts"] + d["dur"] <= buckets[0]["ts"]
    assert _on(doc, 0, STAGES)[-1]["name"] == "verify"  # (the leader reads the version back)


@pytest.mark.slow
def test_push_trace_is_written_by_the_serve_job(short_tmp: Path) -> None:
    sock, trace = str(short_tmp / "serve.sock"), short_tmp / "push.json"
    workers = ZmqWorkers()
    with (
        FakeServer(Behaviour(on_update=workers)) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, env=ZMQ) as job,
    ):
        assert wait_for_path(sock)
        r = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY), "--json",
            "--trace", str(trace), timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        answer = json.loads(r.stdout)
        assert answer["trace"]["path"] == str(trace) and answer["trace"]["events"] > 0
        assert all("trace_events" not in rank for rank in answer["ranks"])  # (not in the answer)
        assert f"trace: {trace} (" in r.stderr
        doc = json.loads(trace.read_text())
        _check_sane(doc)
        for rank in (0, 1):
            stages = [e["name"] for e in _on(doc, rank, STAGES)]
            for stage in ("split", "register", "wait_server", "gather_metas", "update"):
                assert stage in stages, (rank, stages)
            assert len(_on(doc, rank, BUCKETS)) == 3
            # The rest of the exchange with the worker, in order, around the buckets.
            worker = _on(doc, rank, WORKER)
            assert [e["name"] for e in worker] == EXCHANGES, worker
            buckets = _on(doc, rank, BUCKETS)
            assert worker[0]["ts"] + worker[0]["dur"] <= buckets[0]["ts"]
            assert buckets[-1]["ts"] + buckets[-1]["dur"] <= worker[1]["ts"]
            for a, b in itertools.pairwise(worker):
                assert a["ts"] + a["dur"] <= b["ts"] + 1, (a, b)  # (rounded to the µs)
        # Only the group's leader asks the server.
        (post,) = _on(doc, 0, REQUEST)
        assert post["name"].startswith("POST to ") and _on(doc, 1, REQUEST) == []
        # A second push: the trace of the first is replaced (a trace), a file that is not
        # a trace is refused before anything is pushed.
        other = short_tmp / "notes.txt"
        other.write_text("mine")
        refused = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY),
            "--trace", str(other), timeout=120,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert "not a trace ckptctl wrote" in refused.stderr and other.read_text() == "mine"
        assert workers.updates == 1
        again = run_script(
            "push", "--control-socket", sock, "--checkpoint-path", str(TINY), "--json",
            "--trace", str(trace), timeout=120,
        )  # fmt: skip
        assert again.returncode == 0, again.stderr
        assert json.loads(trace.read_text())["traceEvents"] != doc["traceEvents"]
        assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
        out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]


def test_a_trace_replaces_only_a_trace_ckptctl_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptctl.errors import UsageError
    from ckptctl.observe import timeline

    events = [{"name": "split", "ph": "X", "ts": 5, "dur": 1, "pid": 0, "tid": 1}]
    path = tmp_path / "t.json"
    assert timeline.write(str(path), events) == 1
    assert timeline.write(str(path), events) == 1  # a trace written before: replaced
    doc = json.loads(path.read_text())  # a trace-event file, with ckptctl's mark in it
    assert doc["traceEvents"][0]["ts"] == 0 and doc["otherData"]["producer"] == "ckptctl"

    mine = tmp_path / "mine.json"
    mine.write_text('{"other": 1}')
    # Another tool's Chrome trace (its own otherData after the events, as Chrome writes it).
    chrome = tmp_path / "chrome.json"
    chrome.write_text('{"traceEvents": [], "otherData": {"producer": "ckptctl"}}')
    link = tmp_path / "link.json"
    link.symlink_to(mine)
    for refused, why in (
        (mine, "not a trace ckptctl wrote"),
        (chrome, "not a trace ckptctl wrote"),
        (link, "a symlink"),
        (tmp_path, "not a regular file"),
        (tmp_path / "nowhere" / "t.json", "no directory"),
    ):
        with pytest.raises(UsageError, match=why):
            timeline.write(str(refused), events)
    assert mine.read_text() == '{"other": 1}' and link.is_symlink()
    assert chrome.read_text() == '{"traceEvents": [], "otherData": {"producer": "ckptctl"}}'
    names = ["chrome.json", "link.json", "mine.json", "t.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    # Our own trace, when the process is not its owner's (root writing a user's file).
    written = path.read_bytes()
    monkeypatch.setattr(os, "geteuid", lambda: path.stat().st_uid + 1)
    with pytest.raises(UsageError, match="a file of another user"):
        timeline.write(str(path), events)
    assert path.read_bytes() == written


def test_update_refuses_a_trace_file_that_is_not_one(tmp_path: Path) -> None:
    target = tmp_path / "keep.txt"
    target.write_text("keep")
    r = run_script("update", "--checkpoint-path", str(TINY), "--trace", str(target))
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "not a trace ckptctl wrote" in r.stderr
    assert target.read_text() == "keep"

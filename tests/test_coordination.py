"""Real torchrun jobs on CPU: one rank fails or dies, or time runs out - every rank ends, promptly."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
from fake_server import free_port, torchrun_cmd

SCRIPT = str(Path(__file__).with_name("coordination_rank.py"))


def _torchrun(
    scenario: str, nproc: int = 2, *args: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = torchrun_cmd(SCRIPT, scenario, *args, nproc=nproc)
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return r, time.monotonic() - t0


pytestmark = pytest.mark.slow


def test_figures_are_collected_through_torchruns_store() -> None:
    r, _ = _torchrun("figures", nproc=3)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [0, 1, 2]


def test_a_failing_rank_ends_every_rank_with_its_message() -> None:
    r, took = _torchrun("fail")
    assert r.returncode != 0
    # rank 1 says what failed; rank 0, stuck "in NCCL", says the same and does not wait 10 min.
    assert "[rank 1] error: the server refused the update: HTTP 400: boom" in r.stderr
    assert (
        "[rank 0] error: rank 1 failed: the server refused the update: HTTP 400: boom" in r.stderr
    )
    assert took < 20


def test_timeout_ends_every_rank_with_exit_4() -> None:
    r, took = _torchrun("timeout")
    assert r.returncode != 0
    assert "timed out after 3s during the test stage" in r.stderr
    assert "exitcode  : 4" in r.stderr or "exitcode: 4" in r.stderr.replace("  ", " ")
    assert took < 20


def test_a_rank_that_dies_silently_ends_the_job() -> None:
    r, took = _torchrun("die")
    assert r.returncode != 0
    assert took < 20


def test_nodes_that_see_different_checkpoints_are_stopped_with_exit_3(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import torch
    from ckpt_factory import write_real_checkpoint

    shards = [{"a": torch.ones(4)}, {"b": torch.zeros(8)}]
    same = write_real_checkpoint(tmp_path / "node0", shards, index=False)
    other = write_real_checkpoint(
        tmp_path / "node1", [*shards, {"stray": torch.ones(2)}], index=False
    )
    r, took = _torchrun("plan", 2, str(same), str(other))
    assert r.returncode != 0
    assert "rank 1 (on " in r.stderr and "sees a different checkpoint" in r.stderr
    assert "exitcode  : 3" in r.stderr or "exitcode: 3" in r.stderr.replace("  ", " ")
    assert took < 30
    agree, _ = _torchrun("plan", 2, str(same), str(same))
    assert agree.returncode == 0, agree.stderr
    assert "plans agree" in agree.stdout


def test_a_rank_dying_on_another_node_is_noticed_by_heartbeats() -> None:
    """Two torchrun agents ("nodes"): node 1's rank dies; node 0's torchrun never hears of it,
    so only the heartbeats in the store end rank 0 (stale after 3 s in this test)."""
    port = str(free_port())

    def node(rank: int) -> subprocess.Popen[str]:
        return subprocess.Popen(
            torchrun_cmd(SCRIPT, "die", nproc=1, nnodes=2, node_rank=rank, port=int(port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    t0 = time.monotonic()
    node0, node1 = node(0), node(1)
    _, err0 = node0.communicate(timeout=90)
    node1.communicate(timeout=90)
    took = time.monotonic() - t0
    assert node0.returncode != 0
    assert "rank 1 stopped responding" in err0 or "lost contact with the job's store" in err0
    assert took < 45


def test_barrier_waits_for_a_late_rank_without_starving_heartbeats() -> None:
    r, took = _torchrun("barrier", 3)
    assert r.returncode == 0, r.stderr
    waits = sorted(
        float(line.split()[-1][:-1]) for line in r.stdout.splitlines() if "passed" in line
    )
    assert len(waits) == 3
    assert waits[-1] >= 2.5  # ranks 1 and 2 really waited for rank 0
    assert "stopped responding" not in r.stderr


def test_a_signal_to_one_serving_rank_stops_them_all_cleanly() -> None:
    import re
    import signal as signals

    proc = subprocess.Popen(
        torchrun_cmd(SCRIPT, "serve"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    pids: dict[int, int] = {}
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.match(r"rank (\d) pid (\d+) serving", line)
        if m:
            pids[int(m.group(1))] = int(m.group(2))
    time.sleep(0.5)
    os.kill(pids[1], signals.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "rank 1: stopped by SIGTERM" in out
    assert "rank 0: stopped by SIGTERM (on rank 1)" in out

"""Real torchrun jobs on CPU: one rank fails or dies, or time runs out - every rank ends, promptly."""

from __future__ import annotations

import json
import os
import subprocess
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from fake_server import run_torchrun, torchrun_job
from locations import COORDINATION_RANK
from torchrun_launch import free_master_port

# Each scenario shows by its messages which event ended it (no --timeout of ours: an unbounded
# wait would end at the watchdog's 60 s with a different message and code).
pytestmark = pytest.mark.slow


def test_figures_are_collected_through_torchruns_store() -> None:
    r = run_torchrun(COORDINATION_RANK, "figures", nproc=3)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [0, 1, 2]


def test_a_failing_rank_ends_every_rank_with_its_message() -> None:
    r = run_torchrun(COORDINATION_RANK, "fail")
    assert r.returncode != 0
    # rank 1 says what failed; rank 0, stuck "in NCCL", says the same and does not wait 10 min.
    assert "[rank 1] error: the server refused the update: HTTP 400: boom" in r.stderr
    assert (
        "[rank 0] error: rank 1 failed: the server refused the update: HTTP 400: boom" in r.stderr
    )
    assert "timed out" not in r.stderr


def test_timeout_ends_every_rank_with_exit_4() -> None:
    r = run_torchrun(COORDINATION_RANK, "timeout")
    assert r.returncode != 0
    assert "timed out after 3s during the test stage" in r.stderr
    assert "exitcode  : 4" in r.stderr or "exitcode: 4" in r.stderr.replace("  ", " ")


def test_a_rank_that_dies_silently_ends_the_job() -> None:
    r = run_torchrun(COORDINATION_RANK, "die")
    assert r.returncode != 0
    assert "exitcode  : 9" in r.stderr or "exitcode: 9" in r.stderr.replace("  ", " ")
    assert "timed out" not in r.stderr  # ended by the death, not by the 60 s deadline


def _node_copies(root: Path) -> tuple[Path, Path]:
    """A checkpoint, and another node's copy of it with a stray file."""
    import torch
    from ckpt_factory import write_real_checkpoint

    shards = [{"a": torch.ones(4)}, {"b": torch.zeros(8)}]
    same = write_real_checkpoint(root / "node0", shards, index=False)
    other = write_real_checkpoint(root / "node1", [*shards, {"stray": torch.ones(2)}], index=False)
    return same, other


def test_nodes_that_see_different_checkpoints_are_stopped_with_exit_3(tmp_path: Path) -> None:
    same, other = _node_copies(tmp_path)
    r = run_torchrun(COORDINATION_RANK, "plan", str(same), str(other), nproc=2)
    assert r.returncode != 0
    assert "rank 1 (on " in r.stderr and "sees a different checkpoint" in r.stderr
    assert "exitcode  : 3" in r.stderr or "exitcode: 3" in r.stderr.replace("  ", " ")
    assert "plans agree" not in r.stdout


def test_nodes_that_see_the_same_checkpoint_go_on(tmp_path: Path) -> None:
    same, _ = _node_copies(tmp_path)
    agree = run_torchrun(COORDINATION_RANK, "plan", str(same), str(same), nproc=2)
    assert agree.returncode == 0, agree.stderr
    assert "plans agree" in agree.stdout


def test_a_rank_dying_on_another_node_is_noticed_by_heartbeats() -> None:
    """Two torchrun agents ("nodes"): node 1's rank dies; node 0's torchrun never hears of it,
    so only the heartbeats in the store end rank 0 (stale after 3 s in this test)."""
    port = free_master_port()

    def node(rank: int) -> AbstractContextManager[subprocess.Popen[str]]:
        return torchrun_job(COORDINATION_RANK, "die", nproc=1, nnodes=2, node_rank=rank, port=port)

    with node(0) as node0, node(1) as node1:
        _, err0 = node0.communicate(timeout=90)
        node1.communicate(timeout=90)
    assert node0.returncode != 0
    assert "rank 1 stopped responding" in err0 or "lost contact with the job's store" in err0
    assert "timed out" not in err0  # the heartbeats ended it, not the 60 s deadline


def test_barrier_waits_for_a_late_rank_without_starving_heartbeats() -> None:
    r = run_torchrun(COORDINATION_RANK, "barrier", nproc=3)
    assert r.returncode == 0, r.stderr
    passed = sorted(line for line in r.stdout.splitlines() if "passed the barrier" in line)
    # Ranks 1 and 2 left the barrier only after rank 0 had arrived, late (an order of events
    # in the store, not a duration).
    assert passed == [f"rank {r} passed the barrier, rank 0 late: True" for r in range(3)]
    assert "stopped responding" not in r.stderr


def _serving_pids(proc: subprocess.Popen[str]) -> dict[int, int]:
    import re

    pids: dict[int, int] = {}
    assert proc.stdout is not None
    while len(pids) < 2:  # each rank says so once serve() handles its signals
        line = proc.stdout.readline()
        assert line, "the job ended before serving"
        m = re.match(r"rank (\d) pid (\d+) serving", line)
        if m:
            pids[int(m.group(1))] = int(m.group(2))
    return pids


def test_a_signal_to_one_serving_rank_stops_them_all() -> None:
    """The signalled rank ends with success; the other reads the stop in the store, where
    anyone could have written it, and ends as interrupted (130), never with success."""
    import signal as signals

    with torchrun_job(COORDINATION_RANK, "serve") as proc:
        pids = _serving_pids(proc)
        os.kill(pids[1], signals.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, err
    assert "rank 1: stopped by SIGTERM" in out
    assert "rank 0: interrupted: rank 1 stopped the job (stopped by SIGTERM)" in out


def test_a_signal_to_every_serving_rank_ends_them_with_success() -> None:
    """What torchrun does with its own SIGTERM (and a terminal with Ctrl-C): every rank gets
    it, and each ends on its own signal, even one that read another's stop first."""
    import signal as signals

    with torchrun_job(COORDINATION_RANK, "serve") as proc:
        pids = _serving_pids(proc)
        for pid in pids.values():
            os.kill(pid, signals.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "rank 0: stopped by SIGTERM" in out and "rank 1: stopped by SIGTERM" in out


def test_the_watchdog_ends_a_rank_whose_stderr_is_a_closed_pipe() -> None:
    """Its error line cannot be written (EPIPE): the rank still ends, with the right code,
    instead of leaving the watchdog's thread dead and the rank unbounded."""
    import sys

    code = (
        "import time\n"
        "from ckptctl.launch import LaunchInfo\n"
        "from ckptctl.job.coordination import Watchdog\n"
        "launch = LaunchInfo(rank=0, world_size=1, local_rank=0, local_world_size=1,"
        " under_torchrun=False)\n"
        "Watchdog(launch, None, timeout_s=0.5).start()\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    proc.stderr.close()  # whatever it writes there now fails with EPIPE
    assert proc.wait(timeout=120) == 4

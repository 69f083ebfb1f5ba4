"""Real torchrun jobs on CPU: one rank fails or dies, or time runs out - every rank ends, promptly."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fake_server import free_port

SCRIPT = str(Path(__file__).with_name("coordination_rank.py"))


def _torchrun(scenario: str, nproc: int = 2) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        SCRIPT,
        scenario,
    ]
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

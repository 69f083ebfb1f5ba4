"""A real `ckptctl update` on CPU: the CLI under torchrun with only checkpoint-engine's
ParameterServer stood in (cpu_ps_rank.py), against servers on loopback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from cli_run import invoke
from fake_server import run_torchrun
from locations import CPU_PS_RANK, TINY

# The program and flags every CPU update starts with: the example checkpoint, a 60 s bound
# (a safety net: a broken job fails the test rather than hang it).
UPDATE_ON_CPU = (CPU_PS_RANK, "update", "--checkpoint-path", str(TINY), "--timeout", "60")


def update_on_cpu(*flags: str, nproc: int = 2, **kw: Any) -> subprocess.CompletedProcess[str]:
    """`UPDATE_ON_CPU` + `flags` under torchrun with `nproc` ranks, run to its end."""
    return run_torchrun(*UPDATE_ON_CPU, *flags, nproc=nproc, **kw)


def update_in_one_process(*flags: str) -> subprocess.CompletedProcess[str]:
    """`UPDATE_ON_CPU` + `flags` as one process, not under torchrun, run to its end: for the
    tests whose subject is the server or the flags, not the ranks. It costs a third of a
    2-rank job's CPU (every process imports torch), and the suite is CPU-bound."""
    return subprocess.run(
        [sys.executable, *UPDATE_ON_CPU, *flags], capture_output=True, text=True, timeout=100
    )


def update_consuming(path: Path, *flags: str):  # type: ignore[no-untyped-def]
    """An in-process `update --consume-shm-files` of `path` into one server."""
    return invoke(
        "update", "--checkpoint-path", str(path), "--inference-parallel-size", "1",
        "--consume-shm-files", "--timeout", "20", *flags,
    )  # fmt: skip

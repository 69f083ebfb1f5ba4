"""`make demo` (examples/demo.py): a real update into the bundled stand-in server where a GPU
is, the dry run with the reason where none is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "examples" / "demo.py"
sys.path.insert(0, str(DEMO.parent))

import demo  # noqa: E402 - examples/ is not a package

TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """As `make demo` runs it: a plain process, not a torchrun rank (in-process tests of a
    GPU command leave RANK and WORLD_SIZE behind in this one)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    return subprocess.run(
        [sys.executable, str(DEMO), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="with a GPU the demo runs the real update (test_gpu below)")
def test_without_a_gpu_it_says_why_and_shows_the_dry_run() -> None:
    r = _run()
    assert r.returncode == 0, r.stderr
    assert "demo: no real update here: torch" in r.stderr and "sees no CUDA GPU" in r.stderr
    assert "tensors split of" in r.stdout and "server groups" in r.stdout
    assert "25 tensors in 3 file(s)" in r.stdout


def test_the_dry_run_on_request_anywhere() -> None:
    r = _run("--dry-run")
    assert r.returncode == 0, r.stderr
    assert "asked for with --dry-run" in r.stderr and "server groups" in r.stdout


def test_makefile_demo_runs_the_script() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ndemo: setup\n", 1)[1].splitlines()[0]
    assert recipe.strip() == "$(BIN)/python examples/demo.py"


def _report(ok: bool, mismatches: list[str]) -> dict:
    worker = {"device": 0, "tensors_received": 25, "mismatches": mismatches, "missing": []}
    return {"ok": ok, "expected_tensors": 25, "weight_version": "demo-1", "workers": [worker]}


def test_the_verdict_needs_every_tensor_intact(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.judge(_report(True, [])) == 0
    assert "every tensor arrived bit for bit" in capsys.readouterr().err
    assert demo.judge(_report(True, ["model.norm.weight"])) == 1
    assert demo.judge(_report(False, [])) == 1


@pytest.mark.gpu
def test_gpu_the_demo_pushes_the_example_into_the_stand_in_server() -> None:
    r = _run(timeout=500)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "every tensor arrived bit for bit" in r.stderr
    assert "received 25 of 25 tensors, 0 mismatch(es), 0 missing" in r.stderr
    assert "register" in r.stdout and "update" in r.stdout  # the closing summary

"""--consume-shm-files: refused unless the checkpoint is in /dev/shm and split by files; and
nothing is deleted when the job fails before registering (here: no GPU)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import invoke

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-checkpoint"


@pytest.fixture
def shm_copy() -> Path:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    path = Path("/dev/shm") / f"ckptctl-consume-{os.getpid()}"
    shutil.copytree(TINY, path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _update(path: Path, *extra: str):  # type: ignore[no-untyped-def]
    return invoke(
        "update",
        "--checkpoint-path",
        str(path),
        "--inference-parallel-size",
        "1",
        "--consume-shm-files",
        "--timeout",
        "20",
        *extra,
    )


def test_outside_dev_shm_is_refused() -> None:
    r = _update(TINY)
    assert r.exit_code == 2 and "under /dev/shm only" in r.stderr


def test_tensor_split_is_refused(shm_copy: Path) -> None:
    r = _update(shm_copy, "--split", "tensors")
    assert r.exit_code == 2 and "--split files" in r.stderr


def test_nothing_is_deleted_when_the_job_fails_first(shm_copy: Path) -> None:
    before = sorted(p.name for p in shm_copy.iterdir())
    r = _update(shm_copy)
    assert r.exit_code == 1 and "no CUDA device" in r.stderr
    assert sorted(p.name for p in shm_copy.iterdir()) == before

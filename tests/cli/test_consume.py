"""--consume-shm-files: refused unless the checkpoint is in /dev/shm and split by files; and
nothing is deleted when the job fails before registering (here: no GPU)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cpu_jobs import update_consuming
from locations import TINY

from ckptctl.errors import InvalidInput, UsageError


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A folder of this test's own in /dev/shm (where --consume-shm-files is allowed)."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm here")
    path = Path(tempfile.mkdtemp(prefix="ckptctl-consume-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_copy(shm_dir: Path) -> Path:
    return Path(shutil.copytree(TINY, shm_dir / "tiny"))


def test_outside_dev_shm_is_refused() -> None:
    r = update_consuming(TINY)
    assert r.exit_code == 2 and "under /dev/shm only" in r.stderr


def test_a_folder_beside_dev_shm_whose_name_starts_the_same_is_outside_it() -> None:
    """/dev/shmX is not under /dev/shm: both checks compare whole path parts (nothing is
    created there: the checks resolve the path and compare)."""
    from ckptctl.checkpoint.consume import check_consume, check_in_shm

    check_consume("/dev/shm/ckpt", "files")  # (under it: taken)
    with pytest.raises(UsageError, match="under /dev/shm only"):
        check_consume("/dev/shmX/ckpt", "files")
    with pytest.raises(InvalidInput, match="really lives at /dev/shmX/ckpt/a.safetensors, outside"):
        check_in_shm("/dev/shmX/ckpt/a.safetensors")


def test_tensor_split_is_refused(shm_copy: Path) -> None:
    r = update_consuming(shm_copy, "--split", "tensors")
    assert r.exit_code == 2 and "--split files" in r.stderr


@pytest.mark.no_cuda
def test_nothing_is_deleted_when_the_job_fails_first(shm_copy: Path) -> None:
    before = sorted(p.name for p in shm_copy.iterdir())
    r = update_consuming(shm_copy)
    assert r.exit_code == 1 and "no CUDA device" in r.stderr
    assert sorted(p.name for p in shm_copy.iterdir()) == before


def test_a_checkpoint_in_place_pinning_cannot_serve_is_refused_untouched(shm_dir: Path) -> None:
    """Mixed dtypes in two shards: checkpoint-engine packs a rank's files back to back, so the
    second file's int64s land at odd offsets and the server cannot view them (seen on the H200
    machine: "storage_offset() must be divisible by 8"). Refused with exit 3, nothing consumed."""
    from ckpt_factory import mixed_shards, write_real_checkpoint

    path = shm_dir / "mixed"
    write_real_checkpoint(path, mixed_shards(seed=1))
    try:
        before = {p.name: p.read_bytes() for p in path.iterdir()}
        r = update_consuming(path)
        assert r.exit_code == 3, r.stderr
        assert "alignment" in r.stderr and "drop --consume-shm-files" in r.stderr
        assert [line for line in r.stderr.splitlines() if "error" in line] == [
            r.stderr.strip().splitlines()[-1]
        ]
        assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_dtype_in_place_pinning_cannot_read_is_refused_untouched(shm_dir: Path) -> None:
    """checkpoint-engine reads in-place files' dtypes through safetensors' own table, which
    lacks F8_E8M0: it would fail halfway, after deleting other files. Refused up front."""
    from ckpt_factory import header_bytes

    path = shm_dir / "e8m0"
    path.mkdir()
    header = {"scales": {"dtype": "F8_E8M0", "shape": [8], "data_offsets": [0, 8]}}
    (path / "model.safetensors").write_bytes(header_bytes(header) + bytes(range(8)))
    try:
        before = {p.name: p.read_bytes() for p in path.iterdir()}
        r = update_consuming(path)
        assert r.exit_code == 3, r.stderr
        assert "F8_E8M0" in r.stderr and "drop --consume-shm-files" in r.stderr
        assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_consume_refuses_a_folder_others_can_write() -> None:
    """A 0777 folder on the way lets another user swap a subfolder for a symlink between the
    check and checkpoint-engine's os.remove (which resolves the path again)."""
    from ckptctl.checkpoint.consume import check_in_shm

    base = Path(tempfile.mkdtemp(prefix="ckptctl-adv-", dir="/dev/shm"))
    try:
        (base / "sub").mkdir()
        f = base / "sub" / "a.safetensors"
        f.write_bytes(b"x")
        check_in_shm(str(f))  # private folders: fine
        os.chmod(base, 0o777)  # what mkdir gives under umask 000
        with pytest.raises(InvalidInput, match="writable by other users"):
            check_in_shm(str(f))
        os.chmod(base, 0o1777)  # sticky, like /dev/shm itself: others cannot rename our folder
        check_in_shm(str(f))
    finally:
        shutil.rmtree(base, ignore_errors=True)

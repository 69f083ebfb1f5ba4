"""--consume-shm-files deletes only files that really live under /dev/shm (issue 14, item 2).

checkpoint-engine pins each file it is given and then removes it by that path. A shard reached
through a symlinked folder (`/dev/shm/x/sub -> /elsewhere`, the index naming
`sub/a.safetensors`) was pinned and then deleted where it really lives. Every file is resolved
and refused (exit 3) before anything is consumed. The end-to-end test runs the real CLI under
torchrun with the CPU stand-in of the ParameterServer, which deletes what it is given exactly
as checkpoint-engine's in-place pinning does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cpu_jobs import update_consuming
from fake_server import Behaviour, FakeServer
from locations import CPU_PS_RANK, TINY
from warm_launch import torchrun_cmd

MOVED = "model-00003-of-00003.safetensors"  # the shard that lives elsewhere

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    own = Path(tempfile.mkdtemp(prefix="ckptctl-paths-", dir="/dev/shm"))  # (this test's own)
    path = Path(shutil.copytree(TINY, own / "ckpt"))
    yield path
    shutil.rmtree(own, ignore_errors=True)


def _contents(*folders: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for f in folders for p in sorted(f.rglob("*")) if p.is_file()}


def _move_behind_symlinked_folder(ckpt: Path, elsewhere: Path) -> None:
    """Shard 3 moves to `elsewhere`; `ckpt/sub` links there; the index names `sub/<shard>`."""
    elsewhere.mkdir()
    shutil.move(str(ckpt / MOVED), elsewhere / MOVED)
    (ckpt / "sub").symlink_to(elsewhere, target_is_directory=True)
    index = ckpt / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {
        name: f"sub/{MOVED}" if shard == MOVED else shard
        for name, shard in doc["weight_map"].items()
    }
    index.write_text(json.dumps(doc))


def _refused_untouched(result, *folders: Path, before: dict[str, bytes], says: str) -> None:  # type: ignore[no-untyped-def]
    assert result.exit_code == 3, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and says in errors[0], result.stderr
    assert _contents(*folders) == before


def test_a_shard_behind_a_symlinked_folder_is_refused_untouched(
    shm_dir: Path, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "home-of-the-shard"
    _move_behind_symlinked_folder(shm_dir, elsewhere)
    before = _contents(shm_dir, elsewhere)
    r = update_consuming(shm_dir)
    _refused_untouched(r, shm_dir, elsewhere, before=before, says=f"really lives at {elsewhere}")
    assert "outside /dev/shm" in r.stderr


def test_a_shard_that_is_a_symlink_is_refused_untouched(shm_dir: Path, tmp_path: Path) -> None:
    """Even one pointing at a file in /dev/shm: checkpoint-engine would pin the target and
    delete only the link; and a link anywhere else would be pinned from there."""
    for target_dir in (tmp_path, Path(f"{shm_dir}-targets")):
        target_dir.mkdir(exist_ok=True)
        try:
            shutil.move(str(shm_dir / MOVED), target_dir / MOVED)
            (shm_dir / MOVED).symlink_to(target_dir / MOVED)
            before = _contents(shm_dir, target_dir)
            r = update_consuming(shm_dir)
            _refused_untouched(r, shm_dir, target_dir, before=before, says="is a symbolic link")
            (shm_dir / MOVED).unlink()
            shutil.move(str(target_dir / MOVED), shm_dir / MOVED)
        finally:
            if target_dir != tmp_path:
                shutil.rmtree(target_dir, ignore_errors=True)


def test_a_folder_of_another_user_is_refused(shm_dir: Path) -> None:
    """Whoever owns a folder on the way could swap a file for a link after the check."""
    if os.getuid() != 0:
        pytest.skip("needs root to hand a folder to another user")
    os.chown(shm_dir, 65534, 65534)
    before = _contents(shm_dir)
    r = update_consuming(shm_dir)
    _refused_untouched(r, shm_dir, before=before, says="belongs to another user")


@pytest.mark.no_cuda
def test_a_plain_shm_checkpoint_still_passes_the_checks(shm_dir: Path) -> None:
    """The checks refuse nothing legitimate: here the job goes on to need a GPU."""
    r = update_consuming(shm_dir)
    assert r.exit_code == 1 and "no CUDA device" in r.stderr


@pytest.mark.slow
def test_end_to_end_the_file_behind_the_link_survives(shm_dir: Path, tmp_path: Path) -> None:
    """The real CLI under torchrun, the ParameterServer stood in by one that deletes what it
    pins: before the fix, the shard in `elsewhere` was deleted."""
    elsewhere = tmp_path / "home-of-the-shard"
    _move_behind_symlinked_folder(shm_dir, elsewhere)
    before = _contents(shm_dir, elsewhere)
    with FakeServer(Behaviour()) as server:
        cmd = torchrun_cmd(
            CPU_PS_RANK, "update", "--checkpoint-path", str(shm_dir), "--consume-shm-files",
            "--inference-parallel-size", "1", "--endpoint", server.endpoint, "--timeout", "60",
            nproc=1,
        )  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        posts = [q for q in server.behaviour.requests if q["method"] == "POST"]
    assert r.returncode != 0 and "exitcode  : 3" in r.stderr, r.stderr  # torchrun's report
    assert f"really lives at {elsewhere}" in r.stderr
    assert (elsewhere / MOVED).exists()
    assert _contents(shm_dir, elsewhere) == before  # nothing consumed, here or there
    assert posts == []

"""Inputs the reader refuses quickly, with exit 3 and one line (issue 14, items 5 and 8).

- an index that is a FIFO (opening it blocked until a signal), symlinked to /dev/zero (read
  until the OOM killer came), or 3 GB (read whole before the JSON parser refused it);
- `inspect-metas` on a FIFO (blocked the same way);
- a dimension outside what any tensor can have (`[10**30, 0]`: planned, then a C++ stack trace);
- a file that changed between planning and reading (replaced, or rewritten in place): the
  engine path maps it (a cut one ends in SIGBUS), the direct path preads it.

The CLI runs as a subprocess with a wall-clock guard and a 2 GiB address-space limit, so that
code that blocks or reads without end fails the test instead of hanging it or eating the machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest
from ckpt_factory import (
    mixed_tensors,
    rewrite_in_place_setting_the_mtime_back,
    write_raw,
    write_real_checkpoint,
)
from conftest import run_script
from locations import TINY

from ckptctl.checkpoint import load_tensors, read_checkpoint
from ckptctl.checkpoint.headers import MAX_INDEX_BYTES
from ckptctl.errors import InvalidInput
from ckptctl.transfer.host_memory import ShareReader

INDEX = "model.safetensors.index.json"
GUARD_S = 60  # far longer than any refusal takes; what blocked before never ended at all


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _ckptctl(*args: str) -> subprocess.CompletedProcess[str]:
    return run_script(*args, timeout=GUARD_S, preexec_fn=_limit_memory)


def _dry_run(path: Path) -> subprocess.CompletedProcess[str]:
    return _ckptctl(
        "update", "--dry-run", "--checkpoint-path", str(path), "--world-size", "1",
        "--inference-parallel-size", "1",
    )  # fmt: skip


def _one_error_line(r: subprocess.CompletedProcess[str], *words: str) -> str:
    assert r.returncode == 3, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return Path(shutil.copytree(TINY, tmp_path / "tiny"))


# -- the index -------------------------------------------------------------------------------


def test_an_index_that_is_a_fifo_is_refused_not_waited_on(tiny: Path) -> None:
    (tiny / INDEX).unlink()
    os.mkfifo(tiny / INDEX)
    _one_error_line(_dry_run(tiny), INDEX, "FIFO", "not a regular file")


def test_an_index_linked_to_dev_zero_is_refused_unread(tiny: Path) -> None:
    (tiny / INDEX).unlink()
    (tiny / INDEX).symlink_to("/dev/zero")
    _one_error_line(_dry_run(tiny), INDEX, "character device")


def test_a_3_gb_index_is_refused_from_its_size(tiny: Path) -> None:
    index = tiny / INDEX
    with open(index, "r+b") as f:
        f.truncate(3 << 30)  # sparse: no disk used, and 3 GB of RSS if it were read
    line = _one_error_line(_dry_run(tiny), INDEX, "larger than")
    assert f"{MAX_INDEX_BYTES / 2**20:g} MiB" in line


def test_an_index_at_the_cap_is_still_read(tiny: Path) -> None:
    """The cap refuses only what no index can be: one padded with whitespace to just below it
    is read and planned as before."""
    index = tiny / INDEX
    doc = json.loads(index.read_text())
    text = json.dumps(doc).encode()
    index.write_bytes(text + b" " * (MAX_INDEX_BYTES - len(text)))
    r = _dry_run(tiny)
    assert r.returncode == 0, r.stderr


# -- files that are not what they should be: no error quotes them ----------------------------

SECRET = b"zq7x:*:20000:0:99999:7:::\nw8vk:*:20000:0:99999:7:::\n"  # (as /etc/shadow)


def _quotes_nothing_of(line: str, secret: bytes) -> None:
    """The error line holds no value made of the file's bytes: no part of the text, no number
    its first 8 bytes make (as a length, little-endian), no byte of it."""
    for value in (
        secret[:4].decode(errors="replace"),
        str(int.from_bytes(secret[:8], "little")),
        str(int.from_bytes(secret[:8], "big")),
        f"{secret[0]:#x}",
        f"{secret[0]:#04x}",
    ):
        assert value not in line, (value, line)


def test_a_shard_linked_to_a_file_that_is_not_safetensors_is_named_never_quoted(
    tmp_path: Path,
) -> None:
    """A shard may be a symlink to any file its reader can read (a Hugging Face cache is
    symlinks): the error says the file is not safetensors, and its size, never its bytes."""
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "model.safetensors").symlink_to(secret)
    line = _one_error_line(_dry_run(root), "model.safetensors", "is not safetensors")
    assert f"{len(SECRET)} bytes" in line
    _quotes_nothing_of(line, SECRET)
    # A file large enough for the length its first bytes make (sparse): still not quoted.
    length = (150_000_000).to_bytes(8, "little")
    secret.write_bytes(length + SECRET)
    os.truncate(secret, 200_000_000)
    line = _one_error_line(_dry_run(root), "model.safetensors", "is not safetensors")
    assert "150000000" not in line and "200000000 bytes" in line
    # A header length that fits, and a header that is no UTF-8 text: no byte of it shown.
    binary = b"\xff\xfe" + SECRET
    secret.write_bytes(len(binary).to_bytes(8, "little") + binary)
    line = _one_error_line(_dry_run(root), "model.safetensors", "not valid JSON", "not UTF-8")
    _quotes_nothing_of(line, binary)


def test_an_index_that_is_not_text_is_named_never_quoted(tiny: Path) -> None:
    (tiny / INDEX).write_bytes(b"\xff\xfe" + SECRET)
    line = _one_error_line(_dry_run(tiny), INDEX, "not valid JSON", "not UTF-8")
    _quotes_nothing_of(line, b"\xff\xfe" + SECRET)


def test_a_name_too_long_for_the_file_system_is_refused_not_an_internal_error(
    tiny: Path,
) -> None:
    """Path.exists raises for a name longer than NAME_MAX (and for a folder on the way that the
    user may not enter) where it returns False for one that is missing: --checkpoint-path, or
    a shard an index names, ended as "internal error: OSError" (exit 1), not exit 3."""
    long_name = "a" * 300  # (NAME_MAX is 255 on every Linux file system)
    _one_error_line(_dry_run(tiny / long_name), long_name, "cannot be looked up")
    index = json.loads((tiny / INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = f"{long_name}.safetensors"
    (tiny / INDEX).write_text(json.dumps(index))
    _one_error_line(_dry_run(tiny), INDEX, f"{long_name}.safetensors", "cannot be looked up")


# -- metas files ----------------------------------------------------------------------------


def test_inspect_metas_on_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "metas.json"
    os.mkfifo(fifo)
    _one_error_line(_ckptctl("inspect-metas", str(fifo)), str(fifo), "FIFO")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_inspect_metas_on_a_device_is_refused(device: str) -> None:
    _one_error_line(_ckptctl("inspect-metas", device), device, "character device")


# -- shapes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [[10**30, 0], [2**62, 4, 0], [0, 2**63]])
def test_a_dimension_no_tensor_can_have_is_refused_at_planning(
    tmp_path: Path, shape: list[int]
) -> None:
    root = tmp_path / "ck"
    root.mkdir()
    header = {
        "ok": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "empty": {"dtype": "F32", "shape": shape, "data_offsets": [8, 8]},
    }
    write_raw(root / "model.safetensors", header, 8)
    _one_error_line(_dry_run(root), "'empty'", "beyond", "elements")


def test_large_but_valid_empty_shapes_still_plan(tmp_path: Path) -> None:
    """A 0 next to sizes torch can hold is a valid empty tensor, and loads as one."""
    root = tmp_path / "ck"
    root.mkdir()
    header = {"empty": {"dtype": "BF16", "shape": [2**40, 0, 2**20], "data_offsets": [0, 0]}}
    write_raw(root / "model.safetensors", header, 0)
    assert _dry_run(root).returncode == 0
    ckpt = read_checkpoint(root)
    assert load_tensors(ckpt, ckpt.tensors)["empty"].shape == (2**40, 0, 2**20)


# -- files that change after planning -------------------------------------------------------


def mixed_checkpoint(root: Path, shards: int = 1) -> Path:
    return write_real_checkpoint(root, [mixed_tensors()])


def _replace_with_same_size(path: Path) -> None:
    """What a writer saving the next checkpoint over this one does: a new file, renamed in."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    fresh = path.with_suffix(".tmp")
    fresh.write_bytes(bytes(data))
    os.replace(fresh, path)


def _rewrite_in_place(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(bytes(data))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # coarse clocks


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


CHANGES = {
    "replaced": _replace_with_same_size,
    "rewritten": _rewrite_in_place,
    "rewritten, mtime set back": rewrite_in_place_setting_the_mtime_back,  # (the ctime tells)
    "cut": _truncate,
}
SAYS = {
    "replaced": "was replaced",
    "rewritten": "was modified",
    "rewritten, mtime set back": "was modified",
    "cut": "bytes, but was",
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_engine_path_refuses_a_file_changed_since_planning(tmp_path: Path, change: str) -> None:
    root = mixed_checkpoint(tmp_path / "c", shards=1)
    ckpt = read_checkpoint(root)
    CHANGES[change](root / ckpt.files[0])
    with pytest.raises(InvalidInput, match=f"{SAYS[change]}.*changed since the checkpoint"):
        load_tensors(ckpt, ckpt.tensors)


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_direct_path_refuses_a_file_changed_since_planning(tmp_path: Path, change: str) -> None:
    root = mixed_checkpoint(tmp_path / "c", shards=1)
    ckpt = read_checkpoint(root)
    CHANGES[change](root / ckpt.files[0])
    with pytest.raises(InvalidInput, match=SAYS[change]):
        ShareReader(ckpt, ckpt.tensors, pin=False).result()


def test_direct_path_still_catches_a_short_read(tmp_path: Path) -> None:
    """A file cut during the reads passes the check before them: the short read is caught."""
    root = mixed_checkpoint(tmp_path / "c", shards=1)
    ckpt = dataclasses.replace(read_checkpoint(root), file_ids={})  # as if checked before the cut
    _truncate(root / ckpt.files[0])
    with pytest.raises(InvalidInput, match="ends before tensor"):
        ShareReader(ckpt, ckpt.tensors, pin=False).result()


def test_a_shard_swapped_for_a_fifo_after_planning_is_refused(tmp_path: Path) -> None:
    root = mixed_checkpoint(tmp_path / "c", shards=1)
    ckpt = read_checkpoint(root)
    victim = root / ckpt.files[0]
    victim.unlink()
    os.mkfifo(victim)
    with pytest.raises(InvalidInput, match="FIFO"):
        load_tensors(ckpt, ckpt.tensors)

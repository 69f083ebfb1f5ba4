"""The JSON metas file: round trip with checkpoint-engine's real models, and every way to break it."""

from __future__ import annotations

import collections
import json
import os
import pickle
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from checkpoint_engine.data_types import MemoryBufferMetaList
from metas_samples import (
    ALL_DTYPES,
    canonical_checksum,
    every_dtype_metas,
    rewrite,
    small_metas,
    write_small_metas,
)

from ckptctl import __version__
from ckptctl.errors import InvalidInput, OperationFailed, UsageError
from ckptctl.metas import fileformat, read_metas_file, write_metas_file


@pytest.fixture
def written(tmp_path: Path) -> Path:
    return write_small_metas(tmp_path)


def test_round_trip_every_dtype_zero_dim_shapes_many_ranks(tmp_path: Path) -> None:
    metas = every_dtype_metas(world_size=64)
    path = tmp_path / "m.json"
    before = datetime.now(timezone.utc).replace(microsecond=0)
    write_metas_file(path, metas, checkpoint_name="big", world_size=64)
    got = read_metas_file(path)

    assert got.metas == metas  # pydantic equality: every field of every model
    assert list(got.metas) == sorted(metas) and all(type(k) is int for k in got.metas)
    params = [
        p
        for entry in got.metas.values()
        for buf in entry.memory_buffer_metas_list
        for p in buf.metas
    ]
    assert all(type(e) is MemoryBufferMetaList for e in got.metas.values())
    assert all(type(p.shape) is torch.Size for p in params)
    assert {p.dtype for p in params} == set(ALL_DTYPES)  # torch.dtype objects, fp8 included
    assert any(p.shape == torch.Size([]) for p in params)
    assert (got.checkpoint_name, got.world_size, got.format_version) == ("big", 64, 1)
    assert got.ckptctl_version == __version__ and got.checkpoint_engine_version == "0.4.2"
    assert got.created_at is not None and got.created_at >= before
    assert got.legacy_pickle is False


def test_empty_metas_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    write_metas_file(path, {}, checkpoint_name="empty", world_size=1)
    assert read_metas_file(path).metas == {}


def test_file_is_self_describing_json_with_a_valid_checksum(written: Path) -> None:
    text = written.read_text()
    doc = json.loads(text)
    assert text.splitlines()[1] == '  "format": "ckptctl-metas",'  # `head` tells what it is
    assert doc["format_version"] == 1 and doc["world_size"] == 2
    assert set(doc["metas"]) == {"0", "1"}
    assert doc["metas"]["1"]["memory_buffer_metas_list"][0]["metas"][1]["dtype"] in (
        "torch.float8_e4m3fn",
        "torch.float32",
    )
    assert doc["checksum"] == canonical_checksum(doc)


def test_write_is_atomic_and_replaces(tmp_path: Path, written: Path) -> None:
    old = written.read_bytes()
    write_metas_file(written, small_metas(), checkpoint_name="second", world_size=2)
    assert read_metas_file(written).checkpoint_name == "second"
    assert written.read_bytes() != old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metas.json"]  # no temp files left


def _refused_and_kept(path: Path, why: str) -> None:
    """Neither check_target nor the writer replaces `path`: it stays byte for byte."""
    before = path.read_bytes() if not path.is_symlink() else None
    with pytest.raises(UsageError, match=f"^--save-metas-file .*: {why}"):
        fileformat.check_target(path, "--save-metas-file")
    with pytest.raises(OperationFailed, match=why):
        write_metas_file(path, {}, checkpoint_name="x", world_size=1)
    if before is not None:
        assert path.read_bytes() == before


# Files of the user's at the path of a metas file: a typo, a planted symlink, or a file that
# only mentions checkpoint-engine or ckptctl's format. Each is refused and kept.
USERS_FILES = {
    "notes.txt": b"mine",
    "driver.py": b"import checkpoint_engine\nfrom checkpoint_engine.ps import ParameterServer\n",
    "config.yaml": b"engine: checkpoint_engine\nmetas: ckptctl-metas\n",
    "run.log": b"2026-12-01 checkpoint_engine.data_types.MemoryBufferMetaList registered\n",
    # JSON that names ckptctl's format but is not a metas document.
    "settings.json": b'{"format": "ckptctl-metas", "save_to": "/ckpt/metas.json"}',
    # Pickles: one only naming checkpoint-engine in a string, an optimizer's state, metas
    # beside a tensor, bytes or another class, a list of metas (the seed script pickles a dict).
    "names.pkl": pickle.dumps({"engine": "checkpoint_engine.data_types MemoryBufferMetaList"}),
    "optimizer.pkl": pickle.dumps({"lr": [0.1], "step": 7}),
    "with-tensor.pkl": pickle.dumps({**small_metas(), 9: torch.zeros(2)}),
    "with-bytes.pkl": pickle.dumps({**small_metas(), 9: b"the user's own bytes"}),
    "with-a-class.pkl": pickle.dumps({**small_metas(), 9: collections.OrderedDict(lr=0.1)}),
    "list.pkl": pickle.dumps(list(small_metas().values())),
}


@pytest.mark.parametrize("name", sorted(USERS_FILES))
def test_a_file_there_that_is_not_a_metas_file_is_never_replaced(tmp_path: Path, name: str) -> None:
    mine = tmp_path / name
    mine.write_bytes(USERS_FILES[name])
    _refused_and_kept(mine, "exists and is not a metas file ckptctl wrote")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]  # no temporary file left


def test_a_symlink_a_file_of_another_user_and_a_huge_file_are_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = write_small_metas(tmp_path)  # a metas file of ours, but behind a symlink
    link = tmp_path / "link.json"
    link.symlink_to(mine)
    _refused_and_kept(link, "a symlink")
    assert link.is_symlink()
    # Beyond any metas file's size (sparse: nothing is written, nor read); and a metas file of
    # ours, were it larger than the cap (test_the_size_cap_itself_is_256_mib checks the cap).
    huge = tmp_path / "huge.json"
    huge.write_bytes(mine.read_bytes())
    os.truncate(huge, fileformat.MAX_METAS_FILE_BYTES + 1)
    _refused_and_kept(huge, "exists and is not a metas file")
    with monkeypatch.context() as patched:
        patched.setattr(fileformat, "MAX_METAS_FILE_BYTES", mine.stat().st_size - 1)
        _refused_and_kept(mine, "exists and is not a metas file")
    # A metas file of another user (root runs ckptctl; the file is someone else's): as this
    # process sees it, its owner is not the user that writes.
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(mine).st_uid + 1)
    _refused_and_kept(mine, "a file of another user")


def test_a_metas_file_written_before_an_empty_file_and_the_seed_scripts_pickle_are_replaced(
    tmp_path: Path,
) -> None:
    """What ckptctl wrote, what the seed script's --save-metas-file wrote (a pickle of
    checkpoint-engine's metas, any protocol, told from its opcodes) and an empty file
    (mktemp's) are replaced."""
    ours = write_small_metas(tmp_path)
    assert fileformat.check_target(ours, "--save-metas-file") == str(ours)
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        seeds = tmp_path / f"seed-{protocol}.pkl"
        seeds.write_bytes(pickle.dumps(small_metas(), protocol=protocol))
        assert fileformat.check_target(seeds, "--save-metas-file") == str(seeds)
        write_metas_file(seeds, {}, checkpoint_name="x", world_size=1)
        assert read_metas_file(seeds).checkpoint_name == "x"
    empty = tmp_path / "empty"
    empty.touch()
    write_metas_file(empty, {}, checkpoint_name="x", world_size=1)
    assert read_metas_file(empty).checkpoint_name == "x"
    with pytest.raises(UsageError, match="no directory"):
        fileformat.check_target(tmp_path / "no" / "m.json", "--save-metas-file")


def test_file_mode_follows_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_metas_file(tmp_path / "m.json", {}, checkpoint_name="x", world_size=1)
    finally:
        os.umask(old)
    assert (tmp_path / "m.json").stat().st_mode & 0o777 == 0o640


def test_write_into_missing_folder_fails_cleanly(tmp_path: Path) -> None:
    with pytest.raises(OperationFailed, match="cannot write metas file"):
        write_metas_file(tmp_path / "no" / "m.json", {}, checkpoint_name="x", world_size=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"checkpoint_name": "ck", "world_size": 1}, "outside world_size 1"),
        ({"checkpoint_name": "", "world_size": 2}, "checkpoint_name"),
        ({"checkpoint_name": "ck", "world_size": 0}, "world_size"),
    ],
)
def test_writer_refuses_what_the_reader_would_refuse(
    written: Path, kwargs: dict, message: str
) -> None:
    before = written.read_bytes()
    with pytest.raises(ValueError, match=message):
        write_metas_file(written, small_metas(), **kwargs)
    assert written.read_bytes() == before  # the old file is untouched


def test_any_changed_byte_fails_the_checksum(written: Path) -> None:
    text = written.read_text()
    edited = text.replace('"size":512', '"size":768', 1)
    assert edited != text
    written.write_text(edited)
    with pytest.raises(InvalidInput, match="checksum mismatch"):
        read_metas_file(written)


@pytest.mark.parametrize("keep", [0.5, 0.9, -3, -2])  # -1 would only drop the final newline
def test_truncated_file(written: Path, keep: float) -> None:
    data = written.read_bytes()
    cut = int(len(data) * keep) if keep > 0 else len(data) + int(keep)
    written.write_bytes(data[:cut])
    with pytest.raises(InvalidInput, match="truncated"):
        read_metas_file(written)


@pytest.mark.parametrize(
    "content",
    [
        '{"hello": "world"}',
        "[1, 2, 3]",
        '{"metadata": {"total_size": 1}, "weight_map": {"a": "model.safetensors"}}',
        '{"format": "something-else", "format_version": 1}',
    ],
)
def test_foreign_json(tmp_path: Path, content: str) -> None:
    path = tmp_path / "metas.json"
    path.write_text(content)
    with pytest.raises(InvalidInput, match="not a ckptctl metas file"):
        read_metas_file(path)


def test_newer_format_version(written: Path) -> None:
    rewrite(written, lambda d: d.update(format_version=2))
    with pytest.raises(InvalidInput, match="version 2 is not supported.*newer ckptctl"):
        read_metas_file(written)


def test_missing_checksum(written: Path) -> None:
    rewrite(written, lambda d: d.pop("checksum"), fix_checksum=False)
    with pytest.raises(InvalidInput, match="checksum is missing"):
        read_metas_file(written)


def _meta(d: dict, rank: str = "1", buf: int = 0, i: int = 0) -> dict:
    return d["metas"][rank]["memory_buffer_metas_list"][buf]["metas"][i]


# Re-signed edits: the checksum matches, so only validation can catch them.
@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: _meta(d).update(dtype="torch.Tensor"), "unknown dtype 'torch.Tensor'"),
        (lambda d: _meta(d).update(dtype="torch.load"), "unknown dtype 'torch.load'"),
        (lambda d: _meta(d).update(dtype="bfloat16"), "unknown dtype"),
        (lambda d: _meta(d).update(shape=[16, "8"]), "invalid metas"),
        (lambda d: _meta(d).update(shape=[16, -8]), "negative dimension"),
        (lambda d: _meta(d).update(aligned_size=2), "does not fit its aligned_size"),
        (lambda d: _meta(d).pop("name"), r"invalid metas at 1\..*name: Field required"),
        (
            lambda d: d["metas"]["1"]["memory_buffer_metas_list"][0].update(ptr="140"),
            "ptr: Input should be a valid integer",
        ),
        (
            lambda d: d["metas"]["1"]["memory_buffer_metas_list"][0].update(size=1),
            "its tensors need 512 bytes, it holds 1",
        ),
        (lambda d: d["metas"].update({"01": d["metas"]["1"]}), "'01' is not an owner rank"),
        (lambda d: d["metas"].update({"-1": d["metas"]["1"]}), "'-1' is not an owner rank"),
        (lambda d: d.update(world_size=1), "owner rank 1 is outside world_size 1"),
        (lambda d: d.update(world_size=True), "world_size must be a positive integer"),
        (lambda d: d.update(created_at="yesterday"), "created_at is not an ISO 8601 time"),
        (lambda d: d.update(checkpoint_name=None), "checkpoint_name must be a non-empty string"),
        (lambda d: d.update(extra=1), "unexpected field"),
        (lambda d: d.pop("world_size"), "missing field"),
        (lambda d: d.update(metas=[]), "metas must map owner ranks"),
    ],
)
def test_forged_content_is_refused(written: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    rewrite(written, mutate)
    with pytest.raises(InvalidInput, match=message):
        read_metas_file(written)


def test_missing_empty_folder_and_binary(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="does not exist"):
        read_metas_file(tmp_path / "nope.json")
    with pytest.raises(InvalidInput, match="is a folder"):
        read_metas_file(tmp_path)
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(InvalidInput, match="is empty"):
        read_metas_file(tmp_path / "empty")
    (tmp_path / "bin").write_bytes(bytes(range(1, 255)))
    with pytest.raises(InvalidInput, match="neither ckptctl's JSON nor a pickle"):
        read_metas_file(tmp_path / "bin")


def test_size_cap(written: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = written.stat().st_size
    monkeypatch.setattr(fileformat, "MAX_METAS_FILE_BYTES", size)
    assert read_metas_file(written).world_size == 2  # exactly at the cap: read
    monkeypatch.setattr(fileformat, "MAX_METAS_FILE_BYTES", size - 1)
    with pytest.raises(InvalidInput, match="larger than"):
        read_metas_file(written)


def test_the_size_cap_itself_is_256_mib(tmp_path: Path) -> None:
    """Unpatched: a file one byte over 256 MiB is refused from its size, before a byte of it
    is read (sparse: nothing is written either)."""
    path = tmp_path / "big.json"
    path.write_bytes(b'{"format": "ckptctl-metas", "metas": ')
    os.truncate(path, 256 * 2**20 + 1)
    with pytest.raises(InvalidInput, match="is larger than 256 MiB, the most a metas file may be"):
        read_metas_file(path)


def test_absurd_numbers_and_nesting(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text('{"format": "ckptctl-metas", "n": ' + "9" * 5000 + "}")
    with pytest.raises(InvalidInput, match="not a metas file"):
        read_metas_file(path)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(InvalidInput, match="not a metas file"):
        read_metas_file(path)


def test_every_cut_is_refused(written: Path) -> None:
    """Whatever byte a cut lands on, the reader refuses the file (never returns part of it)."""
    data = written.read_bytes()
    for cut in range(1, len(data) - 2, 5):
        written.write_bytes(data[:cut])
        with pytest.raises(InvalidInput):
            read_metas_file(written)

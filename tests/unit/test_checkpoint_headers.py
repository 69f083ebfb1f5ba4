"""read_checkpoint on real files: layouts, every dtype, 0-dim and empty tensors, sparse
full-size checkpoints, and every malformed case (one precise InvalidInput each)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from ckpt_factory import (
    MALFORMED,
    mixed_tensors,
    sparse_file,
    write_index,
    write_raw,
    write_real_checkpoint,
    write_sparse_checkpoint,
)
from model_shapes import qwen3_8b
from safetensors import safe_open

from ckptctl.checkpoint import DTYPE_BITS, read_checkpoint
from ckptctl.errors import ExitCode, InvalidInput

SAFETENSORS_DTYPE = {  # torch dtype -> the string safetensors writes
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
}


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).tolist())


def split_mixed(n_shards: int) -> list[dict[str, torch.Tensor]]:
    tensors = mixed_tensors()
    names = list(tensors)
    return [{k: tensors[k] for k in names[i::n_shards]} for i in range(n_shards)]


def check_against_safetensors(root: Path) -> None:
    """Every TensorInfo agrees with what safetensors itself reads, down to the bytes."""
    ckpt = read_checkpoint(root)
    seen = set()
    for file in ckpt.files:
        data = (root / file).read_bytes()
        with safe_open(str(root / file), framework="pt") as f:
            infos = {t.name: t for t in ckpt.tensors if t.file == file}
            assert set(infos) == set(f.keys())
            for name, info in infos.items():
                tensor = f.get_tensor(name)
                assert info.dtype == SAFETENSORS_DTYPE[tensor.dtype]
                assert info.shape == tuple(tensor.shape)
                assert info.nbytes == tensor.numel() * tensor.element_size()
                assert data[info.start : info.end] == raw_bytes(tensor)
                seen.add(name)
    assert seen == {t.name for t in ckpt.tensors}
    assert ckpt.total_bytes == sum(t.nbytes for t in ckpt.tensors)


def test_sharded_with_index(tmp_path: Path) -> None:
    root = write_real_checkpoint(tmp_path / "ckpt", split_mixed(3))
    ckpt = read_checkpoint(root)
    assert ckpt.index_file == "model.safetensors.index.json"
    assert ckpt.files == tuple(sorted(ckpt.files)) and len(ckpt.files) == 3
    assert len(ckpt.tensors) == len(mixed_tensors())
    check_against_safetensors(root)


def test_single_file(tmp_path: Path) -> None:
    root = write_real_checkpoint(tmp_path / "ckpt", split_mixed(1))
    ckpt = read_checkpoint(root)
    assert ckpt.files == ("model.safetensors",) and ckpt.index_file is None
    check_against_safetensors(root)


def test_directory_without_index(tmp_path: Path) -> None:
    root = write_real_checkpoint(
        tmp_path / "ckpt", split_mixed(2), index=False, names=["b.safetensors", "a.safetensors"]
    )
    ckpt = read_checkpoint(root)
    assert ckpt.files == ("a.safetensors", "b.safetensors")
    check_against_safetensors(root)


def test_index_chooses_files_and_reports_the_others(tmp_path: Path) -> None:
    # Mistral-style repos hold consolidated.safetensors next to indexed shards: the index wins.
    root = write_real_checkpoint(tmp_path / "ckpt", split_mixed(2))
    write_raw(root / "consolidated.safetensors", {}, 0)
    ckpt = read_checkpoint(root)
    assert "consolidated.safetensors" not in ckpt.files
    assert ckpt.ignored_files == ("consolidated.safetensors",)


def test_offsets_are_absolute_and_in_read_order(tmp_path: Path) -> None:
    root = write_real_checkpoint(tmp_path / "ckpt", split_mixed(2))
    ckpt = read_checkpoint(root)
    for file in ckpt.files:
        in_file = [t for t in ckpt.tensors if t.file == file]
        header_len = int.from_bytes((root / file).read_bytes()[:8], "little")
        assert min(t.start for t in in_file) >= 8 + header_len
        assert [t.start for t in in_file] == sorted(t.start for t in in_file)
    assert [t.file for t in ckpt.tensors] == sorted(t.file for t in ckpt.tensors)


@pytest.mark.parametrize("dtype", sorted(DTYPE_BITS))
def test_every_safetensors_dtype(tmp_path: Path, dtype: str) -> None:
    # Shapes chosen so that even 4- and 6-bit types fill whole bytes: 4 * 6 = 24 bits.
    shapes = {"scalar": (), "empty": (0, 3), "mat": (4, 6)}
    if DTYPE_BITS[dtype] < 8:
        del shapes["scalar"]  # a lone 4- or 6-bit value is not a whole byte
    root = tmp_path / "ckpt"
    root.mkdir()
    sparse_file(root / "model.safetensors", [(n, dtype, s) for n, s in shapes.items()])
    ckpt = read_checkpoint(root)
    infos = {t.name: t for t in ckpt.tensors}
    assert set(infos) == set(shapes)
    for name, shape in shapes.items():
        assert infos[name].dtype == dtype and infos[name].shape == shape
    assert infos["mat"].nbytes == 24 * DTYPE_BITS[dtype] // 8
    assert infos["empty"].nbytes == 0


def test_sparse_qwen3_8b_reads_headers_only(tmp_path: Path) -> None:
    root = write_sparse_checkpoint(tmp_path / "qwen3-8b", qwen3_8b())
    ckpt = read_checkpoint(root)
    assert len(ckpt.tensors) == 399
    assert ckpt.total_bytes == 16_381_470_720
    assert len(ckpt.files) == 4
    # Sparse files report their full length but hold (almost) no blocks: nothing was written,
    # and reading the headers must not have needed the data either.
    assert sum(os.stat(root / f).st_size for f in ckpt.files) > ckpt.total_bytes
    assert sum(os.stat(root / f).st_blocks * 512 for f in ckpt.files) < 10_000_000


def test_same_plan_input_from_any_listing_order(tmp_path: Path) -> None:
    shards = split_mixed(3)
    a = write_real_checkpoint(tmp_path / "a", shards)
    b = tmp_path / "b"
    b.mkdir()
    for name in sorted(os.listdir(a), reverse=True):  # created in the other order
        (b / name).write_bytes((a / name).read_bytes())
    ca, cb = read_checkpoint(a), read_checkpoint(b)
    assert ca.files == cb.files and ca.tensors == cb.tensors


def test_index_extra_tensor_not_in_index_is_still_loaded(tmp_path: Path) -> None:
    # Whole-file loading would register it, so every split must too.
    root = tmp_path / "ckpt"
    root.mkdir()
    sparse_file(root / "m1.safetensors", [("a", "F32", (4,)), ("extra", "F32", (2,))])
    sparse_file(root / "m2.safetensors", [("b", "F32", (4,))])
    write_index(root, {"a": "m1.safetensors", "b": "m2.safetensors"}, 32)
    assert {t.name for t in read_checkpoint(root).tensors} == {"a", "b", "extra"}


@pytest.mark.timeout(20)  # a FIFO must be refused, never opened: that would hang
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoint_is_one_precise_error(tmp_path: Path, case: str) -> None:
    build, words = MALFORMED[case]
    path = build(tmp_path / "ckpt")
    with pytest.raises(InvalidInput) as info:
        read_checkpoint(path)
    message = str(info.value)
    assert info.value.exit_code == ExitCode.INVALID_INPUT
    assert "\n" not in message
    for word in words:
        assert word in message
    assert "; " in message  # what is wrong; what to do


def test_files_are_never_modified(tmp_path: Path) -> None:
    root = write_real_checkpoint(tmp_path / "ckpt", split_mixed(2))
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.iterdir()}
    read_checkpoint(root)
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in root.iterdir()}
    assert before == after

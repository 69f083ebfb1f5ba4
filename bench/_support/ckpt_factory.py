"""Writing checkpoints for tests and benchmarks: real ones (with safetensors itself), sparse ones
of real model size (the real header, then `truncate` to full length: no disk used), and
malformed ones (arbitrary header bytes)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptctl.checkpoint.headers import DTYPE_BITS

GiB = 1 << 30
Spec = tuple[str, str, tuple[int, ...]]  # (name, safetensors dtype, shape)


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = DTYPE_BITS[dtype]
    for d in shape:
        n *= d
    return n // 8


def shard(specs: Iterable[Spec], max_bytes: int) -> list[list[Spec]]:
    """HF-style sharding: in order, start a new shard when the next tensor would not fit."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        b = nbytes(spec[1], spec[2])
        if shards[-1] and size + b > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += b
    return shards


def shard_names(count: int, stem: str = "model") -> list[str]:
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def header_bytes(header: Mapping[str, object]) -> bytes:
    """The safetensors framing: u64 length, then JSON padded with spaces to 8 bytes."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_raw(path: Path, header: Mapping[str, object] | bytes, data_len: int = 0) -> Path:
    """A file with this header (a dict, or raw bytes after the length) and `data_len` bytes of
    data: holes, so a huge one costs nothing."""
    if isinstance(header, Mapping):
        blob = header_bytes(header)
    else:
        blob = struct.pack("<Q", len(header)) + header
    path.write_bytes(blob)
    os.truncate(path, len(blob) + data_len)
    return path


def sparse_file(path: Path, specs: Sequence[Spec]) -> int:
    """Write one safetensors file with the real header and sparse data; returns data bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        end = offset + nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    write_raw(path, header, offset)
    return offset


def write_index(root: Path, weight_map: Mapping[str, str], total_size: int) -> Path:
    path = root / "model.safetensors.index.json"
    doc = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    path.write_text(json.dumps(doc, indent=2))
    return path


def drop_cache(files: Iterable[Path]) -> None:
    """Evict the files from the page cache (no root needed: clean pages of files we can open;
    written to disk first, as dirty pages stay whatever the advice)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rewrite_in_place_setting_the_mtime_back(path: Path, data: bytes | None = None) -> None:
    """Write `data` (else the file with its last byte flipped) over `path` in place - same
    inode, same size - and set its mtime back, as anyone who can write the file can. Only the
    ctime, which the write and the utime move and no user sets, still tells. The rewrite comes
    once a change gets another ctime than the file's: file systems stamp with a coarse clock."""
    import time

    before = path.stat()
    probe = path.with_name(f".{path.name}.clock")
    deadline = time.monotonic() + 30
    while True:  # (a few ms at most: one tick of the kernel's coarse clock)
        probe.write_bytes(b"")
        if probe.stat().st_ctime_ns != before.st_ctime_ns:
            break
        assert time.monotonic() < deadline, "the ctime clock does not move"
        time.sleep(0.001)
    probe.unlink()
    if data is None:
        flipped = bytearray(path.read_bytes())
        flipped[-1] ^= 0xFF
        data = bytes(flipped)
    assert len(data) == before.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns
    )  # fmt: skip


def write_sparse_checkpoint(
    root: Path, specs: Iterable[Spec], shard_bytes: int = 4 * GiB, index: bool = True
) -> Path:
    """A full-size HF-layout checkpoint (shards + index.json) whose data are holes."""
    root.mkdir(parents=True, exist_ok=True)
    shards = shard(specs, shard_bytes)
    names = shard_names(len(shards))
    weight_map: dict[str, str] = {}
    total = 0
    for name, specs_in_shard in zip(names, shards, strict=True):
        total += sparse_file(root / name, specs_in_shard)
        weight_map.update({spec[0]: name for spec in specs_in_shard})
    if index and len(names) > 1:
        write_index(root, weight_map, total)
    return root


def write_real_checkpoint(
    root: Path,
    shards: Sequence[Mapping[str, object]],
    index: bool = True,
    names: Sequence[str] | None = None,
) -> Path:
    """A real checkpoint written by safetensors itself: `shards` is a list of {name: tensor}."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    names = list(names or shard_names(len(shards)))
    weight_map: dict[str, str] = {}
    total = 0
    for name, tensors in zip(names, shards, strict=True):
        save_file(dict(tensors), str(root / name), metadata={"format": "pt"})  # type: ignore[arg-type]
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())  # type: ignore[attr-defined]
    if index and len(names) > 1:
        write_index(root, weight_map, total)
    return root


def mixed_tensors(seed: int = 0) -> dict[str, object]:
    """One small tensor of every dtype torch and safetensors share, plus 0-dim and empty ones."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(0, 200, shape, generator=g)

    return {
        "bf16": rnd(7, 5).to(torch.bfloat16),
        "fp16": rnd(3, 3).to(torch.float16),
        "fp32": rnd(4, 6),
        "fp64": rnd(5).to(torch.float64),
        "fp8_e4m3": rnd(8, 4).to(torch.float8_e4m3fn),
        "fp8_e5m2": rnd(3, 7).to(torch.float8_e5m2),
        "i8": ints(9).to(torch.int8),
        "i16": ints(3, 3).to(torch.int16),
        "i32": ints(11).to(torch.int32),
        "i64": ints(2, 3),
        "u8": ints(13).to(torch.uint8),
        "u16": ints(5).to(torch.uint16),
        "u32": ints(6).to(torch.uint32),
        "u64": ints(3).to(torch.uint64),
        "bool": ints(10) % 2 == 0,
        "scalar_f32": torch.tensor(3.5),
        "scalar_i64": torch.tensor(-7),
        "empty_bf16": torch.empty(0, 4, dtype=torch.bfloat16),
        "empty_i32": torch.empty(3, 0, dtype=torch.int32),
    }


# --- Malformed checkpoints: each builder makes one broken checkpoint directory under `root`
# and returns it; MALFORMED maps a case name to (builder, words the error line must contain).


def mixed_shards(seed: int) -> list[dict[str, object]]:
    """`mixed_tensors(seed)` dealt over two shards by name, alternately: every dtype, in two files
    (safetensors aligns within a file, not across files)."""
    mixed = mixed_tensors(seed)
    names = sorted(mixed)
    return [{n: mixed[n] for n in names[::2]}, {n: mixed[n] for n in names[1::2]}]


def _good_header(name: str = "w", nbytes_: int = 16) -> dict[str, object]:
    return {name: {"dtype": "F32", "shape": [nbytes_ // 4], "data_offsets": [0, nbytes_]}}


def _dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    return root


def _missing(root: Path) -> Path:
    return root / "does-not-exist"


def _a_file(root: Path) -> Path:
    return write_raw(_dir(root) / "model.safetensors", _good_header(), 16)


def _empty_dir(root: Path) -> Path:
    return _dir(root)


def _only_bin(root: Path) -> Path:
    (_dir(root) / "pytorch_model.bin").write_bytes(b"\x80\x02 not safetensors")
    return root


def _empty_file(root: Path) -> Path:
    (_dir(root) / "model.safetensors").write_bytes(b"")
    return root


def _truncated_file(root: Path) -> Path:
    (_dir(root) / "model.safetensors").write_bytes(b"\x10\x00\x00")
    return root


def _header_past_end(root: Path) -> Path:
    (_dir(root) / "model.safetensors").write_bytes(struct.pack("<Q", 4096) + b"{}")
    return root


def _huge_header(root: Path) -> Path:
    # A sparse file long enough that the length is "inside" it: still refused, not allocated.
    path = _dir(root) / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 10**9))
    os.truncate(path, 10**9 + 8)
    return root


def _header_not_json(root: Path) -> Path:
    write_raw(_dir(root) / "model.safetensors", b"{not json at all}")
    return root


def _header_not_object(root: Path) -> Path:
    write_raw(_dir(root) / "model.safetensors", b"[1, 2, 3]       ")
    return root


def _unknown_dtype(root: Path) -> Path:
    header = {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}
    write_raw(_dir(root) / "model.safetensors", header, 16)
    return root


def _bad_shape(root: Path) -> Path:
    header = {"w": {"dtype": "F32", "shape": [2, -2], "data_offsets": [0, 16]}}
    write_raw(_dir(root) / "model.safetensors", header, 16)
    return root


def _size_mismatch(root: Path) -> Path:
    header = {"w": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [0, 30]}}
    write_raw(_dir(root) / "model.safetensors", header, 30)
    return root


def _overlap(root: Path) -> Path:
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    write_raw(_dir(root) / "model.safetensors", header, 24)
    return root


def _out_of_range(root: Path) -> Path:
    write_raw(_dir(root) / "model.safetensors", _good_header(nbytes_=64), 40)  # 24 bytes short
    return root


def _files(root: Path, tensor_of_file: Mapping[str, str]) -> Path:
    """One 16-byte F32 tensor per file: {file name: tensor name}."""
    for file, tensor in tensor_of_file.items():
        write_raw(_dir(root) / file, _good_header(tensor), 16)
    return root


def _two_shards(root: Path) -> Path:
    names = shard_names(2)
    return _files(root, {names[0]: "a", names[1]: "b"})


def _index_not_json(root: Path) -> Path:
    _two_shards(root)
    (root / "model.safetensors.index.json").write_text('{"weight_map": {')
    return root


def _index_missing_shard(root: Path) -> Path:
    _two_shards(root)
    write_index(
        root,
        {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00003-of-00003.safetensors",
        },
        48,
    )
    return root


def _index_wrong_tensor(root: Path) -> Path:
    _two_shards(root)
    write_index(
        root,
        {"a": "model-00001-of-00002.safetensors", "z": "model-00002-of-00002.safetensors"},
        32,
    )
    return root


def _index_escapes(root: Path) -> Path:
    _two_shards(root)
    write_index(root, {"a": "../elsewhere/model.safetensors"}, 16)
    return root


def _duplicate_tensor(root: Path) -> Path:
    return _files(root, {"a.safetensors": "same", "b.safetensors": "same"})


def _fifo(root: Path) -> Path:
    # Opening a FIFO for reading blocks until a writer comes: it must be refused, not read.
    os.mkfifo(_dir(root) / "model.safetensors")
    return root


MALFORMED = {
    "missing": (_missing, ["does-not-exist", "does not exist"]),
    "not a directory": (_a_file, ["model.safetensors", "not a directory"]),
    "no safetensors": (_empty_dir, ["no .safetensors files"]),
    "only .bin": (_only_bin, ["no .safetensors files", "pytorch_model.bin", "convert"]),
    "empty file": (_empty_file, ["model.safetensors", "empty"]),
    "truncated file": (_truncated_file, ["model.safetensors", "truncated (3 bytes)"]),
    "header past end": (_header_past_end, ["model.safetensors", "not safetensors", "10 bytes"]),
    "huge header": (_huge_header, ["model.safetensors", "not safetensors", "over 100000000"]),
    "header not JSON": (_header_not_json, ["model.safetensors", "not valid JSON"]),
    "header not object": (_header_not_object, ["model.safetensors", "not a JSON object"]),
    "unknown dtype": (_unknown_dtype, ["model.safetensors", "'w'", "unknown dtype 'F128'"]),
    "bad shape": (_bad_shape, ["'w'", "shape [2, -2]"]),
    "shape vs bytes": (_size_mismatch, ["'w'", "needs 32 bytes", "hold 30"]),
    "overlap": (_overlap, ["'b'", "overlap", "'a'"]),
    "out of range": (_out_of_range, ["'w'", "[0, 64]", "past the end"]),
    "index not JSON": (_index_not_json, ["model.safetensors.index.json", "not valid JSON"]),
    "index missing shard": (
        _index_missing_shard,
        ["index.json", "'c'", "model-00003-of-00003.safetensors", "does not exist"],
    ),
    "index wrong tensor": (
        _index_wrong_tensor,
        ["index.json", "'z'", "model-00002-of-00002.safetensors", "does not hold it"],
    ),
    "index escapes": (_index_escapes, ["index.json", "outside the checkpoint directory"]),
    "duplicate tensor": (_duplicate_tensor, ["'same'", "a.safetensors", "b.safetensors"]),
    "fifo": (_fifo, ["model.safetensors", "not a regular file"]),
}


# -- the benchmarks' checkpoints: real model shapes, random bytes ----------------------------

# name: (tensor specs, shard size). Qwen3 in HF's 4 GiB shards; the DeepSeek-V3 layout at small
# widths in 53 MB shards, 56 of them, as many as the real one's per GB is not (issue 16).
MODELS = {
    "qwen3-0.6b": ("qwen3_0_6b", 4 * GiB),
    "qwen3-4b": ("qwen3_4b", 4 * GiB),
    "qwen3-8b": ("qwen3_8b", 4 * GiB),
    "qwen3-32b": ("qwen3_32b", 4 * GiB),
    "deepseek-v3-small": ("deepseek_v3_small", 53_000_000),
}


def write_checkpoint(
    root: Path, model: str, seed: int = 20261129, specs: list[Any] | None = None
) -> tuple[int, int]:
    """Write shards of random bytes (made on the GPU when there is one: fast) with real headers
    and an index.json; (bytes, tensors). `specs` (model_shapes' (name, dtype, shape)) stand in
    for `model`'s when given."""
    import torch

    from _support import model_shapes

    specs_of, shard_bytes = MODELS.get(model, ("", 4 * GiB))
    if specs is None:
        specs = list(getattr(model_shapes, specs_of)())
    root.mkdir(parents=True, exist_ok=True)
    shards = shard(specs, shard_bytes)
    names = shard_names(len(shards))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for name, group in zip(names, shards, strict=True):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for tensor_name, dtype, shape in group:
            size = nbytes(dtype, shape)
            header[tensor_name] = {
                "dtype": dtype,
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
            weight_map[tensor_name] = name
        with open(root / name, "wb") as fh:
            fh.write(header_bytes(header))
            left = offset
            while left:
                n = min(left, 512 << 20)
                chunk = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=gen)
                fh.write(chunk.cpu().numpy().tobytes())
                left -= n
        total += offset
    write_index(root, weight_map, total)
    return total, len(specs)

"""Reading a safetensors checkpoint from its headers only: names, dtypes, shapes, byte ranges.

Pure Python (struct + json), no torch: planning a 680 GB checkpoint reads a few MB of headers.

A safetensors file is: 8 bytes little-endian header length N, N bytes of JSON header, then the
data section. The header maps each tensor name to {"dtype", "shape", "data_offsets": [b, e]},
where b and e are relative to the start of the data section. `TensorInfo.start`/`end` below are
ABSOLUTE file offsets (8 + N + b, 8 + N + e), so a loader can slice a mapping of the whole file.

Every problem found raises `InvalidInput` (exit 3) with one line: which file, which tensor, what
is wrong and what to do.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter, lt
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from ckptctl.checkpoint.remembered import HeaderCache, LastResult
from ckptctl.errors import InvalidInput, OperationFailed
from ckptctl.regular_files import FileIdentity, UnfitFile, open_regular, read_regular

INDEX_NAME = "model.safetensors.index.json"
SUFFIX = ".safetensors"
# The reference implementation refuses headers above 100 MB; a bigger one is garbage, and
# refusing it up front keeps us from allocating gigabytes for a corrupt length field.
MAX_HEADER_BYTES = 100_000_000
# An index lists each tensor once (~100 bytes each: DeepSeek-V3's 91k tensors take 9 MB): one
# larger than the largest header is not an index, and is refused before it is read.
MAX_INDEX_BYTES = MAX_HEADER_BYTES
# The largest dimension, and product of dimensions, a tensor may have: torch's int64 sizes
# (safetensors' own limit, usize, is larger). Only a tensor with a 0 in its shape can get
# near it (any other is bounded by its bytes), and torch fails on it in C++ with a stack trace.
MAX_ELEMENTS = 2**63 - 1

# Every safetensors dtype (the Rust crate's list, plus the FNUZ variants that safetensors'
# Python side writes): its bits per element, and the name of its torch dtype (looked up at run
# time: older torch builds lack some, e.g. uint16/32/64 before 2.3 and float8_e8m0fnu before
# 2.7; None: torch has none). F4 and F6 pack several elements into a byte; torch's F4 holds two
# 4-bit values per byte: the safetensors shape counts values, torch's counts bytes.
SAFETENSORS_DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"),
    "U8": (8, "uint8"),
    "I8": (8, "int8"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "I16": (16, "int16"),
    "U16": (16, "uint16"),
    "F16": (16, "float16"),
    "BF16": (16, "bfloat16"),
    "I32": (32, "int32"),
    "U32": (32, "uint32"),
    "F32": (32, "float32"),
    "C64": (64, "complex64"),
    "F64": (64, "float64"),
    "I64": (64, "int64"),
    "U64": (64, "uint64"),
    "F4": (4, "float4_e2m1fn_x2"),
    "F6_E2M3": (6, None),
    "F6_E3M2": (6, None),
}
DTYPE_BITS = {name: bits for name, (bits, _) in SAFETENSORS_DTYPES.items()}
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".gguf")


class TensorInfo(NamedTuple):
    """One tensor as its header describes it. `start`/`end` are absolute offsets in `file`.

    A NamedTuple (immutable, compared by value): made 90k times for a DeepSeek-V3 checkpoint,
    where a frozen dataclass's __init__ cost twice as much.
    """

    name: str
    dtype: str  # safetensors spelling: "BF16", "F8_E4M3", ...
    shape: tuple[int, ...]
    file: str  # path relative to the checkpoint directory, POSIX separators
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's layout. `files` is sorted; `tensors` is in read order (file, then offset)."""

    root: Path
    files: tuple[str, ...]
    tensors: tuple[TensorInfo, ...]
    index_file: str | None = None  # the index that chose `files`, if any
    ignored_files: tuple[str, ...] = ()  # .safetensors files next to an index that omits them
    file_bytes: dict[str, int] = field(default_factory=dict)  # tensor bytes held by each file
    # Each file as it was when its header was read: checked again right before its data is
    # read (`open_planned`), so a file replaced or cut short since is refused, not misread.
    file_ids: dict[str, FileIdentity] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.file_bytes.values())

    def path_of(self, file: str) -> Path:
        return self.root / file


_NAME, _START, _END = attrgetter("name"), attrgetter("start"), attrgetter("end")
HEADERS = HeaderCache()  # headers already parsed and validated (remembered.py)
_LAST_INDEX: LastResult[dict[str, str]] = LastResult()


def _fail(where: Path | str, problem: str, action: str) -> InvalidInput:
    return InvalidInput(f"{where}: {problem}; {action}")


CORRUPT = "the file is damaged or not safetensors: re-download or re-save it"


def _parse_entry(path: Path, name: str, entry: object) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype, shape, begin, end) of one header entry, or InvalidInput saying what is wrong.

    A tight happy path (this runs 90k times for a DeepSeek-V3 checkpoint); the precise
    diagnosis is only worked out once something is known to be wrong.
    """
    try:
        dtype, shape = entry["dtype"], entry["shape"]  # type: ignore[index]
        begin, end = entry["data_offsets"]  # type: ignore[index]
        bits = DTYPE_BITS[dtype]
        for d in shape:
            # `type(d) is int`, not isinstance: JSON `true` is a bool, and not a size.
            if type(d) is not int or d < 0:
                raise TypeError
            bits *= d
        ok = type(shape) is list and type(begin) is int and type(end) is int and 0 <= begin <= end
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise _bad_entry(f"{path}: tensor {name!r}", entry)
    if not bits:  # a 0 in the shape: the other dimensions are not bounded by any bytes
        _check_empty_shape(path, name, shape)
    if bits % 8 or end - begin != bits // 8:
        need = f"{bits / 8:g}" if bits % 8 else f"{bits // 8}"
        raise _fail(
            f"{path}: tensor {name!r}",
            f"shape {shape} of {dtype} needs {need} bytes but data_offsets [{begin}, {end}] "
            f"hold {end - begin}",
            CORRUPT,
        )
    return dtype, tuple(shape), begin, end


def shape_fits(shape: Iterable[int]) -> bool:
    """Every running product of the dimensions (a 0 counted as 1) fits torch's sizes (int64):
    a 0 makes the tensor empty, but torch still multiplies the others."""
    product = 1
    for d in shape:
        product *= d or 1
        if product > MAX_ELEMENTS:
            return False
    return True


def _check_empty_shape(path: Path, name: str, shape: list[int]) -> None:
    if not shape_fits(shape):
        raise _fail(
            f"{path}: tensor {name!r}",
            f"shape {shape} has dimensions beyond {MAX_ELEMENTS} elements, which no tensor "
            "can have",
            CORRUPT,
        )


def _is_size(value: object) -> bool:
    return type(value) is int and value >= 0


def _bad_entry(where: str, entry: object) -> InvalidInput:
    """What exactly is wrong with an entry that failed the happy path."""
    if not isinstance(entry, dict):
        return _fail(where, "entry is not a JSON object", CORRUPT)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        return _fail(
            where,
            f"unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_BITS))})",
            "re-save it with a supported dtype or upgrade ckptctl",
        )
    if type(shape) is not list or not all(_is_size(d) for d in shape):
        return _fail(where, f"shape {shape!r} is not a list of sizes", CORRUPT)
    return _fail(where, f"data_offsets {offsets!r} is not [begin, end]", CORRUPT)


def read_file_header(root: Path, file: str) -> tuple[list[TensorInfo], FileIdentity]:
    """The tensors of one .safetensors file, validated against the file's real size, and the
    file as it was when they were read (for `open_planned`)."""
    path = root / file
    try:
        # A FIFO or device would block or lie about its size: never read one.
        fd, st = open_regular(path, "a .safetensors file")
    except UnfitFile as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise out_of_descriptors(path) from None
        raise _fail(path, exc.problem, "replace it with a real .safetensors file") from None
    try:
        size = st.st_size
        if size < 8:
            what = "is empty (0 bytes)" if size == 0 else f"is truncated ({size} bytes)"
            raise _fail(path, f"{what}, shorter than the 8-byte header length", CORRUPT)
        with os.fdopen(fd, "rb") as f:
            fd = -1  # closed with f
            (header_len,) = struct.unpack("<Q", f.read(8))
            # Never a value made of the file's bytes in the message: a shard may be a symlink
            # to any file its reader can read (a Hugging Face cache is symlinks).
            if header_len > size - 8:
                raise _fail(
                    path,
                    f"is not safetensors: its first 8 bytes are no header length that fits in "
                    f"its {size} bytes",
                    "the file is truncated or not safetensors: re-download or re-save it",
                )
            if header_len > MAX_HEADER_BYTES:
                raise _fail(
                    path,
                    f"is not safetensors: its first 8 bytes give a header over "
                    f"{MAX_HEADER_BYTES} bytes, larger than any (the file is {size} bytes)",
                    CORRUPT,
                )
            raw = f.read(header_len)
    except OSError as exc:
        raise _fail(
            path, f"cannot be read ({exc.strerror or exc})", "check its permissions"
        ) from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(raw) != header_len:
        raise _fail(path, "changed size while being read", "retry when nothing is writing it")
    data_start = 8 + header_len
    data_len = size - data_start
    known = HEADERS.get(file, data_len, raw)  # (a serve job's next push: the same header)
    if known is not None:
        return list(known), FileIdentity.of(st)
    tensors = _parse_header(path, file, raw, data_start, data_len)
    HEADERS.put(file, data_len, raw, tuple(tensors))
    return tensors, FileIdentity.of(st)


def _json_of(raw: bytes) -> object:
    """A file's JSON, or a ValueError whose words never quote the file (json's give positions
    only; a UnicodeDecodeError's would quote a byte)."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _parse_header(
    path: Path, file: str, raw: bytes, data_start: int, data_len: int
) -> list[TensorInfo]:
    """The tensors of a header (`raw`), validated; sorted by offset."""
    try:
        header = _json_of(raw)
    except ValueError as exc:
        raise _fail(path, f"header is not valid JSON ({exc})", CORRUPT) from None
    if not isinstance(header, dict):
        raise _fail(path, "header is not a JSON object", CORRUPT)
    tensors: list[TensorInfo] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, begin, end = _parse_entry(path, name, entry)
        if end > data_len:
            raise _fail(
                f"{path}: tensor {name!r}",
                f"data_offsets [{begin}, {end}] run past the end of the data section "
                f"({data_len} bytes)",
                "the file is truncated: re-download or re-save it",
            )
        tensors.append(TensorInfo(name, dtype, shape, file, data_start + begin, data_start + end))

    tensors.sort(key=attrgetter("start", "end", "name"))
    starts, ends = list(map(_START, tensors)), list(map(_END, tensors))
    if not any(map(lt, starts[1:], ends[:-1])):
        return tensors  # each starts where the one before ended or later
    previous: TensorInfo | None = None
    for t in tensors:  # something starts early: an overlap, or just an empty tensor inside one
        if t.start == t.end:
            continue  # an empty tensor occupies no bytes and cannot overlap anything
        if previous is not None and t.start < previous.end:
            raise _fail(
                f"{path}: tensor {t.name!r}",
                f"bytes [{t.start - data_start}, {t.end - data_start}] overlap tensor "
                f"{previous.name!r} [{previous.start - data_start}, {previous.end - data_start}]",
                CORRUPT,
            )
        previous = t
    return tensors


def _list_dir(root: Path) -> list[str]:
    try:
        return sorted(os.listdir(root))
    except OSError as exc:
        raise _fail(
            root, f"cannot be listed ({exc.strerror or exc})", "check its permissions"
        ) from None


def _safe_relative(index: Path, name: str) -> str:
    """A shard name from an index must stay inside the checkpoint directory."""
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\\" in name:
        raise _fail(
            index,
            f"names shard {name!r}, which is outside the checkpoint directory",
            "an index may only name files next to it: fix or regenerate the index",
        )
    return str(p)


def _read_index(root: Path, index_name: str) -> dict[str, str]:
    """The index's weight_map (tensor name -> shard file), validated for shape, not contents."""
    index = root / index_name
    action = "regenerate the index, or delete it to load every .safetensors file in the directory"
    try:
        # Capped and regular only: an index that is a FIFO, /dev/zero or gigabytes is refused.
        raw = read_regular(index, MAX_INDEX_BYTES, "an index")
    except UnfitFile as exc:
        raise _fail(index, exc.problem, action) from None
    # (A serve job's next push: the same index, byte for byte; the map is never changed.)
    return _LAST_INDEX.get(raw, lambda: _parse_index(index, raw, action))


def _parse_index(index: Path, raw: bytes, action: str) -> dict[str, str]:
    try:
        doc = _json_of(raw)
    except ValueError as exc:
        raise _fail(index, f"is not valid JSON ({exc})", action) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise _fail(index, 'has no "weight_map" object', action)
    if not weight_map:
        raise _fail(index, "has an empty weight_map", action)
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise _fail(index, f"maps tensor {name!r} to {shard!r}, not a file name", action)
    # Normalise each shard name once (90k tensors, ~160 shards).
    shards = {shard: _safe_relative(index, shard) for shard in set(weight_map.values())}
    return {name: shards[shard] for name, shard in weight_map.items()}


def _pick_index(root: Path, names: Iterable[str]) -> str | None:
    names = list(names)
    if INDEX_NAME in names:
        return INDEX_NAME
    others = [n for n in names if n.endswith(SUFFIX + ".index.json")]
    if len(others) > 1:
        raise _fail(
            root,
            f"holds several indexes ({', '.join(others)})",
            "keep the one that describes the checkpoint, or pass a directory with only one",
        )
    return others[0] if others else None


def _refuse_duplicate(
    root: Path, earlier: list[TensorInfo], infos: list[TensorInfo], file: str
) -> None:
    owner = {t.name: t.file for t in earlier}
    for t in infos:
        first = owner.setdefault(t.name, file)
        if first != file:
            raise _fail(
                root,
                f"tensor {t.name!r} is in both {first} and {file}",
                "remove the stale file, or add an index that names one of them",
            )
    raise _fail(root, f"{file} holds a tensor name twice", CORRUPT)  # JSON keys: cannot happen


def _missing(path: Path) -> str | None:
    """Why `path` is not there ("does not exist", "cannot be looked up (...)"), or None. A name
    too long for the file system, or a folder on the way that this user may not enter, is
    input to refuse (exit 3), not an internal error: Path.exists raises for those."""
    try:
        return None if path.exists() else "does not exist"
    except OSError as exc:
        return f"cannot be looked up ({exc.strerror or exc})"


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and validate every header of the checkpoint at `path` (reads no tensor data).

    The files are: those the index names, if there is `model.safetensors.index.json` (or one
    other `*.safetensors.index.json`); otherwise every `*.safetensors` in the directory. A single
    `model.safetensors` is simply a directory of one file.
    """
    root = Path(path)
    missing = _missing(root)
    if missing:
        raise _fail(root, missing, "pass the directory that holds the .safetensors files")
    if not root.is_dir():
        action = "pass the directory that holds it" if root.name.endswith(SUFFIX) else ""
        raise _fail(root, "is not a directory", action or "pass a checkpoint directory")
    root = root.resolve()
    names = _list_dir(root)
    on_disk = [n for n in names if n.endswith(SUFFIX)]

    index_name = _pick_index(root, names)
    weight_map: dict[str, str] = {}
    if index_name is not None:
        weight_map = _read_index(root, index_name)
        files = sorted(set(weight_map.values()))
        for shard in files:
            missing = _missing(root / shard)
            if missing:
                name = min(n for n, s in weight_map.items() if s == shard)
                raise _fail(
                    root / index_name,
                    f"maps tensor {name!r} to shard {shard!r}, which {missing}",
                    "download the missing shard, or regenerate the index",
                )
    else:
        files = on_disk
    if not files:
        others = [n for n in names if n.endswith(OTHER_WEIGHT_SUFFIXES)]
        if others:
            raise _fail(
                root,
                f"holds no .safetensors files, only {len(others)} other weight file(s) "
                f"such as {others[0]!r}",
                "convert the checkpoint to safetensors (e.g. save_pretrained(..., "
                "safe_serialization=True))",
            )
        raise _fail(root, "holds no .safetensors files", "pass a safetensors checkpoint directory")

    tensors: list[TensorInfo] = []
    owner: dict[str, str] = {}
    file_bytes: dict[str, int] = {}
    file_ids: dict[str, FileIdentity] = {}
    generation = HEADERS.next_generation()  # (headers the last two reads used are kept)
    for file in files:
        infos, file_ids[file] = read_file_header(root, file)
        file_bytes[file] = sum(map(_END, infos)) - sum(map(_START, infos))
        known = len(owner)
        owner.update(dict.fromkeys(map(_NAME, infos), file))
        if len(owner) != known + len(infos):  # a name seen before: find it (the slow way)
            _refuse_duplicate(root, tensors, infos, file)
        tensors.extend(infos)
    HEADERS.forget_unused(generation)

    # Every tensor where the index says (a dict comparison in C; then the first one that is not)
    for name, shard in () if owner == weight_map else weight_map.items():
        if owner.get(name) != shard:
            found = f" (it is in {owner[name]})" if name in owner else ""
            raise _fail(
                root / str(index_name),
                f"maps tensor {name!r} to {shard}, which does not hold it{found}",
                "regenerate the index from the shards",
            )

    return Checkpoint(
        root=root,
        files=tuple(files),
        tensors=tuple(tensors),
        index_file=index_name,
        ignored_files=tuple(sorted(set(on_disk) - set(files))),
        file_bytes=file_bytes,
        file_ids=file_ids,
    )


def out_of_descriptors(path: Path) -> OperationFailed:
    """Opening a file failed because this process (or the system) has too many files open:
    nothing is wrong with the file, and saying it changed would send the user the wrong way."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return OperationFailed(
        f"{path}: cannot be opened: too many open files (this process may have {soft} open at "
        "once); raise the limit (`ulimit -n`) and rerun"
    )


def open_planned(checkpoint: Checkpoint, file: str) -> int:
    """A read-only fd of `file`, refused (exit 3) unless it is still the file that was planned:
    the same inode, size, mtime and ctime as when its header was read (FileIdentity). Reading
    a file cut short since would fail halfway (a mapped one with SIGBUS); a replaced one holds
    other tensors. The caller closes the fd."""
    path = checkpoint.path_of(file)
    action = (
        "the file changed since the checkpoint was planned; wait for the writer to finish and rerun"
    )
    try:
        fd, st = open_regular(path, "a .safetensors file")
    except UnfitFile as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise out_of_descriptors(path) from None
        raise _fail(path, exc.problem, action) from None
    planned = checkpoint.file_ids.get(file)
    now = FileIdentity.of(st)
    if planned is not None and now != planned:
        os.close(fd)
        if now.size != planned.size:
            change = f"is {now.size} bytes, but was {planned.size} when planned"
        elif (now.device, now.inode) != (planned.device, planned.inode):
            change = "was replaced by another file"
        else:
            change = "was modified"
        raise _fail(path, change, action)
    return fd


def changed_since(before: Checkpoint, now: Checkpoint) -> str | None:
    """What changed between two reads of one checkpoint (files, their identities, tensors),
    in a few words; None when nothing did."""
    if before.files != now.files:
        gone = sorted(set(before.files) - set(now.files))
        if gone:
            return f"files removed: {', '.join(gone[:3])}"
        return f"files added: {', '.join(sorted(set(now.files) - set(before.files))[:3])}"
    for file in before.files:
        if before.file_ids.get(file) != now.file_ids.get(file):
            return f"{file} was rewritten"
    if before.tensors != now.tensors:
        return "its headers describe other tensors"
    return None

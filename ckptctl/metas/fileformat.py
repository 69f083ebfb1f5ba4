"""The metas file: JSON, versioned, checksummed, written atomically, validated on every read.

A metas file records where each owner rank of a running `save-metas` job holds its part of a
checkpoint (checkpoint-engine's `dict[int, MemoryBufferMetaList]` from `ps.get_metas()`), so
that `ckptctl join` on another node can pull the weights over p2p. Layout (format version 1):

    {
      "format": "ckptctl-metas",
      "format_version": 1,
      "checkpoint_name": "my-checkpoint-iter-0",
      "world_size": 8,
      "created_at": "2026-11-29T19:27:35+00:00",
      "ckptctl_version": "0.1.0",
      "checkpoint_engine_version": "0.4.2",
      "metas": {"0": {...MemoryBufferMetaList...}, ...},
      "checksum": "sha256:<hex>"
    }

`metas` is serialised by checkpoint-engine's own pydantic models (a `TypeAdapter`), so dtypes
are `"torch.bfloat16"`-style strings and shapes JSON arrays. `checksum` is the SHA-256 of the
canonical JSON (sorted keys, no spaces, ASCII) of every other field: it catches truncation,
corruption and edits, not a forger (a forged file still has to pass every check below).

The seed script's pickle files are read only on request, through `ckptctl.metas.legacy`.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import math
import os
import pickletools
import re
import reprlib
import tempfile
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ckptctl import __version__
from ckptctl.checkpoint.headers import MAX_ELEMENTS, shape_fits
from ckptctl.errors import InvalidInput, OperationFailed
from ckptctl.regular_files import UnfitFile, read_regular, replaceable_target, why_not_replace

if TYPE_CHECKING:
    from checkpoint_engine.data_types import MemoryBufferMetaList

FORMAT_NAME = "ckptctl-metas"
FORMAT_VERSION = 1
# A real metas file is ~150 bytes per tensor (a 1M-tensor checkpoint stays under 200 MiB);
# anything larger is not one, and is refused before it is read into memory.
MAX_METAS_FILE_BYTES = 256 * 1024 * 1024

_HEADER_FIELDS = (
    "format",
    "format_version",
    "checkpoint_name",
    "world_size",
    "created_at",
    "ckptctl_version",
    "checkpoint_engine_version",
)
_FIELDS = frozenset((*_HEADER_FIELDS, "metas", "checksum"))
_RANK_KEY = re.compile(r"0|[1-9][0-9]{0,8}")
_CHECKSUM = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class MetasFile:
    """A metas file as read and validated. Legacy pickles carry no header: those fields are None."""

    path: Path
    metas: dict[int, MemoryBufferMetaList]
    checkpoint_name: str | None = None
    world_size: int | None = None
    created_at: datetime | None = None
    ckptctl_version: str | None = None
    checkpoint_engine_version: str | None = None
    format_version: int | None = None
    legacy_pickle: bool = False


# --------------------------------------------------------------------------------------------
# Writing


def write_metas_file(
    path: str | os.PathLike[str],
    metas: dict[int, MemoryBufferMetaList],
    *,
    checkpoint_name: str,
    world_size: int,
) -> None:
    """Write `metas` (from `ParameterServer.get_metas()`) to `path`, atomically.

    Raises ValueError for arguments no metas file may hold (a rank outside the world, an empty
    name), OperationFailed when the file cannot be written. Either way nothing is left behind:
    the file appears complete (temporary file in the same folder, fsync, rename) or not at all.
    """
    from ckptctl.ce.bare_import import engine_module

    engine_module("data_types")  # (entered bare: the import below skips the package's HTTP API)
    from checkpoint_engine.data_types import MemoryBufferMetaList
    from pydantic import TypeAdapter

    from ckptctl.ce.internals import installed_version

    if not isinstance(checkpoint_name, str) or not checkpoint_name:
        raise ValueError("checkpoint_name must be a non-empty string")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "checkpoint_name": checkpoint_name,
        "world_size": world_size,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "ckptctl_version": __version__,
        "checkpoint_engine_version": installed_version() or "unknown",
        "metas": TypeAdapter(dict[int, MemoryBufferMetaList]).dump_python(metas, mode="json"),
    }
    doc["checksum"] = _checksum(doc)
    # Never write a file the reader would refuse: run the reader's checks on what we wrote.
    try:
        _validate_document(doc, source=str(path))
    except InvalidInput as exc:
        raise ValueError(str(exc)) from None
    # (Checked when the job started, and again here: a file put there since is the user's.)
    problem = why_not_replace(os.path.abspath(path), _is_a_metas_file, WHAT)
    if problem:
        raise OperationFailed(f"cannot write metas file {path}: {problem}; name a new file")
    _atomic_write(Path(path), _render(doc).encode("ascii"))


WHAT = "a metas file"


def check_target(path: str | os.PathLike[str], flag: str) -> str:
    """FILE as an absolute path that a metas file may be written to, or a UsageError saying
    why not (`flag`: the option that named it). Only a new file, or a metas file written
    before, is replaced: ckptctl's own JSON, or a pickle as the seed script writes (a user who
    switches keeps their command line)."""
    return replaceable_target(path, _is_a_metas_file, WHAT, flag)


def _is_a_metas_file(f: BinaryIO, size: int) -> bool:
    """Whether the file `f` (of `size` bytes) is a metas file: one that parses as ckptctl's
    JSON format, or the seed script's pickle of checkpoint-engine's metas, told from its
    opcodes (never unpickled). Nothing else is: a script or config that mentions
    checkpoint_engine, another pickle (an optimizer's state), a file beyond any metas file's
    size."""
    if size > MAX_METAS_FILE_BYTES:
        return False
    data = f.read(size + 1)
    if len(data) != size:
        return False  # (changed while read: not ours to replace now)
    kind = _sniff(data)
    if kind == "pickle":
        from ckptctl.metas.legacy import is_metas_pickle

        return is_metas_pickle(data)
    if kind != "json":
        return False
    try:
        doc = _parse_json(data, Path(WHAT))  # (refused with a message nobody sees)
    except InvalidInput:
        return False
    return set(doc) == _FIELDS


def _render(doc: dict[str, Any]) -> str:
    """One top-level field per line and one line per rank, so `head` shows the header.

    `metas` comes last but one: the checksum closes the file, and a truncated file loses it.
    """

    def field(indent: str, key: str, value: Any) -> str:
        return f"{indent}{json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}"

    ranks = ",\n".join(field("    ", k, v) for k, v in doc["metas"].items())
    lines = [
        f'  "metas": {{\n{ranks}\n  }}' if k == "metas" else field("  ", k, v)
        for k, v in doc.items()
    ]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _atomic_write(path: Path, data: bytes) -> None:
    directory = path.parent if str(path.parent) else Path(".")
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise OperationFailed(
            f"cannot write metas file {path}: {exc.strerror} (in {directory}); "
            "check that the folder exists and is writable"
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes the file 0600; a metas file is for other users and nodes to read.
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OperationFailed(f"cannot write metas file {path}: {exc.strerror or exc}") from None
    # The rename itself is durable only once the folder is synced.
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _umask() -> int:
    mask = os.umask(0o022)  # there is no getter: set and restore
    os.umask(mask)
    return mask


def _checksum(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(canonical.encode("ascii")).hexdigest()


# --------------------------------------------------------------------------------------------
# Reading


def read_metas_file(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> MetasFile:
    """Read and validate a metas file; any problem is InvalidInput (exit 3) naming the file.

    The kind is told from the content, not the name: a JSON metas file, or a legacy pickle
    (`pickle.dump(ps.get_metas())`), which is unpickled only with `allow_pickle` and then only
    through the restricted unpickler.
    """
    path = Path(path)
    data = _read_capped(path)
    kind = _sniff(data)
    if kind == "pickle":
        if not allow_pickle:
            raise InvalidInput(
                f"{path} is a legacy pickle metas file; it was not read, because unpickling can "
                "run code. If you trust its origin, pass --allow-pickle (only checkpoint-engine's "
                "metas classes are admitted)"
            )
        from ckptctl.metas.legacy import load_legacy_pickle

        plain = load_legacy_pickle(data, source=str(path))
        return MetasFile(
            path=path,
            metas=validate_metas(plain, source=str(path)),
            legacy_pickle=True,
        )
    if kind != "json":
        raise InvalidInput(f"{path} is not a metas file: it is neither ckptctl's JSON nor a pickle")
    doc = _parse_json(data, path)
    metas = _validate_document(doc, source=str(path))
    return MetasFile(
        path=path,
        metas=metas,
        checkpoint_name=doc["checkpoint_name"],
        world_size=doc["world_size"],
        created_at=datetime.fromisoformat(doc["created_at"]),
        ckptctl_version=doc["ckptctl_version"],
        checkpoint_engine_version=doc["checkpoint_engine_version"],
        format_version=doc["format_version"],
    )


def _read_capped(path: Path) -> bytes:
    """The file's bytes: a regular file only (a FIFO would block, /dev/zero never end), and
    refused from its size, before it is read, when larger than any metas file."""
    try:
        data = read_regular(path, MAX_METAS_FILE_BYTES, "a metas file")
    except UnfitFile as exc:
        raise InvalidInput(f"metas file {path} {exc.problem}") from None
    if not data:
        raise InvalidInput(f"{path} is empty (was it cut short while being written?)")
    return data


def _sniff(data: bytes) -> str:
    """'pickle', 'json' or 'unknown', from the bytes alone (never by unpickling)."""
    if data[0] == 0x80:  # PROTO opcode: every pickle of protocol 2 or later starts with it
        return "pickle"
    if data.lstrip(b" \t\r\n\xef\xbb\xbf")[:1] in (b"{", b"["):
        return "json"
    # Protocols 0 and 1 have no marker: accept a stream that parses, opcode by opcode, to a
    # final STOP. pickletools only decodes opcodes; it never builds an object.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # odd escapes in protocol-0 text
            last = collections.deque(pickletools.genops(data), maxlen=1)
    except ValueError:
        return "unknown"
    if last and last[0][0].name == "STOP" and last[0][2] == len(data) - 1:
        return "pickle"
    return "unknown"


def _parse_json(data: bytes, path: Path) -> dict[str, Any]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise InvalidInput(f"{path} is not a metas file: it is not UTF-8 text") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        # The parser stopped at the end, or inside a string that never closes: cut short.
        cut = exc.pos >= len(text.rstrip()) - 1 or exc.msg.startswith("Unterminated string")
        raise InvalidInput(
            f"{path} {'is truncated' if cut else 'is not valid JSON'} "
            f"({exc.msg}: line {exc.lineno} column {exc.colno}); "
            "write it again with ckptctl save-metas"
        ) from None
    except (ValueError, RecursionError) as exc:  # e.g. a 5000-digit number, absurd nesting
        raise InvalidInput(f"{path} is not a metas file: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise InvalidInput(
            f'{path} is JSON but not a ckptctl metas file (no "format": "{FORMAT_NAME}")'
        )
    return doc


def _validate_document(doc: dict[str, Any], *, source: str) -> dict[int, MemoryBufferMetaList]:
    version = doc.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidInput(f"{source}: format_version is missing or not an integer")
    if version != FORMAT_VERSION:
        newer = "; it was written by a newer ckptctl: upgrade" if version > FORMAT_VERSION else ""
        raise InvalidInput(
            f"{source}: metas format version {version} is not supported "
            f"(this ckptctl reads version {FORMAT_VERSION}){newer}"
        )
    checksum = doc.get("checksum")
    if not isinstance(checksum, str) or not _CHECKSUM.fullmatch(checksum):
        raise InvalidInput(f"{source}: the checksum is missing or malformed")
    if checksum != _checksum(doc):
        raise InvalidInput(
            f"{source}: checksum mismatch: the file was changed or damaged after it was "
            "written; write it again with ckptctl save-metas"
        )
    # The checksum matched, so what follows catches a writer's bug or a forged file.
    if unknown := sorted(set(doc) - _FIELDS):
        raise InvalidInput(f"{source}: unexpected field(s) {', '.join(unknown)}")
    if missing := sorted(_FIELDS - set(doc)):
        raise InvalidInput(f"{source}: missing field(s) {', '.join(missing)}")
    for field in ("checkpoint_name", "created_at", "ckptctl_version", "checkpoint_engine_version"):
        if not isinstance(doc[field], str) or not doc[field]:
            raise InvalidInput(f"{source}: {field} must be a non-empty string")
    try:
        datetime.fromisoformat(doc["created_at"])
    except ValueError:
        raise InvalidInput(f"{source}: created_at is not an ISO 8601 time") from None
    world = doc["world_size"]
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise InvalidInput(f"{source}: world_size must be a positive integer")
    metas = validate_metas(doc["metas"], source=source)
    if outside := sorted(r for r in metas if r >= world):
        raise InvalidInput(f"{source}: owner rank {outside[0]} is outside world_size {world}")
    return metas


# --------------------------------------------------------------------------------------------
# Validating the metas themselves (JSON files and legacy pickles alike)


def validate_metas(data: Any, *, source: str) -> dict[int, MemoryBufferMetaList]:
    """Plain data (rank → MemoryBufferMetaList fields) → checkpoint-engine's models, checked.

    Validation is pydantic's strict JSON mode (no "123" for an int), plus what the models do
    not check: canonical rank keys, known dtypes, non-negative sizes, consistent buffers.
    """
    from ckptctl.ce.bare_import import engine_module

    engine_module("data_types")  # (entered bare: the import below skips the package's HTTP API)
    from checkpoint_engine.data_types import MemoryBufferMetaList
    from pydantic import TypeAdapter, ValidationError

    if not isinstance(data, dict):
        raise InvalidInput(f"{source}: metas must map owner ranks to their buffers")
    for key in data:
        if not (type(key) is int and key >= 0) and not (
            isinstance(key, str) and _RANK_KEY.fullmatch(key)
        ):
            raise InvalidInput(f"{source}: {key!r} is not an owner rank")
    _check_plain(data, source)
    try:
        text = json.dumps(data, ensure_ascii=True)
        metas = TypeAdapter(dict[int, MemoryBufferMetaList]).validate_json(text, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise InvalidInput(f"{source}: invalid metas at {where}: {first['msg']}{more}") from None
    except (TypeError, ValueError) as exc:  # checkpoint-engine's validators raise these bare
        raise InvalidInput(f"{source}: invalid metas: {exc}") from None
    _check_consistency(metas, source)
    return metas


def _known_dtype_names() -> frozenset[str]:
    import torch

    return frozenset(str(v) for v in vars(torch).values() if isinstance(v, torch.dtype))


def _check_plain(data: dict[Any, Any], source: str) -> None:
    """What checkpoint-engine's models would take but must not get: a dtype that is not one of
    torch's (it resolves a name with getattr(torch, name)), and numbers beyond torch's int64
    sizes, which its C++ code wraps (a shape of three 2^62 dimensions counted 0 bytes) or
    refuses with an overflow. The bounds are the safetensors header parser's."""
    known = _known_dtype_names()
    for rank, entry in data.items():
        buffers = entry.get("memory_buffer_metas_list") if isinstance(entry, dict) else None
        for i, buffer in enumerate(buffers if isinstance(buffers, list) else ()):
            where = f"{source}: rank {rank} buffer {i}"
            if not isinstance(buffer, dict):
                continue
            for key in ("ptr", "size"):
                _check_int64(buffer.get(key), f"{where}: {key}")
            params = buffer.get("metas")
            for param in params if isinstance(params, list) else ():
                if not isinstance(param, dict):
                    continue
                name, dtype, shape = param.get("name"), param.get("dtype"), param.get("shape")
                if isinstance(dtype, str) and dtype not in known:
                    raise InvalidInput(
                        f"{source}: rank {rank}: {name!r} has unknown dtype {dtype!r}"
                    )
                _check_int64(param.get("aligned_size"), f"{where}: {name!r}: aligned_size")
                if (
                    isinstance(shape, list)
                    and all(type(d) is int for d in shape)
                    and not shape_fits(abs(d) for d in shape)
                ):
                    raise InvalidInput(
                        f"{where}: {name!r} has shape {reprlib.repr(shape)}, beyond "
                        f"{MAX_ELEMENTS} elements, which no tensor can have"
                    )


def _check_int64(value: Any, what: str) -> None:
    if type(value) is int and abs(value) > MAX_ELEMENTS:
        raise InvalidInput(f"{what} {value} is beyond {MAX_ELEMENTS}, which no size or address is")


def _check_consistency(metas: dict[int, MemoryBufferMetaList], source: str) -> None:
    for rank, entry in metas.items():
        for i, buffer in enumerate(entry.memory_buffer_metas_list):
            where = f"{source}: rank {rank} buffer {i}"
            if buffer.ptr < 0 or buffer.size < 0:
                raise InvalidInput(f"{where}: negative address or size")
            used = 0
            for p in buffer.metas:
                if any(d < 0 for d in p.shape):
                    raise InvalidInput(f"{where}: {p.name!r} has a negative dimension")
                # (math.prod: torch's numel wraps past int64; the bounds above keep it exact)
                nbytes = p.dtype.itemsize * math.prod(p.shape)
                if nbytes > MAX_ELEMENTS:
                    raise InvalidInput(
                        f"{where}: {p.name!r} needs {nbytes} bytes, beyond {MAX_ELEMENTS}, which "
                        "no tensor can have"
                    )
                if p.aligned_size < nbytes:
                    raise InvalidInput(f"{where}: {p.name!r} does not fit its aligned_size")
                used += p.aligned_size
            if used > buffer.size:
                raise InvalidInput(
                    f"{where}: its tensors need {used} bytes, it holds {buffer.size}"
                )

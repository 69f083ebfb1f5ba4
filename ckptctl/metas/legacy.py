"""Reading the seed script's pickle metas files (`pickle.dump(ps.get_metas())`), safely.

Unpickling calls whatever callables the stream names, so a pickle is code. This unpickler
resolves only the globals that such a file holds, found by disassembling real ones
(`pickletools.dis`) for every protocol 0-5:

- checkpoint-engine's models `MemoryBufferMetaList`, `MemoryBufferMetas`, `ParameterMeta`
  (pydantic instances: NEWOBJ + BUILD, which calls pydantic's own `__setstate__`);
- `torch.Size`, and torch dtypes, which pickle as the module attribute (`torch.bfloat16`);
- `copy_reg._reconstructor` and `__builtin__.object` (how protocols 0-1 rebuild an
  instance), `__builtin__.set` / `builtins.set` (pydantic's `__pydantic_fields_set__` in
  protocols 0-3), spelled exactly as those protocols write them.

Any other global (`os.system`, `builtins.eval`, `subprocess.Popen`, ...) stops the load
before it is called. Before that, every opcode is decoded without building anything, and
opcodes a metas pickle never holds (bytes, buffers, persistent ids, the extension registry)
are refused. What comes out is turned into plain data and checked by the same
validator as a JSON file, so a stream that builds odd objects from admitted classes is
refused too.

`is_metas_pickle` tells such a file from any other pickle by its opcodes alone, unpickling
nothing: ckptctl replaces a seed script's metas file with its own, never another pickle.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import pickletools
import warnings
from collections.abc import Iterator
from typing import Any

from ckptctl.checkpoint.headers import MAX_ELEMENTS
from ckptctl.errors import InvalidInput

# Opcodes no get_metas() pickle holds: raw bytes and out-of-band buffers, persistent ids, the
# copyreg extension registry, and protocol 0's class calls (INST, OBJ).
_REFUSED_OPCODES = frozenset(
    {
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "BYTEARRAY8",
        "NEXT_BUFFER",
        "READONLY_BUFFER",
        "PERSID",
        "BINPERSID",
        "EXT1",
        "EXT2",
        "EXT4",
        "INST",
        "OBJ",
    }
)

_MEMO_STORES = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_STRINGS = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
     "BINUNICODE8"}
)  # fmt: skip
_MEMO_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_METAS_MODULE = "checkpoint_engine.data_types"


class RefusedGlobal(pickle.UnpicklingError):
    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module = module
        self.name = name


def _admitted_globals() -> dict[tuple[str, str], Any]:
    import torch

    from ckptctl.ce.bare_import import engine_module

    engine_module("data_types")  # (entered bare: the import below skips the package's HTTP API)
    from checkpoint_engine.data_types import MemoryBufferMetaList, MemoryBufferMetas, ParameterMeta

    admitted: dict[tuple[str, str], Any] = {
        (_METAS_MODULE, cls.__name__): cls
        for cls in (MemoryBufferMetaList, MemoryBufferMetas, ParameterMeta)
    }
    admitted[("torch", "Size")] = torch.Size
    # vars(), not getattr(): torch's module __getattr__ imports submodules on demand.
    admitted.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    # Protocols 0-1 rebuild an instance with copyreg._reconstructor(cls, object, None), and
    # protocols 0-3 pickle a set (pydantic's fields-set) by calling set(); 0-2 use the
    # Python 2 module names.
    admitted[("copy_reg", "_reconstructor")] = copyreg._reconstructor  # type: ignore[attr-defined]
    admitted[("__builtin__", "object")] = object
    admitted[("__builtin__", "set")] = set
    admitted[("builtins", "set")] = set
    return admitted


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)
        self._admitted = _admitted_globals()

    def find_class(self, module: str, name: str) -> Any:
        # Looked up in a table of objects, never imported: a refused name runs nothing.
        try:
            return self._admitted[(module, name)]
        except KeyError:
            raise RefusedGlobal(module, name) from None


def load_legacy_pickle(data: bytes, *, source: str) -> dict[int, Any]:
    """Unpickle `data` with the allow-list; return plain data for `validate_metas`."""
    _scan(data, source)
    stream = io.BytesIO(data)
    try:
        obj = _RestrictedUnpickler(stream).load()
    except RefusedGlobal as exc:
        raise InvalidInput(
            f"{source}: refused to unpickle: it references {exc}, which no metas file holds; "
            "the file is not a checkpoint-engine metas pickle (it may be malicious)"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a malformed stream can fail in any admitted call
        raise InvalidInput(
            f"{source}: not a readable metas pickle ({type(exc).__name__}: {exc})"
        ) from None
    if stream.tell() != len(data):
        raise InvalidInput(f"{source}: unexpected data after the end of the pickle")
    if not isinstance(obj, dict) or any(type(k) is not int for k in obj):
        raise InvalidInput(f"{source}: not a metas pickle (expected a dict keyed by owner rank)")
    return _to_plain(obj, source)


def _scan(data: bytes, source: str) -> None:
    """Decode every opcode before unpickling (pickletools builds no objects).

    This refuses what a metas pickle never holds, and the fields that make the C unpickler
    allocate far more than the file holds: a length beyond the file, a memo index out of order.
    """
    stores = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # odd escapes in protocol-0 strings
        try:
            for opcode, arg, _pos in pickletools.genops(data):
                if opcode.name in _REFUSED_OPCODES:
                    raise InvalidInput(
                        f"{source}: refused to unpickle: it uses the {opcode.name} opcode, which "
                        "no metas file holds; the file is not a checkpoint-engine metas pickle"
                    )
                if opcode.name in _MEMO_STORES:
                    # A pickler numbers its memo 0, 1, 2, ...; the C unpickler sizes its memo
                    # array to the index, so one PUT of index 2**30 would allocate gigabytes.
                    if opcode.name != "MEMOIZE" and isinstance(arg, int) and arg > stores:
                        raise InvalidInput(f"{source}: not a metas pickle (memo index {arg})")
                    stores += 1
        except ValueError as exc:
            raise InvalidInput(f"{source}: not a readable metas pickle ({exc})") from None


def is_metas_pickle(data: bytes) -> bool:
    """Whether `data` is what the seed script's --save-metas-file writes (a pickle of
    checkpoint-engine's metas, any protocol), told from its opcodes alone: nothing is
    unpickled, nothing it names is imported or called. It opens a dict; every global it names
    is one this module's unpickler admits, one of them checkpoint-engine's metas classes; no
    opcode is one a metas pickle never holds; and the stream ends where `data` does. (ckptctl
    may then replace the file with a metas file of its own.)"""
    admitted = _admitted_globals()
    ours = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # odd escapes in protocol-0 strings
        try:
            opening = (op.name for op, _, _ in pickletools.genops(data))
            first = next((name for name in opening if name not in ("PROTO", "FRAME")), None)
            if first != "EMPTY_DICT" and (first, next(opening, None)) != ("MARK", "DICT"):
                return False  # (protocol 0 builds a dict with MARK, DICT)
            for named in _globals_named(data):
                if named not in admitted:
                    return False
                ours = ours or named[0] == _METAS_MODULE
        except ValueError:
            return False
    return ours


def _globals_named(data: bytes) -> Iterator[tuple[str, str] | None]:
    """The (module, name) of each global the pickle `data` names (GLOBAL, or STACK_GLOBAL with
    the two strings pushed before it, straight or from the memo), None for one whose names the
    opcodes do not tell; ValueError for a stream that is not one pickle or holds a refused
    opcode."""
    memo: dict[int, str | None] = {}
    pushed: list[str | None] = [None, None]  # the strings the last two opcodes pushed, if any
    for opcode, arg, pos in pickletools.genops(data):
        kind = opcode.name
        if kind in _REFUSED_OPCODES:
            raise ValueError(f"the {kind} opcode")
        if kind == "GLOBAL":
            module, _, name = str(arg).partition(" ")
            yield module, name
        elif kind == "STACK_GLOBAL":
            first, second = pushed
            yield (first, second) if first is not None and second is not None else None
        if kind in _MEMO_STORES:  # (stores what the opcode before pushed; pushes nothing)
            memo[arg if isinstance(arg, int) else len(memo)] = pushed[1]  # (MEMOIZE: the next)
            continue
        value = None
        if kind in _STRINGS:
            value = str(arg)
        elif kind in _MEMO_GETS and isinstance(arg, int):
            value = memo.get(arg)
        pushed = [pushed[1], value]
        if kind == "STOP" and pos != len(data) - 1:
            raise ValueError("data after the end of the pickle")


def _to_plain(obj: Any, source: str) -> Any:
    """Models → their field dicts, dtypes → "torch.x" strings, sizes → lists: JSON-able data.

    Dicts, lists and models may each appear once: get_metas() shares none, and refusing
    shared ones stops a small pickle from expanding into an exponential tree (or a cycle).
    """
    import torch
    from pydantic import BaseModel

    seen: set[int] = set()

    def walk(value: Any) -> Any:
        if type(value) is int and abs(value) > MAX_ELEMENTS:  # (ranks, addresses, sizes: int64)
            # Never printed: one of over 4300 digits cannot even be turned into text.
            raise InvalidInput(f"{source}: an integer beyond 64 bits; not a metas pickle")
        if value is None or type(value) in (str, int, bool):
            return value
        if isinstance(value, torch.dtype):
            return str(value)
        if type(value) is torch.Size:
            return [walk(d) for d in value]
        if isinstance(value, (BaseModel, dict, list)):
            if id(value) in seen:
                raise InvalidInput(f"{source}: shared or cyclic objects; not a metas pickle")
            seen.add(id(value))
            if isinstance(value, BaseModel):
                value = vars(value)
            if isinstance(value, list):
                return [walk(v) for v in value]
            if any(type(k) not in (str, int) for k in value):
                raise InvalidInput(f"{source}: a mapping with non-string keys; not a metas pickle")
            return {walk(k): walk(v) for k, v in value.items()}
        raise InvalidInput(
            f"{source}: unexpected {type(value).__name__} object; not a metas pickle"
        )

    try:
        return walk(obj)
    except RecursionError:
        raise InvalidInput(f"{source}: nested too deeply; not a metas pickle") from None

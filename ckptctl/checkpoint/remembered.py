"""What a serve job's next push would work out again: its headers, plan, layout and metas.

An RL loop pushes checkpoints of one model again and again, written the same way: each file's
header is byte for byte the last one's. `HeaderCache` hands the same TensorInfo objects back for
such a header (TensorInfo names its file relative to the checkpoint: nothing in it depends on
the directory), and `LastResult` then finds the plan, layout and metas made from them by
comparing the new input with the last call's - a pass of pointer checks where the objects are
the same ones. Results are shared between calls: nobody may change them (they are tuples,
NamedTuples and objects only ever read).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

R = TypeVar("R")

# A bound on what the header cache holds, whatever comes: the header bytes it is keyed by plus
# an estimate of the parsed tensors (a name, a shape and a NamedTuple each).
MAX_HEADERS = 4096
MAX_HEADER_BYTES = 256 << 20
TENSOR_BYTES = 512


class HeaderCache:
    """Parsed, validated headers by (file name, data section length, header bytes): the same
    bytes and length validate to the same tensors, so a hit is exact, never a guess.

    It keeps what the last two checkpoints read used (`read_checkpoint` counts each read as a
    generation: `next_generation`, then `forget_unused`), so a job whose headers change from
    push to push (a step number in their metadata) holds two checkpoints' worth at most; the
    tensors themselves are those the served checkpoint holds anyway."""

    def __init__(self, max_entries: int = MAX_HEADERS, max_bytes: int = MAX_HEADER_BYTES) -> None:
        # key -> (tensors, the generation that last used it)
        self._entries: OrderedDict[tuple[str, int, bytes], tuple[tuple[Any, ...], int]] = (
            OrderedDict()
        )
        self._bytes = 0
        self._max_entries, self._max_bytes = max_entries, max_bytes
        self._generation = 0
        self._lock = threading.Lock()

    @staticmethod
    def _cost(raw: bytes, tensors: tuple[Any, ...]) -> int:
        return len(raw) + TENSOR_BYTES * len(tensors)

    def get(self, file: str, data_len: int, raw: bytes) -> tuple[Any, ...] | None:
        key = (file, data_len, raw)
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                return None
            self._entries[key] = (found[0], self._generation)
            self._entries.move_to_end(key)
            return found[0]

    def put(self, file: str, data_len: int, raw: bytes, tensors: tuple[Any, ...]) -> None:
        cost = self._cost(raw, tensors)
        if cost > self._max_bytes:
            return
        key = (file, data_len, raw)
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = (tensors, self._generation)
            self._bytes += cost
            while len(self._entries) > self._max_entries or self._bytes > self._max_bytes:
                self._drop(next(iter(self._entries)))

    def next_generation(self) -> int:
        """A checkpoint's headers are about to be read: its own generation."""
        with self._lock:
            self._generation += 1
            return self._generation

    def forget_unused(self, generation: int) -> None:
        """After the read of `generation`: drop what neither it nor the read before it used."""
        with self._lock:
            for key in [k for k, (_, g) in self._entries.items() if g < generation - 1]:
                self._drop(key)

    def _drop(self, key: tuple[str, int, bytes]) -> None:
        tensors, _ = self._entries.pop(key)
        self._bytes -= self._cost(key[2], tensors)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


class LastResult(Generic[R]):
    """`make()`'s result for `key`, made again only when `key` differs from the last call's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: tuple[Hashable, R] | None = None

    def get(self, key: Any, make: Callable[[], R]) -> R:
        with self._lock:
            last = self._last
        if last is not None and last[0] == key:
            return last[1]
        value = make()
        with self._lock:
            self._last = (key, value)
        return value

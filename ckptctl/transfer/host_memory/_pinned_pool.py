"""Pinned host buffers kept from one push to the next, and the tensors over host memory."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from ckptctl.transfer.host_memory import _cuda_pinning as cuda
from ckptctl.transfer.host_memory._file_reads import anonymous_memory

if TYPE_CHECKING:
    import torch


def as_tensor(memory: Any, size: int) -> torch.Tensor:
    """A uint8 tensor over `memory` (zero copy; the tensor keeps the memory alive)."""
    import torch

    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(memory, dtype=torch.uint8, count=size)


def writable_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (a pooled buffer), without numpy."""
    n = tensor.numel()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


class PinnedPool:
    """Pinned host buffers kept from one push to the next (`serve --register-mode direct`):
    pinning and faulting in fresh pages is most of what registering costs once the files are
    cached. A buffer is handed out whole or as a prefix view."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []  # pinned, unused
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its whole buffer

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in [*self._free, *self._lent.values()])

    def take(self, size: int) -> tuple[torch.Tensor, bool]:
        """(buffer of `size` bytes, whether it is pinned already). The smallest free one that
        fits, else a new unpinned one that the ShareReader's thread pins."""
        fits = [b for b in self._free if b.numel() >= size]
        if fits:
            whole = min(fits, key=lambda b: b.numel())
            self._free.remove(whole)
            view, pinned = whole[:size], True
        else:
            whole = view = as_tensor(anonymous_memory(size), size)
            pinned = False
        self._lent[view.data_ptr()] = whole
        return view, pinned

    def trim(self) -> None:
        """Unpin and drop the free buffers (after a share took what it needed): what one
        checkpoint's buckets did not use would otherwise stay pinned for good."""
        for whole in self._free:
            cuda.unpin(whole)
        self._free.clear()

    def owns(self, buffers: list[Any]) -> bool:
        return bool(buffers) and all(b.buffer.data_ptr() in self._lent for b in buffers)

    def release(self, view: torch.Tensor, pinned: bool) -> None:
        """Take a lent buffer back: kept when pinned, else dropped (never kept unpinned)."""
        whole = self._lent.pop(view.data_ptr(), None)
        if whole is not None and pinned:
            self._free.append(whole)

    def give_back(self, buffers: list[Any]) -> None:
        """A registered checkpoint's MemoryBuffers (all pinned), for the next push."""
        for b in buffers:
            self.release(b.buffer, pinned=True)

    def close(self) -> None:
        """Unpin everything (at the end of the job)."""
        for whole in [*self._free, *self._lent.values()]:
            cuda.unpin(whole)
        self._free.clear()
        self._lent.clear()

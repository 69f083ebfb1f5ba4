"""Reading a rank's share straight into the host buffers checkpoint-engine sends from, instead
of its `register_checkpoint` copying every tensor into buffers of its own (the data twice): the
buckets, pinned in place, are handed over as it would have built them, metas and all (built
unvalidated, and for every rank from the shared plan: `planned_buffers`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ckptctl.checkpoint.headers import Checkpoint, TensorInfo
from ckptctl.checkpoint.remembered import LastResult
from ckptctl.errors import OperationFailed
from ckptctl.transfer.host_memory import _cuda_pinning as cuda
from ckptctl.transfer.host_memory import _file_reads as reads
from ckptctl.transfer.host_memory._pinned_pool import PinnedPool, as_tensor, writable_view

if TYPE_CHECKING:
    import torch


class MetaMaker:
    """checkpoint-engine ParameterMetas for a bucket's tensors, `==` to validated ones, with one
    torch dtype and one torch.Size object per distinct dtype and shape: equal shapes pickle as
    one memo reference in every bucket checkpoint-engine sends to the server."""

    def __init__(self) -> None:
        from ckptctl.ce.bare_import import engine_module
        from ckptctl.checkpoint.loader import torch_layout

        self._cls = engine_module("data_types").ParameterMeta
        self._layout = torch_layout
        self._known: dict[tuple[str, tuple[int, ...]], tuple[Any, Any]] = {}
        self._fields = frozenset(("name", "dtype", "shape", "aligned_size"))

    def __call__(self, bucket: reads.HostBucket) -> list[Any]:
        import torch

        new, set_slot = object.__new__, object.__setattr__
        cls, known, fields, align = self._cls, self._known, self._fields, reads.ALIGN
        out: list[Any] = []
        append = out.append
        for t, _ in bucket.placed:
            layout = known.get((t.dtype, t.shape))
            if layout is None:
                dtype, shape = self._layout(t)
                layout = known[(t.dtype, t.shape)] = (dtype, torch.Size(shape))
            meta = new(cls)
            size = (t.end - t.start + align - 1) // align * align
            state = {"name": t.name, "dtype": layout[0], "shape": layout[1], "aligned_size": size}
            set_slot(meta, "__dict__", state)
            set_slot(meta, "__pydantic_fields_set__", fields)
            set_slot(meta, "__pydantic_extra__", None)
            set_slot(meta, "__pydantic_private__", None)
            append(meta)
        return out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while 90k objects are made (none of them cyclic garbage): with
    torch imported, each collection walks its heap and doubles the time these loops take."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def planned_buffers(plan: Any) -> dict[int, list[tuple[int, list[Any]]]]:
    """Every rank's host buffers as its ShareReader lays them out - (size, metas) per bucket -
    from the plan that every rank shares (ParameterServerSession.gather_planned). The same for
    the same tensors (a serve job's next push: checkpoint/remembered.py); never changed."""
    ranks = [r for r in plan.ranks if r.tensors]

    def make_all() -> dict[int, list[tuple[int, list[Any]]]]:
        make = MetaMaker()
        with gc_paused():
            return {r.rank: [(b.size, make(b)) for b in reads.layout(r.tensors)] for r in ranks}

    key = (reads.MIN_BUCKET, tuple((r.rank, r.tensors) for r in ranks))
    return _LAST_PLANNED.get(key, make_all)


_LAST_PLANNED: LastResult[dict[int, list[tuple[int, list[Any]]]]] = LastResult()
_LAST_LAYOUT: LastResult[list[reads.HostBucket]] = LastResult()


class ShareReader:
    """Reads a share, then pins it, in the background (overlapping the ParameterServer's
    start); `progress` says how far the reading has got, `result` waits and hands the buffers
    over. Without a pool no torch is needed until the bytes are in and pinned (DriverPin): the
    buckets are anonymous memory, wrapped as tensors (zero copy) afterwards."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        tensors: list[TensorInfo] | tuple[TensorInfo, ...],
        threads: int | None = None,
        pool: PinnedPool | None = None,
        *,
        pin: bool,
        plan: Any = None,
        rank: int = 0,
        on_read: Callable[[int], None] | None = None,
        drop_page_cache: bool = False,
    ) -> None:
        """pin: once read (needs CUDA). plan, rank: the job's plan and this rank's place in it;
        then every rank's metas are worked out too (`gather_planned`). on_read(n): with every
        read's bytes (ReadProgress). drop_page_cache: of what was read, once it is in."""
        # (The same buckets for the same tensors: never changed, see checkpoint/remembered.py.)
        key = (reads.MIN_BUCKET, tuple(tensors))
        self.buckets = _LAST_LAYOUT.get(key, lambda: reads.layout(tensors))
        self._pool, self._pin, self._drop_page_cache = pool, pin, drop_page_cache
        self.threads = reads.read_threads(threads)
        self.progress = reads.ReadProgress(self.buckets, on_read)
        self._buffers: list[torch.Tensor] = []
        if pool is None:
            self._memory: list[Any] = [reads.anonymous_memory(b.size) for b in self.buckets]
            self._targets = [
                memoryview(m)[: b.size] for m, b in zip(self._memory, self.buckets, strict=True)
            ]
            self._pinned = [False] * len(self.buckets)
        else:
            taken = [pool.take(b.size) for b in self.buckets]
            self._buffers = [buffer for buffer, _ in taken]
            self._memory = []
            self._targets = [writable_view(buffer) for buffer in self._buffers]
            self._pinned = [pinned for _, pinned in taken]
            pool.trim()
        self._plan, self._rank = plan, rank
        self.planned: dict[int, list[tuple[int, list[Any]]]] | None = None
        self._metas: list[list[Any]] | None = None  # (`_make_metas`, on whichever thread first)
        self._metas_lock = threading.Lock()
        self.started_at = time.perf_counter()  # (--trace places the read from here)
        self.read_seconds: float | None = None
        self.pin_seconds: float | None = None
        self._driver: cuda.DriverPin | None = None  # when the buckets were pinned through it
        self._driver_pinned: list[int] = []
        self._gpu_rank = int(os.environ.get("RANK", "0"))  # (checkpoint-engine's GPU rule)
        self.pinned_before_torch = False  # ... and before `import torch` had finished
        # (a daemon thread: a rank that fails meanwhile exits without waiting for the read)
        self._thread = threading.Thread(
            target=self._run, args=(checkpoint,), name="ckptctl-read", daemon=True
        )
        self._thread.start()

    def _run(self, checkpoint: Checkpoint) -> None:
        try:
            self._read_and_pin(checkpoint)
        except BaseException as exc:  # noqa: BLE001 - raised by result(), on the caller's thread
            self.progress.fail(exc)  # kept there; a transfer waiting on the bytes hears of it

    def wait(self, timeout: float | None = None) -> bool:
        """Whether reading, pinning and the metas are done (within `timeout` seconds)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _read_and_pin(self, checkpoint: Checkpoint) -> None:
        reads.fill(
            checkpoint,
            self.buckets,
            self._targets,
            self.threads,
            # Populating fresh memory ahead of the read holds the mmap lock that `import
            # torch` needs; pages pinned right after are faulted in by the pin anyway.
            fresh=self._pool is None and not self._pin,
            progress=self.progress,
            drop_cache=self._drop_page_cache,
        )
        self._targets = []
        self.read_seconds = time.perf_counter() - self.started_at
        if self._pin and self._pool is None:
            self._pin_before_torch()
        # From here on torch (if the interpreter is still importing it, this waits for it).
        if not self._buffers:
            self._buffers = [
                as_tensor(m, b.size) for m, b in zip(self._memory, self.buckets, strict=True)
            ]
            self._memory = []  # the tensors keep the memory alive
        if self._driver is not None and not self._driver.is_torchs_gpu(self._gpu_rank):
            # Not the GPU torch gives this rank: pin again below, in the right context.
            stuck = self._unpin_by_driver()
            self._driver.release()
            for i in self._driver_pinned:
                self._pinned[i] = False
            self._driver, self._driver_pinned = None, []
            self.pinned_before_torch = False
            if stuck:  # (kept as they are: pinning them again would fail)
                raise OperationFailed(
                    "could not unpin host memory pinned in another GPU's context (see the "
                    "warning above)"
                )
        if self._pin:
            if any(b.size and not p for b, p in zip(self.buckets, self._pinned, strict=True)):
                cuda.use_this_ranks_gpu()
            for i, (bucket, buffer) in enumerate(zip(self.buckets, self._buffers, strict=True)):
                if bucket.size and not self._pinned[i]:
                    cuda.pin_in_place(buffer)
                    self._pinned[i] = True
            self.pin_seconds = time.perf_counter() - self.started_at - self.read_seconds
        self._make_metas()

    def _make_metas(self) -> list[list[Any]]:
        """The buckets' metas (and with a plan every rank's: `planned`), made once: by the
        reader after the read, or before it by `early_buffers` (they need no bytes)."""
        with self._metas_lock:
            if self._metas is not None:
                return self._metas
            if self._plan is not None:
                planned = planned_buffers(self._plan)
                if [size for size, _ in planned.get(self._rank, [])] != [
                    b.size for b in self.buckets
                ]:
                    raise OperationFailed("this rank's buffers are not the ones its plan lays out")
                self.planned = planned
                self._metas = [metas for _, metas in planned.get(self._rank, [])]
            else:
                make = MetaMaker()
                with gc_paused():
                    self._metas = [make(b) for b in self.buckets]
            return self._metas

    def _pin_before_torch(self) -> None:
        """Pin the fresh buckets through the CUDA driver, which needs no torch (DriverPin);
        where that cannot be done, they are pinned the usual way once torch is there."""
        todo = [i for i, b in enumerate(self.buckets) if b.size and not self._pinned[i]]
        if not todo:
            return
        driver = cuda.DriverPin.for_rank(self._gpu_rank)
        if driver is None:
            return
        self._driver = driver
        for i in todo:
            address = ctypes.addressof(ctypes.c_char.from_buffer(self._memory[i]))
            if not driver.pin(address, self.buckets[i].size):
                break  # (e.g. out of lockable memory: the runtime's error says it below)
            self._pinned[i] = True
            self._driver_pinned.append(i)
        self.pinned_before_torch = bool(self._driver_pinned) and not cuda.torch_is_imported()

    def _unpin_by_driver(self) -> bool:
        """Undo the driver's pins; any it would not undo are kept mapped (keep_registered), and
        no longer counted as this reader's. Returns whether some were."""
        assert self._driver is not None
        failed = [self._driver_pinned[j] for j in self._driver.unpin_all()]
        for i in failed:
            memory = self._buffers[i] if self._buffers else self._memory[i]
            cuda.keep_registered(memory, self.buckets[i].size, "cuMemHostUnregister failed")
        return bool(failed)

    @property
    def pinned_by_driver(self) -> bool:
        return bool(self._driver_pinned)

    def result(self) -> list[Any]:
        """checkpoint-engine MemoryBuffers (pinned in place when the reader was told to pin)."""
        self._thread.join()
        error = self.progress.error  # what reading or pinning raised (InvalidInput...)
        if error is not None:
            self._abandon()
            raise error
        return self._memory_buffers(self._make_metas())

    @property
    def pinned_ahead(self) -> bool:
        """Whether every buffer was pinned before this read (a pool's, from an earlier push):
        then they can be handed over while the read still fills them (`early_buffers`)."""
        return self._pool is not None and all(self._pinned)

    def early_buffers(self) -> list[Any]:
        """The MemoryBuffers now, while the read may still fill them (`pinned_ahead` only): a
        transfer copies out of them only what `progress` says is filled."""
        assert self.pinned_ahead
        return self._memory_buffers(self._make_metas())

    def raise_if_failed(self) -> None:
        """What the read raised, if it failed already (it may still be running)."""
        error = self.progress.error
        if error is not None:
            raise error

    def wait_read(self) -> None:
        """Wait until the reader has ended; raise what it raised."""
        self._thread.join()
        self.raise_if_failed()

    def _memory_buffers(self, metas: list[list[Any]]) -> list[Any]:
        from ckptctl.ce.bare_import import engine_module

        memory_buffer = engine_module("data_types").MemoryBuffer
        return [
            memory_buffer.model_construct(
                buffer=buffer, size=bucket.size, metas=m, manually_pinned=self._pin
            )
            for bucket, buffer, m in zip(self.buckets, self._buffers, metas, strict=True)
        ]

    def discard(self, timeout: float) -> bool:
        """Nobody will take these buffers (a staged read no push used): stop the read, then give
        the buffers back to the pool. False if the reader did not stop within `timeout`
        seconds: its buffers are kept from the pool then (it may still write into them)."""
        self.progress.stop()
        if not self.wait(timeout):
            return False
        self._abandon()
        return True

    def _abandon(self) -> None:
        """After a failed read or pin: pinned memory goes back to the pool or is unpinned, so
        that a failed push neither leaks it nor leaves an unpinned buffer in the pool."""
        if self._driver is not None and not self._buffers:  # failed before the tensors
            self._unpin_by_driver()
            return
        for buffer, pinned in zip(self._buffers, self._pinned, strict=False):
            if self._pool is not None:
                self._pool.release(buffer, pinned)
            elif pinned:
                cuda.unpin(buffer)

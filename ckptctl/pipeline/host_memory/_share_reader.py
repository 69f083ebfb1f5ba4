"""Reading a rank's share straight into the host buffers checkpoint-engine sends from.

checkpoint-engine's `register_checkpoint(named_tensors=...)` copies every tensor into pinned
buffers it allocates, from views of the file mapping: the rank holds the data twice while it
registers. Here each tensor is read straight into its place in a bucket that is then pinned in
place, and the buckets are handed over as `register_checkpoint` would have built them
(`MemoryBuffer(buffer, size, metas, manually_pinned=True)`, 256-byte aligned tensors), so that
gather, update and unregister work as before. Nothing is ever written to the files.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ckptctl.checkpoint.headers import Checkpoint, TensorInfo
from ckptctl.errors import OperationFailed
from ckptctl.pipeline.host_memory import _cuda_pinning as cuda
from ckptctl.pipeline.host_memory import _file_reads as reads
from ckptctl.pipeline.host_memory._bucket_metas import MetaMaker, gc_paused, planned_buffers
from ckptctl.pipeline.host_memory._pinned_pool import PinnedPool, as_tensor, writable_view

if TYPE_CHECKING:
    import torch


class ShareReader:
    """Reads a share in the background, then pins it there too: neither waits for the
    ParameterServer, so both overlap its start-up. `progress` (a ReadProgress) says how far the
    reading has got; `result` waits for everything and hands the buffers over.

    Without a pool it needs no torch until the bytes are in and pinned: the buckets are
    anonymous memory, pinned through the CUDA driver (DriverPin) and wrapped as tensors (zero
    copy) afterwards, so reading and pinning run while the interpreter still imports torch.
    """

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
        """pin: pin the buffers in place once read (needs CUDA; False for a CPU-only read).
        plan, rank: the job's plan and this rank's place in it: then every rank's metas are
        also worked out in the background, for `ParameterServerSession.gather_planned`.
        on_read(n): called with the bytes of every read, from the reading threads (progress).
        drop_page_cache: drop what was read from the page cache afterwards."""
        self.buckets = reads.layout(tensors)
        self._drop_page_cache = drop_page_cache
        self._pool = pool
        self._pin = pin
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
        self._metas: list[list[Any]] = []
        self._started = time.perf_counter()
        self.read_seconds: float | None = None
        self.pin_seconds: float | None = None
        self._error: BaseException | None = None
        self._driver: cuda.DriverPin | None = None  # when the buckets were pinned through it
        self._driver_pinned: list[int] = []
        self._gpu_rank = int(os.environ.get("RANK", "0"))  # (checkpoint-engine's GPU rule)
        self.pinned_before_torch = False  # ... and before `import torch` had finished
        # A daemon thread (not an executor's): a rank that fails meanwhile exits without
        # waiting for the read.
        self._thread = threading.Thread(
            target=self._run, args=(checkpoint,), name="ckptctl-read", daemon=True
        )
        self._thread.start()

    def _run(self, checkpoint: Checkpoint) -> None:
        try:
            self._read_and_pin(checkpoint)
        except BaseException as exc:  # noqa: BLE001 - raised by result(), on the caller's thread
            self._error = exc

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
        self.read_seconds = time.perf_counter() - self._started
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
            self.pin_seconds = time.perf_counter() - self._started - self.read_seconds
        if self._plan is not None:
            self.planned = planned_buffers(self._plan)
            self._metas = [metas for _, metas in self.planned.get(self._rank, [])]
            if [size for size, _ in self.planned.get(self._rank, [])] != [
                b.size for b in self.buckets
            ]:
                raise OperationFailed("this rank's buffers are not the ones its plan lays out")
        else:
            make = MetaMaker()
            with gc_paused():
                self._metas = [make(b) for b in self.buckets]

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
            if not driver.pin(reads.address_of(self._memory[i]), self.buckets[i].size):
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
        from ckptctl.pipeline.engine import engine_module

        memory_buffer = engine_module("data_types").MemoryBuffer
        self._thread.join()
        if self._error is not None:  # what reading or pinning raised (InvalidInput...)
            self._abandon()
            raise self._error
        return [
            memory_buffer.model_construct(
                buffer=buffer, size=bucket.size, metas=metas, manually_pinned=self._pin
            )
            for bucket, buffer, metas in zip(self.buckets, self._buffers, self._metas, strict=True)
        ]

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


def read_share(
    checkpoint: Checkpoint, tensors: list[TensorInfo], *, pin: bool, threads: int | None = None
) -> list[Any]:
    """The share as checkpoint-engine MemoryBuffers: read, then (on a GPU) pinned in place."""
    return ShareReader(checkpoint, tensors, threads, pin=pin).result()

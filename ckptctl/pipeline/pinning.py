"""Reading a rank's share straight into checkpoint-engine's host buffers ("direct" registration).

checkpoint-engine's own `register_checkpoint(named_tensors=...)` allocates pinned buffers and
copies every tensor into them from wherever the tensors live - for us, views of the file
mapping. Each rank then holds the data twice while it registers (the mapped page-cache pages
count in its RSS, and the pinned copy), and the copy runs at memcpy speed out of page faults.

Here each tensor is read with `pread` straight into its place in a buffer that is then pinned
in place with `cudaHostRegister`, and the buffers are handed to the ParameterServer in the shape
its `register_checkpoint` would have made (`MemoryBuffer(buffer, size, metas,
manually_pinned=True)`, 256-byte aligned tensors), so gather, update and unregister work as
before. Files are opened read-only; nothing is ever written to them.

The layout differs in one way: tensors are placed in file order (not name order), so that the
reads run through each file front to back. checkpoint-engine only needs each buffer's metas in
the order of their offsets.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptctl.checkpoint.headers import Checkpoint, TensorInfo, open_planned
from ckptctl.errors import InvalidInput, OperationFailed

if TYPE_CHECKING:
    import torch

ALIGN = 256  # checkpoint-engine's _ALIGN_SIZE
MIN_BUCKET = 4 << 30  # checkpoint-engine's pinned buckets: max(4 GiB, largest tensor)
READ_CHUNK = 64 << 20  # big tensors are read in pieces, so that threads share them


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


@dataclass
class HostBucket:
    """One host buffer: its tensors and where each one goes."""

    size: int = 0
    placed: list[tuple[TensorInfo, int]] = field(default_factory=list)  # (tensor, offset)


def layout(tensors: list[TensorInfo]) -> list[HostBucket]:
    """Tensors in file order, packed into buckets of max(4 GiB, largest tensor), 256-aligned."""
    if not tensors:
        return []
    limit = max(MIN_BUCKET, max(aligned(t.nbytes) for t in tensors))
    buckets = [HostBucket()]
    for t in sorted(tensors, key=lambda t: (t.file, t.start)):
        size = aligned(t.nbytes)
        if buckets[-1].placed and buckets[-1].size + size > limit:
            buckets.append(HostBucket())
        buckets[-1].placed.append((t, buckets[-1].size))
        buckets[-1].size += size
    return buckets


def _read_jobs(bucket: HostBucket) -> Iterator[tuple[TensorInfo, int, int, int]]:
    """(tensor, bytes already done, length, bucket offset) pieces of at most READ_CHUNK."""
    for t, offset in bucket.placed:
        done = 0
        while done < t.nbytes:
            n = min(READ_CHUNK, t.nbytes - done)
            yield t, done, n, offset + done
            done += n


def fill(
    checkpoint: Checkpoint,
    buckets: list[HostBucket],
    buffers: list[Any],
    threads: int,
    on_read: Callable[[int], None] | None = None,
) -> None:
    """pread every tensor into its place; buffers are uint8 CPU tensors (pinned or not).
    on_read(n) is called, from the reading threads, with the bytes of every read (progress)."""
    import numpy as np

    fds: dict[str, int] = {}
    try:
        for bucket in buckets:
            for t, _ in bucket.placed:
                if t.file not in fds:
                    # Still the file that was planned (else exit 3); a cut during the reads
                    # is caught below as a short read.
                    fds[t.file] = open_planned(checkpoint, t.file)
        # Writable byte views of the buffers: preadv fills them without an intermediate copy.
        views = [memoryview(np.asarray(b.numpy())) for b in buffers]  # type: ignore[arg-type]

        def read(job: tuple[int, TensorInfo, int, int, int]) -> None:
            i, t, done, n, at = job
            target = views[i][at : at + n]
            pos = t.start + done
            while len(target):
                got = os.preadv(fds[t.file], [target], pos)
                if got == 0:
                    raise InvalidInput(
                        f"{checkpoint.path_of(t.file)}: ends before tensor {t.name!r} does: the "
                        "file changed since it was planned; wait for the writer and rerun"
                    )
                target = target[got:]
                pos += got
                if on_read is not None:
                    on_read(got)

        jobs = [(i, *job) for i, b in enumerate(buckets) for job in _read_jobs(b)]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for _ in pool.map(read, jobs):
                pass
    except OSError as exc:
        raise InvalidInput(f"cannot read the checkpoint: {exc}") from None
    finally:
        for fd in fds.values():
            os.close(fd)


def metas_of(bucket: HostBucket) -> list[Any]:
    """checkpoint-engine's ParameterMeta list for a bucket, in offset order."""
    from checkpoint_engine.data_types import ParameterMeta

    from ckptctl.checkpoint.loader import torch_layout

    out = []
    for t, _ in bucket.placed:
        dtype, shape = torch_layout(t)
        out.append(
            ParameterMeta(name=t.name, dtype=dtype, shape=shape, aligned_size=aligned(t.nbytes))
        )
    return out


def pin_in_place(buffer: torch.Tensor) -> None:
    """cudaHostRegister, as checkpoint-engine's in-place pinning does (it unpins it the same way)."""
    import torch

    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if err != 0:
        raise OperationFailed(
            f"cannot pin {buffer.numel()} bytes of host memory (CUDA error {err})"
        )


def unpin(buffer: torch.Tensor) -> None:
    """cudaHostUnregister: undo `pin_in_place` (errors ignored: the process is leaving)."""
    import torch

    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class PinnedPool:
    """Pinned host buffers kept from one push to the next (`serve --register-mode direct`).

    Pinning gigabytes (cudaHostRegister) and faulting in fresh pages is most of what
    registering costs once the file pages are cached; a long-lived job pins its buffers once
    and reads each new checkpoint into them. A buffer is handed out whole or as a prefix view.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []  # pinned, unused
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its whole buffer

    @property
    def pinned_bytes(self) -> int:
        return sum(b.numel() for b in [*self._free, *self._lent.values()])

    def take(self, size: int) -> tuple[torch.Tensor, bool]:
        """(buffer of `size` bytes, whether it is pinned already). The smallest free one that
        fits, else a new unpinned one that the ShareReader's thread pins."""
        import torch

        fits = [b for b in self._free if b.numel() >= size]
        if fits:
            whole = min(fits, key=lambda b: b.numel())
            self._free.remove(whole)
            view, pinned = whole[:size], True
        else:
            whole = view = torch.empty(size, dtype=torch.uint8)
            pinned = False
        self._lent[view.data_ptr()] = whole
        return view, pinned

    def trim(self) -> None:
        """Unpin and drop the free buffers (after a share took what it needed): what one
        checkpoint's buckets did not use would otherwise stay pinned for good."""
        for whole in self._free:
            unpin(whole)
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
            unpin(whole)
        self._free.clear()
        self._lent.clear()


class ShareReader:
    """Reads a share in the background, then pins it there too: neither waits for the
    ParameterServer, so both overlap its start-up (CUDA context, store rendezvous). `result`
    waits for them and hands the buffers over."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        tensors: list[TensorInfo],
        threads: int = 16,
        pool: PinnedPool | None = None,
        *,
        pin: bool,
        on_read: Callable[[int], None] | None = None,
    ) -> None:
        """pin: pin the buffers in place once read (needs CUDA; False for a CPU-only read).
        on_read(n): called with the bytes of every read, from the reading threads (progress)."""
        import torch

        self.buckets = layout(tensors)
        self._pool = pool
        self._pin = pin
        self._on_read = on_read
        if pool is None:
            self._buffers = [torch.empty(b.size, dtype=torch.uint8) for b in self.buckets]
            self._pinned = [False] * len(self.buckets)
        else:
            taken = [pool.take(b.size) for b in self.buckets]
            self._buffers = [buffer for buffer, _ in taken]
            self._pinned = [pinned for _, pinned in taken]
            pool.trim()
        self._reading = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptctl-read")
        self._started = time.perf_counter()
        self.read_seconds: float | None = None
        self.pin_seconds: float | None = None
        self._future = self._reading.submit(self._read_and_pin, checkpoint, threads)

    def _read_and_pin(self, checkpoint: Checkpoint, threads: int) -> None:
        fill(checkpoint, self.buckets, self._buffers, threads, self._on_read)
        self.read_seconds = time.perf_counter() - self._started
        if not self._pin:
            return
        if any(b.size and not pinned for b, pinned in zip(self.buckets, self._pinned, strict=True)):
            _use_this_ranks_gpu()
        for i, (bucket, buffer) in enumerate(zip(self.buckets, self._buffers, strict=True)):
            if bucket.size and not self._pinned[i]:
                pin_in_place(buffer)
                self._pinned[i] = True
        self.pin_seconds = time.perf_counter() - self._started - self.read_seconds

    def result(self) -> list[Any]:
        """checkpoint-engine MemoryBuffers (pinned in place when the reader was told to pin)."""
        from checkpoint_engine.data_types import MemoryBuffer

        try:
            self._future.result()  # re-raises what reading or pinning raised (InvalidInput...)
            return [
                MemoryBuffer(
                    buffer=buffer,
                    size=bucket.size,
                    metas=metas_of(bucket),
                    manually_pinned=self._pin,
                )
                for bucket, buffer in zip(self.buckets, self._buffers, strict=True)
            ]
        except BaseException:
            self._reading.shutdown(wait=True)  # first: the thread may still be pinning
            self._abandon()
            raise
        finally:
            self._reading.shutdown(wait=True)

    def _abandon(self) -> None:
        """After a failed read or pin: pinned memory goes back to the pool or is unpinned, so
        that a failed push neither leaks it nor leaves an unpinned buffer in the pool."""
        for buffer, pinned in zip(self._buffers, self._pinned, strict=True):
            if self._pool is not None:
                self._pool.release(buffer, pinned)
            elif pinned:
                unpin(buffer)


def _use_this_ranks_gpu() -> None:
    """Make this thread's current device the rank's GPU (it is per thread), when there is one,
    so that pinning here uses the same CUDA context as the ParameterServer."""
    import torch

    if torch.cuda.is_available():
        from ckptctl.pipeline.process_group import local_device_index

        torch.cuda.set_device(local_device_index(int(os.environ.get("RANK", "0"))))


def read_share(
    checkpoint: Checkpoint, tensors: list[TensorInfo], *, pin: bool, threads: int = 16
) -> list[Any]:
    """The share as checkpoint-engine MemoryBuffers: read, then (on a GPU) pinned in place."""
    return ShareReader(checkpoint, tensors, threads, pin=pin).result()

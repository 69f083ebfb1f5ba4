"""Reading a share's tensors from its files (read-only) into host buckets, in file order and
256-byte aligned: neighbours are one `os.preadv`, big tensors are read in pieces that threads
share, and no thread holds the GIL for long (the rank's `import torch` runs meanwhile).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from ckptctl.checkpoint.headers import Checkpoint, TensorInfo, open_planned
from ckptctl.errors import CkptctlError, InvalidInput
from ckptctl.observe import timeline

ALIGN = 256  # checkpoint-engine's _ALIGN_SIZE
MIN_BUCKET = 4 << 30  # checkpoint-engine's pinned buckets: max(4 GiB, largest tensor)
READ_CHUNK = 64 << 20  # one read request at most: big tensors are read in pieces, threads share
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers per preadv
MAX_READ_THREADS = 16  # where page-cache reads stop scaling (bench/README.md)


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def read_threads(requested: int | None = None) -> int:
    """Reader threads for one rank: its cores (shared with the node's other ranks unless the
    launcher gave each its own), at most MAX_READ_THREADS; `requested` (--read-threads) wins."""
    if requested:
        return requested
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    if cores >= (os.cpu_count() or cores):  # every core of the machine: shared by the node's ranks
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        cores //= max(int(local), 1) if local.isdigit() else 1
    return max(1, min(MAX_READ_THREADS, cores))


@dataclass
class HostBucket:
    """One host buffer: its tensors and where each one goes."""

    size: int = 0
    placed: list[tuple[TensorInfo, int]] = field(default_factory=list)  # (tensor, offset)


def layout(tensors: list[TensorInfo] | tuple[TensorInfo, ...]) -> list[HostBucket]:
    """Tensors in file order, packed into buckets of max(4 GiB, largest tensor), 256-aligned."""
    if not tensors:
        return []
    ordered = sorted(tensors, key=attrgetter("file", "start"))  # (a plan's are in order already)
    sizes = [(t.end - t.start + ALIGN - 1) // ALIGN * ALIGN for t in ordered]  # aligned(), inline
    limit = max(MIN_BUCKET, max(sizes))
    buckets = [HostBucket()]
    bucket = buckets[0]
    for t, size in zip(ordered, sizes, strict=True):
        if bucket.placed and bucket.size + size > limit:
            bucket = HostBucket()
            buckets.append(bucket)
        bucket.placed.append((t, bucket.size))
        bucket.size += size
    return buckets


@dataclass
class ReadRun:
    """One preadv: neighbouring bytes of one file into their places in one bucket, the 256-byte
    padding between tensors skipped by giving each its own buffer (no copy, no extra read)."""

    bucket: int
    file: str
    pos: int  # file offset of the first byte
    pieces: list[tuple[int, int]]  # (offset in the bucket, length), in file order
    nbytes: int = 0
    tensors: int = 1  # the tensors whose last byte this run reads


def read_runs(buckets: list[HostBucket]) -> list[ReadRun]:
    """The reads that fill `buckets`: neighbours in a file and a bucket coalesce into one of at
    most READ_CHUNK bytes and IOV_MAX buffers; a larger tensor is read in READ_CHUNK pieces."""
    runs: list[ReadRun] = []
    run: ReadRun | None = None
    for b, bucket in enumerate(buckets):
        for t, offset in bucket.placed:
            n = t.end - t.start
            if not n:
                continue
            if n > READ_CHUNK:
                for done in range(0, n, READ_CHUNK):
                    piece = min(READ_CHUNK, n - done)
                    at, last = t.start + done, int(done + piece == n)
                    runs.append(ReadRun(b, t.file, at, [(offset + done, piece)], piece, last))
                run = None
                continue
            if (
                run is not None
                and run.bucket == b
                and run.file == t.file
                and run.pos + run.nbytes == t.start
                and run.nbytes + n <= READ_CHUNK
                and len(run.pieces) < IOV_MAX
            ):
                last_at, last_n = run.pieces[-1]
                if last_at + last_n == offset:  # no padding in between: one buffer
                    run.pieces[-1] = (last_at, last_n + n)
                else:
                    run.pieces.append((offset, n))
                run.nbytes += n
                run.tensors += 1
                continue
            run = ReadRun(b, t.file, t.start, [(offset, n)], n)
            runs.append(run)
    return runs


class ReadStopped(CkptctlError):
    """The push ended: the reader stops filling its buffers (`ReadProgress.stop`)."""


class ReadProgress:
    """How far the reading of some buckets has got, for any thread while it runs: `bytes_read`
    of `total_bytes`, `tensors_read` of `total_tensors` (a tensor counts once its last byte is
    in), `done` once all is in (never after a failure). `on_read(n)` gets each read's bytes.

    Also how far each bucket is filled (`filled`, `wait`), for a transfer that copies a bucket
    out while later runs are still being read: its runs finish out of order across the
    reader's threads, so a bucket is filled up to its first run not read yet (the padding
    between tensors, which nobody writes, counts as filled)."""

    def __init__(
        self, buckets: list[HostBucket], on_read: Callable[[int], None] | None = None
    ) -> None:
        tensors = [t for b in buckets for t, _ in b.placed]
        self.total_bytes = sum(t.end - t.start for t in tensors)
        self.total_tensors = len(tensors)
        self.bytes_read = 0
        self.tensors_read = sum(t.end == t.start for t in tensors)
        self.done = threading.Event()
        self.error: BaseException | None = None  # what the reader raised (`fail`)
        self._on_read = on_read
        self._sizes = [b.size for b in buckets]
        self._begun = False
        self._begun_at = 0.0
        self._starts: list[list[int]] = []  # per bucket: where each of its runs starts
        self._read: list[list[bool]] = []
        self._next: list[int] = []  # per bucket: its first run not read yet
        self._where: dict[int, tuple[int, int]] = {}  # id(run) -> (bucket, its index there)
        self._stopped = False
        self._cond = threading.Condition()

    def begin(self, runs: list[ReadRun]) -> None:
        """The runs that will be read (fill, in the reader's thread)."""
        starts: list[list[int]] = [[] for _ in self._sizes]
        where = {}
        for run in runs:
            where[id(run)] = (run.bucket, len(starts[run.bucket]))
            starts[run.bucket].append(run.pieces[0][0])
        with self._cond:
            self._starts, self._where = starts, where
            self._read = [[False] * len(s) for s in starts]
            self._next = [0] * len(starts)
            self._begun = True
            self._begun_at = time.perf_counter()
            self._cond.notify_all()

    def add(self, run: ReadRun) -> None:
        """`run`'s bytes are in; ReadStopped once the reading was stopped."""
        with self._cond:
            if self._stopped:
                raise ReadStopped("the push ended: reading stopped")
            self.bytes_read += run.nbytes
            self.tensors_read += run.tensors
            if self._begun:
                b, k = self._where[id(run)]
                read, n = self._read[b], self._next[b]
                read[k] = True
                while n < len(read) and read[n]:
                    n += 1
                self._next[b] = n
                self._cond.notify_all()
                if n == len(read):  # (--trace) this buffer is full
                    size = self._sizes[b]
                    timeline.record(f"buffer {b}", timeline.BUFFERS, self._begun_at, bytes=size)
        if self._on_read is not None:
            self._on_read(run.nbytes)

    def fail(self, exc: BaseException) -> None:
        """The reader failed: whoever waits hears of it."""
        with self._cond:
            if self.error is None:
                self.error = exc
            self._cond.notify_all()

    def stop(self) -> None:
        """The reader's threads stop after the runs they are reading (a push that failed)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def filled(self, bucket: int) -> int:
        """Bytes of `bucket`, from its start, that hold what they should."""
        with self._cond:
            if not self._begun:
                return 0
            n, starts = self._next[bucket], self._starts[bucket]
            return starts[n] if n < len(starts) else self._sizes[bucket]

    def wait(self, bucket: int, end: int, timeout: float) -> bool:
        """Whether `bucket` is filled up to `end` within `timeout` seconds; raises what the
        reader raised."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.error is not None:
                    raise self.error
                if self.filled(bucket) >= end:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)


def fill(
    checkpoint: Checkpoint,
    buckets: list[HostBucket],
    targets: list[memoryview],
    threads: int,
    runs: list[ReadRun] | None = None,
    *,
    fresh: bool = False,
    progress: ReadProgress | None = None,
    drop_cache: bool = False,
) -> None:
    """Read every tensor into its place in `targets` (writable views of the buckets), with
    `threads` threads taking the runs in file order, which is bucket order, front to back: the
    order in which checkpoint-engine copies the buckets out (`_gen_h2d_buckets`), so a copy
    that waits on `progress` rarely waits for more than the runs in flight. `fresh`: the targets are untouched memory,
    populated run by run (`_Populate`). `drop_cache`: see `_OpenFiles`."""
    runs = read_runs(buckets) if runs is None else runs
    if progress is not None:
        progress.begin(runs)
    populate = _Populate(targets) if fresh else None
    files = _OpenFiles(checkpoint, runs, drop_cache=drop_cache)
    try:
        taken = itertools.count()  # next() is atomic: each run is read by exactly one thread
        failed: list[BaseException] = []

        def work() -> None:
            try:
                for i in iter(taken.__next__, None):
                    if i >= len(runs) or failed:
                        return
                    run = runs[i]
                    target = targets[run.bucket]
                    if populate is not None:
                        populate(run)
                    fd = files.acquire(run.file)
                    try:
                        _read_run(fd, [target[a : a + n] for a, n in run.pieces], run.pos)
                    finally:
                        files.release(run.file)
                    if progress is not None:
                        progress.add(run)
            except _Truncated as exc:
                failed.append(_ends_early(checkpoint, buckets, runs[i], exc.pos))
            except BaseException as exc:  # noqa: BLE001 - raised on the calling thread below
                failed.append(exc)

        workers = [
            threading.Thread(target=work, name=f"ckptctl-read-{k}", daemon=True)
            for k in range(max(1, min(threads, len(runs))))
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if failed:
            raise failed[0]
        if progress is not None:
            progress.done.set()
    except OSError as exc:
        raise InvalidInput(f"cannot read the checkpoint: {exc}") from None
    finally:
        files.close()


class _OpenFiles:
    """The shards' fds, each open from its first run to its last: about one per reader thread
    at a time (thousands of shards opened at once would run out of file descriptors).

    drop_cache: before a file is closed, posix_fadvise(DONTNEED) over the span this rank read
    (in the buffers now, it would take the node's memory twice); only advice (tmpfs keeps)."""

    def __init__(self, checkpoint: Checkpoint, runs: list[ReadRun], drop_cache: bool) -> None:
        self._checkpoint = checkpoint
        self._left: dict[str, int] = {}
        self._spans: dict[str, tuple[int, int]] = {}
        for run in runs:
            self._left[run.file] = self._left.get(run.file, 0) + 1
            lo, hi = self._spans.get(run.file, (run.pos, run.pos + run.nbytes))
            self._spans[run.file] = (min(lo, run.pos), max(hi, run.pos + run.nbytes))
        self._drop_cache = drop_cache
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, file: str) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                # Still the file that was planned (else exit 3); a cut later is a short read.
                fd = self._fds[file] = open_planned(self._checkpoint, file)
            return fd

    def release(self, file: str) -> None:
        with self._lock:
            self._left[file] -= 1
            if self._left[file] == 0:
                fd = self._fds.pop(file)
                if self._drop_cache:
                    lo, hi = self._spans[file]
                    with contextlib.suppress(OSError):  # (a filesystem without it)
                        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in as if written, in one call
PAGE = mmap.PAGESIZE


class _Populate:
    """Fault in a run's destination before it is read into, with madvise(MADV_POPULATE_WRITE)
    through ctypes (no GIL held while the pages are zeroed): one call per run instead of a
    page fault per 4 KB inside the copy. A kernel without the call (EINVAL) just skips it."""

    def __init__(self, targets: list[memoryview]) -> None:
        self._bases = [
            ctypes.addressof(ctypes.c_char.from_buffer(t)) if len(t) else 0 for t in targets
        ]
        self._madvise: Any = None
        if hasattr(os, "sched_getaffinity"):  # Linux
            with contextlib.suppress(AttributeError, OSError):
                madvise = ctypes.CDLL(None, use_errno=True).madvise
                madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                madvise.restype = ctypes.c_int
                self._madvise = madvise

    def __call__(self, run: ReadRun) -> None:
        if self._madvise is None:
            return
        first, (last, n) = run.pieces[0][0], run.pieces[-1]
        start = (self._bases[run.bucket] + first) // PAGE * PAGE
        if self._madvise(start, self._bases[run.bucket] + last + n - start, MADV_POPULATE_WRITE):
            self._madvise = None  # not this kernel: the copy faults the pages in as before


class _Truncated(Exception):
    def __init__(self, pos: int) -> None:
        self.pos = pos


def _read_run(fd: int, buffers: list[memoryview], pos: int) -> None:
    while buffers:
        got = os.preadv(fd, buffers, pos)
        if got == 0:
            raise _Truncated(pos)
        pos += got
        while buffers and got >= len(buffers[0]):  # (a short read: rare, only at the end)
            got -= len(buffers[0])
            buffers.pop(0)
        if got:
            buffers[0] = buffers[0][got:]


def _ends_early(checkpoint: Checkpoint, buckets: list[HostBucket], run: ReadRun, pos: int) -> Any:
    name = next(
        (t.name for t, _ in buckets[run.bucket].placed if t.file == run.file and t.end > pos),
        "?",
    )
    return InvalidInput(
        f"{checkpoint.path_of(run.file)}: ends before tensor {name!r} does: the "
        "file changed since it was planned; wait for the writer and rerun"
    )


def anonymous_memory(size: int) -> Any:
    """Fresh, private, zero-filled host memory for a bucket (no torch needed): an anonymous
    mapping, on the system's default pages (huge pages were slower to fill)."""
    if size <= 0:
        return bytearray(0)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

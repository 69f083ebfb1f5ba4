"""Reading a rank's share straight into checkpoint-engine's host buffers ("direct" registration).

checkpoint-engine's own `register_checkpoint(named_tensors=...)` allocates pinned buffers and
copies every tensor into them from wherever the tensors live - for us, views of the file
mapping. Each rank then holds the data twice while it registers (the mapped page-cache pages
count in its RSS, and the pinned copy), and the copy runs at memcpy speed out of page faults.

Here each tensor is read straight into its place in a buffer that is then pinned in place with
`cudaHostRegister`, and the buffers are handed to the ParameterServer in the shape its
`register_checkpoint` would have made (`MemoryBuffer(buffer, size, metas,
manually_pinned=True)`, 256-byte aligned tensors), so gather, update and unregister work as
before. Files are opened read-only; nothing is ever written to them.

The reading is built for the machine's limit (34 GB/s from the page cache with 16 threads on
the H200 node, one thread 5.4) and for 90k-tensor checkpoints: neighbouring tensors are one
`os.preadv` (`read_runs`: a buffer per tensor skips the padding), several threads take the
runs into fresh anonymous memory faulted in run by run, and nothing per tensor holds the GIL
longer than a slice, so the rank's main thread (the ParameterServer's start, `import torch`)
runs meanwhile. No torch is needed until the bytes are in.

The layout differs in one way: tensors are placed in file order (not name order), so that the
reads run through each file front to back. checkpoint-engine only needs each buffer's metas in
the order of their offsets.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from ckptctl.checkpoint.headers import Checkpoint, TensorInfo, open_planned
from ckptctl.errors import InvalidInput, OperationFailed, print_error

if TYPE_CHECKING:
    import torch

ALIGN = 256  # checkpoint-engine's _ALIGN_SIZE
MIN_BUCKET = 4 << 30  # checkpoint-engine's pinned buckets: max(4 GiB, largest tensor)
READ_CHUNK = 64 << 20  # one read request at most: big tensors are read in pieces, threads share
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers per preadv
# Page-cache reads scale to about 16 threads on the H200 machine (34 GB/s; one thread 5.4).
MAX_READ_THREADS = 16


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def read_threads(requested: int | None = None) -> int:
    """Reader threads for one rank: the cores this process may use, shared with the other ranks
    on the node (LOCAL_WORLD_SIZE) unless the launcher already gave each rank its own cores, at
    most MAX_READ_THREADS; `requested` (--read-threads) wins."""
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


def read_runs(buckets: list[HostBucket]) -> list[ReadRun]:
    """The reads that fill `buckets`: tensors that follow each other in a file and in a bucket
    coalesce into one request of at most READ_CHUNK bytes and IOV_MAX buffers; a larger tensor
    is read in READ_CHUNK pieces, so that several threads share it."""
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
                    runs.append(ReadRun(b, t.file, t.start + done, [(offset + done, piece)], piece))
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
                continue
            run = ReadRun(b, t.file, t.start, [(offset, n)], n)
            runs.append(run)
    return runs


def fill(
    checkpoint: Checkpoint,
    buckets: list[HostBucket],
    targets: list[memoryview],
    threads: int,
    runs: list[ReadRun] | None = None,
    *,
    fresh: bool = False,
    on_read: Callable[[int], None] | None = None,
    drop_cache: bool = False,
) -> None:
    """Read every tensor into its place; `targets` are writable byte views of the buckets.

    `threads` threads take the runs in file order. os.preadv releases the GIL for the copy,
    and per run the Python work is a few slices, so the reading leaves the interpreter to the
    rest of the rank (the ParameterServer's start, `import torch`). `fresh`: the targets are
    untouched anonymous memory, populated run by run just before it is read into (see
    `_populate`). `drop_cache`: drop what was read of each file from the page cache once its
    last run is in (`_OpenFiles`).
    """
    runs = read_runs(buckets) if runs is None else runs
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
                    if on_read is not None:
                        on_read(run.nbytes)
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
    except OSError as exc:
        raise InvalidInput(f"cannot read the checkpoint: {exc}") from None
    finally:
        files.close()


class _OpenFiles:
    """The shards' fds, each opened when its first run is read and closed after its last: the
    runs go in file order, so about one file per reader thread is open at a time (a checkpoint
    of thousands of shards opened all at once ran out of file descriptors).

    drop_cache: before a file is closed, posix_fadvise(DONTNEED) over the span of it that the
    runs read: those bytes are in the buffers now, and kept in the page cache too they would
    take the node's memory twice. Only this rank's span: another rank of the node may still be
    reading its own. Advice, not a guarantee: a filesystem that keeps its pages (tmpfs) keeps
    them."""

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
                # Still the file that was planned (else exit 3); a cut during the reads is
                # caught as a short read.
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
    page fault per 4 KB inside the copy (on the 2-core VM the read into fresh memory went from
    a median 0.88 to 1.0 GB/s). A kernel without the call (EINVAL) just skips it.
    """

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
    mapping, on the pages the system gives by default. (Huge pages, asked for with
    MADV_HUGEPAGE, were 2-4x slower to fill on the 2-core VM, where the host backs the
    guest's memory on first touch.)"""
    if size <= 0:
        return bytearray(0)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


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


class MetaMaker:
    """checkpoint-engine ParameterMetas, 90k of them in about 0.1 s.

    Validated construction costs ~10 us each; these are built as pydantic's `model_construct`
    builds them (the same object, `==` to a validated one) with one torch dtype and one
    torch.Size object per distinct dtype and shape: equal shapes pickle as one memo reference
    in every bucket checkpoint-engine sends to the server.
    """

    def __init__(self) -> None:
        from ckptctl.checkpoint.loader import torch_layout
        from ckptctl.pipeline.ce_import import engine_module

        self._cls = engine_module("data_types").ParameterMeta
        self._layout = torch_layout
        self._known: dict[tuple[str, tuple[int, ...]], tuple[Any, Any]] = {}
        self._fields = frozenset(("name", "dtype", "shape", "aligned_size"))

    def __call__(self, bucket: HostBucket) -> list[Any]:
        import torch

        new, set_slot = object.__new__, object.__setattr__
        cls, known, fields, align = self._cls, self._known, self._fields, ALIGN
        out: list[Any] = []
        append = out.append
        for t, _ in bucket.placed:
            layout = known.get((t.dtype, t.shape))
            if layout is None:
                dtype, shape = self._layout(t)
                layout = known[(t.dtype, t.shape)] = (dtype, torch.Size(shape))
            meta = new(cls)
            set_slot(
                meta,
                "__dict__",
                {
                    "name": t.name,
                    "dtype": layout[0],
                    "shape": layout[1],
                    "aligned_size": (t.end - t.start + align - 1) // align * align,
                },
            )
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
    computed from the plan that every rank shares: what checkpoint-engine's gather_metas would
    otherwise pickle through all_gather_object (parameter_server.gather_planned)."""
    make = MetaMaker()
    with gc_paused():
        return {
            r.rank: [(b.size, make(b)) for b in layout(r.tensors)] for r in plan.ranks if r.tensors
        }


def pin_in_place(buffer: torch.Tensor) -> None:
    """cudaHostRegister, as checkpoint-engine's in-place pinning does (it unpins it the same way).

    Called through ctypes, which lets go of the GIL for the call: torch's binding
    (torch.cuda.cudart()) holds it, and pinning gigabytes takes long enough to stall the
    rank's main thread (the ParameterServer's start). The symbol is looked up in the process,
    where torch's CUDA runtime is loaded globally (checkpoint-engine unpins the same way); the
    flags are 0, which checkpoint-engine's unpinning checks for.
    """
    import torch

    register = _runtime_function("cudaHostRegister")
    if register is not None:
        err = register(buffer.data_ptr(), buffer.numel(), 0)
    else:
        err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    if err != 0:
        raise OperationFailed(
            f"cannot pin {buffer.numel()} bytes of host memory (CUDA error {err})"
        )


_runtime: dict[str, Any] = {}


def _runtime_function(name: str) -> Any:
    """A CUDA runtime function from the process's global symbols (ctypes releases the GIL
    while it runs), or None when there is none (no CUDA loaded: the caller falls back)."""
    if name not in _runtime:
        try:
            function = getattr(ctypes.CDLL(None), name)
        except (AttributeError, OSError):
            return None
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        _runtime[name] = function
    return _runtime[name]


class DriverPin:
    """Pinning before torch is imported, through the CUDA driver (libcuda) with ctypes.

    On the H200 machine `import torch` takes 3-5 s, and the share is read long before it ends;
    the CUDA context (0.2-0.3 s) and the pinning (0.4 s for 8 GB) then used to follow it on
    the rank's critical path. The driver needs no torch: the reading thread makes the rank's
    GPU's primary context current - the very context the CUDA runtime (torch,
    checkpoint-engine, NCCL) takes up later - and registers the buffers with flags 0, as
    `pin_in_place` does, so that checkpoint-engine's unpinning finds what it expects.

    `for_rank` returns None where there is no driver or no GPU: the caller pins the usual way
    once torch is there. `is_torchs_gpu` checks afterwards that the driver's device is the one
    torch gives the rank (same ordinal, same PCI address); if not, the caller unpins and
    `release`s the context here (it would hold memory on another rank's GPU) and pins again.
    """

    _SUCCESS = 0
    _PCI_BUS_ID, _PCI_DEVICE_ID, _PCI_DOMAIN_ID = 33, 34, 50  # CUdevice_attribute

    def __init__(self, lib: Any, register: Any, release: Any, device: int, ordinal: int) -> None:
        self._lib = lib
        self._register = register
        self._release = release
        self.device = device
        self.ordinal = ordinal
        self.pinned: list[int] = []  # the addresses pinned here, in order

    @classmethod
    def for_rank(cls, rank: int) -> DriverPin | None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        try:
            c_int = ctypes.c_int
            if lib.cuInit(0) != cls._SUCCESS:
                return None
            count = c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != cls._SUCCESS or count.value < 1:
                return None
            ordinal = rank % count.value  # checkpoint-engine's rule (local_device_index)
            device = c_int(0)
            if lib.cuDeviceGet(ctypes.byref(device), ordinal) != cls._SUCCESS:
                return None
            release = getattr(lib, "cuDevicePrimaryCtxRelease_v2", None)
            release = release or lib.cuDevicePrimaryCtxRelease
            release.argtypes = [c_int]
            context = ctypes.c_void_p()
            if lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) != cls._SUCCESS:
                return None
            if lib.cuCtxSetCurrent(context) != cls._SUCCESS:  # (this thread only)
                release(device)
                return None
            register = getattr(lib, "cuMemHostRegister_v2", None) or lib.cuMemHostRegister
            register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            register.restype = c_int
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        except AttributeError:  # a driver without one of these calls
            return None
        return cls(lib, register, release, device.value, ordinal)

    def pin(self, address: int, size: int) -> bool:
        """cuMemHostRegister with flags 0 (checkpoint-engine's unpinning reads them back)."""
        if not size or self._register(address, size, 0) != self._SUCCESS:
            return False
        self.pinned.append(address)
        return True

    def unpin_all(self) -> list[int]:
        """Undo every `pin`; returns the positions (in `pinned`) of those the driver would not
        unpin: that memory is still registered and must stay mapped (keep_registered)."""
        failed = [
            i
            for i, address in enumerate(self.pinned)
            if self._lib.cuMemHostUnregister(address) != self._SUCCESS
        ]
        self.pinned = []
        return failed

    def release(self) -> None:
        """Drop this thread's hold on the device's primary context (after `unpin_all`)."""
        self._lib.cuCtxSetCurrent(None)
        self._release(self.device)

    def pci_address(self) -> tuple[int, int, int]:
        values = []
        for attribute in (self._PCI_DOMAIN_ID, self._PCI_BUS_ID, self._PCI_DEVICE_ID):
            value = ctypes.c_int(-1)
            self._lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, self.device)
            values.append(value.value)
        return values[0], values[1], values[2]

    def is_torchs_gpu(self, rank: int) -> bool:
        """Whether torch gives `rank` this device: the same ordinal by torch's count (which
        may come from NVML) and the same PCI address. Any error says no."""
        import torch

        from ckptctl.pipeline.process_group import local_device_index

        try:
            index = local_device_index(rank)
            props = torch.cuda.get_device_properties(index)
        except (RuntimeError, AssertionError, ZeroDivisionError):
            return False
        names = ("pci_domain_id", "pci_bus_id", "pci_device_id")  # (torch >= 2.4 has them)
        pci = tuple(getattr(props, n, None) for n in names)
        return index == self.ordinal and pci == self.pci_address()


def torch_is_imported() -> bool:
    """Whether `import torch` has finished (a module being imported is in sys.modules already,
    its spec marked as initializing)."""
    module = sys.modules.get("torch")
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


def import_torch() -> float | None:
    """Import torch; the seconds that took (or that waiting for another thread's import took),
    None where it had been imported already."""
    if torch_is_imported():
        return None
    started = time.perf_counter()
    import torch  # noqa: F401

    return time.perf_counter() - started


def address_of(memory: Any) -> int:
    """Where a writable buffer (an anonymous mapping) starts."""
    view = ctypes.c_char.from_buffer(memory)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # (lets the mapping be closed later)


# Host memory that could not be unpinned. CUDA still has it registered, so it is never
# unmapped: pages the system could hand out again while the driver holds them, and a range a
# later registration would collide with. Kept for the life of the process.
kept_registered: list[Any] = []


def keep_registered(memory: Any, nbytes: int, why: str) -> None:
    """Keep `memory` mapped for good, and say so (a failed unpin is a leak, not a crash)."""
    kept_registered.append(memory)
    print_error(
        f"could not unpin {nbytes} bytes of host memory ({why}): keeping them mapped and "
        "pinned until the process ends",
        label="warning",
    )


def _unregister(address: int) -> int:
    """cudaHostUnregister through torch's binding: the CUDA error code (0: done)."""
    import torch

    return int(torch.cuda.cudart().cudaHostUnregister(address))


def unpin(buffer: torch.Tensor) -> bool:
    """cudaHostUnregister: undo `pin_in_place`. Where that fails the buffer is kept
    (keep_registered), never freed while still registered; returns whether it was unpinned."""
    err = _unregister(buffer.data_ptr())
    if err != 0:
        keep_registered(buffer, buffer.numel(), f"cudaHostUnregister: CUDA error {err}")
    return err == 0


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
    waits for them and hands the buffers over.

    Without a pool it needs no torch until the bytes are in and pinned: the buckets are
    anonymous memory, pinned in place through the CUDA driver (DriverPin) and wrapped as
    tensors (zero copy) afterwards, so reading and pinning run while the interpreter still
    imports torch (stages.EarlyShare).
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
        drop_page_cache: drop what was read from the page cache afterwards (`_OpenFiles`)."""
        self.buckets = layout(tensors)
        self._drop_page_cache = drop_page_cache
        self._pool = pool
        self._pin = pin
        self._on_read = on_read
        self.threads = read_threads(threads)
        self._buffers: list[torch.Tensor] = []
        if pool is None:
            self._memory: list[Any] = [anonymous_memory(b.size) for b in self.buckets]
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
        self._driver: DriverPin | None = None  # when the buckets were pinned through it
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
        fill(
            checkpoint,
            self.buckets,
            self._targets,
            self.threads,
            # Populating fresh memory ahead of the read holds the mmap lock that `import
            # torch` needs; when the pages are pinned right after, the pin faults them in
            # anyway (bench/results/import-overlap-qwen3-8b.md).
            fresh=self._pool is None and not self._pin,
            on_read=self._on_read,
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
                _use_this_ranks_gpu()
            for i, (bucket, buffer) in enumerate(zip(self.buckets, self._buffers, strict=True)):
                if bucket.size and not self._pinned[i]:
                    pin_in_place(buffer)
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
        driver = DriverPin.for_rank(self._gpu_rank)
        if driver is None:
            return
        self._driver = driver
        for i in todo:
            if not driver.pin(address_of(self._memory[i]), self.buckets[i].size):
                break  # (e.g. out of lockable memory: the runtime's error says it below)
            self._pinned[i] = True
            self._driver_pinned.append(i)
        self.pinned_before_torch = bool(self._driver_pinned) and not torch_is_imported()

    def _unpin_by_driver(self) -> bool:
        """Undo the driver's pins; any it would not undo are kept mapped (keep_registered), and
        no longer counted as this reader's. Returns whether some were."""
        assert self._driver is not None
        failed = [self._driver_pinned[j] for j in self._driver.unpin_all()]
        for i in failed:
            memory = self._buffers[i] if self._buffers else self._memory[i]
            keep_registered(memory, self.buckets[i].size, "cuMemHostUnregister failed")
        return bool(failed)

    @property
    def pinned_by_driver(self) -> bool:
        return bool(self._driver_pinned)

    def result(self) -> list[Any]:
        """checkpoint-engine MemoryBuffers (pinned in place when the reader was told to pin)."""
        from ckptctl.pipeline.ce_import import engine_module

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
                unpin(buffer)


def _use_this_ranks_gpu() -> None:
    """Make this thread's current device the rank's GPU (it is per thread), when there is one,
    so that pinning here uses the same CUDA context as the ParameterServer."""
    import torch

    if torch.cuda.is_available():
        from ckptctl.pipeline.process_group import local_device_index

        torch.cuda.set_device(local_device_index(int(os.environ.get("RANK", "0"))))


def read_share(
    checkpoint: Checkpoint, tensors: list[TensorInfo], *, pin: bool, threads: int | None = None
) -> list[Any]:
    """The share as checkpoint-engine MemoryBuffers: read, then (on a GPU) pinned in place."""
    return ShareReader(checkpoint, tensors, threads, pin=pin).result()

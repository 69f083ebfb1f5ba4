"""Direct registration (transfer/host_memory) on CPU: the layout checkpoint-engine expects and
every byte read into place, for every dtype; pinning itself needs CUDA (GPU tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_factory import mixed_shards, write_real_checkpoint
from safetensors.torch import load_file

from ckptctl.checkpoint import plan_split, read_checkpoint
from ckptctl.transfer import host_memory
from ckptctl.transfer.host_memory import _cuda_pinning as cuda
from ckptctl.transfer.host_memory import _file_reads as reads


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    first, second = mixed_shards(seed=11)
    big = {f"big.{i}": torch.randn(300, 1000).to(torch.bfloat16) for i in range(3)}
    return write_real_checkpoint(tmp_path_factory.mktemp("ck"), [first | big, second])


def read_share(checkpoint: Any, tensors: Any, *, pin: bool, threads: int | None = None) -> Any:
    """A share as checkpoint-engine MemoryBuffers, read (and pinned) by a ShareReader."""
    return host_memory.ShareReader(checkpoint, tensors, threads, pin=pin).result()


def test_layout_is_aligned_contiguous_and_in_file_order(ckpt: Path) -> None:
    checkpoint = read_checkpoint(ckpt)
    (bucket,) = reads.layout(list(checkpoint.tensors))
    offsets = [off for _, off in bucket.placed]
    assert all(off % 256 == 0 for off in offsets)
    for (t, off), (_, nxt) in zip(bucket.placed, bucket.placed[1:], strict=False):
        assert nxt == off + reads.aligned(t.nbytes)  # what checkpoint-engine's offsets assume
    assert bucket.size == offsets[-1] + reads.aligned(bucket.placed[-1][0].nbytes)
    keys = [(t.file, t.start) for t, _ in bucket.placed]
    assert keys == sorted(keys)


def test_buckets_split_at_the_limit(monkeypatch: pytest.MonkeyPatch, ckpt: Path) -> None:
    monkeypatch.setattr(reads, "MIN_BUCKET", 700_000)  # ~ a 600 kB tensor + change
    checkpoint = read_checkpoint(ckpt)
    buckets = reads.layout(list(checkpoint.tensors))
    assert len(buckets) >= 3
    assert all(b.size <= 700_000 for b in buckets)
    assert sorted(t.name for b in buckets for t, _ in b.placed) == sorted(
        t.name for t in checkpoint.tensors
    )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_byte_lands_in_place_for_every_dtype(ckpt: Path, world: int) -> None:
    checkpoint = read_checkpoint(ckpt)
    expected: dict[str, torch.Tensor] = {}
    for f in checkpoint.files:
        expected |= load_file(str(ckpt / f))
    seen = set()
    for rank in plan_split(checkpoint, world, "tensors").ranks:
        for buf in read_share(checkpoint, list(rank.tensors), pin=False, threads=4):
            assert buf.buffer.numel() == buf.size and not buf.manually_pinned
            offset = 0
            for meta in buf.metas:
                want = expected[meta.name]
                assert meta.dtype == want.dtype and tuple(meta.shape) == tuple(want.shape)
                n = want.numel() * want.element_size()
                got = buf.buffer[offset : offset + n]
                assert torch.equal(got, want.reshape(-1).view(torch.uint8)), meta.name
                offset += meta.aligned_size
                seen.add(meta.name)
    assert seen == set(expected)


def test_big_tensors_are_read_in_pieces_by_several_threads(
    monkeypatch: pytest.MonkeyPatch, ckpt: Path
) -> None:
    monkeypatch.setattr(reads, "READ_CHUNK", 4096)
    checkpoint = read_checkpoint(ckpt)
    (buf,) = read_share(checkpoint, list(checkpoint.tensors), pin=False, threads=8)
    big = load_file(str(ckpt / checkpoint.files[0]))["big.1"]
    start = 0
    for meta in buf.metas:
        if meta.name == "big.1":
            break
        start += meta.aligned_size
    assert torch.equal(buf.buffer[start : start + big.numel() * 2], big.view(-1).view(torch.uint8))


def test_a_file_that_shrank_since_planning_is_invalid_input(tmp_path: Path, ckpt: Path) -> None:
    import shutil

    copy = tmp_path / "ck"
    shutil.copytree(ckpt, copy)
    checkpoint = read_checkpoint(copy)
    victim = copy / checkpoint.files[0]
    with open(victim, "r+b") as fh:
        fh.truncate(victim.stat().st_size - 1000)
    from ckptctl.errors import InvalidInput

    with pytest.raises(InvalidInput, match="changed since the checkpoint was planned"):
        read_share(checkpoint, list(checkpoint.tensors), pin=False)


def test_peak_rss_is_one_copy(tmp_path: Path) -> None:
    """Reading 256 MiB adds about 256 MiB of RSS in a fresh process: no mapping of the file
    whose pages would count too (the engine path's views do), no staging copy."""
    root = write_real_checkpoint(
        tmp_path / "ck",
        [{f"t{i}": torch.full((32 << 20,), i, dtype=torch.uint8) for i in range(8)}],
    )
    code = f"""
import os, torch
from ckptctl.checkpoint import read_checkpoint
from ckptctl.transfer.host_memory import ShareReader
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
ck = read_checkpoint({str(root)!r})
before = rss()
bufs = ShareReader(ck, ck.tensors, pin=False).result()
print(rss() - before)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    grew = int(r.stdout.strip().splitlines()[-1])
    assert (256 << 20) * 0.9 < grew < (256 << 20) * 1.25, f"RSS grew by {grew / 2**20:.0f} MiB"


def _share_of(root: Path, seed: int) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tensors = {f"w.{i}": torch.randn(256, 300, generator=g).to(torch.bfloat16) for i in range(4)}
    tensors["norm"] = torch.randn(300, generator=g)
    return write_real_checkpoint(root, [tensors]), tensors


def _check_bytes(buffers: list, expected: dict[str, torch.Tensor]) -> None:  # type: ignore[type-arg]
    for buf in buffers:
        offset = 0
        for meta in buf.metas:
            want = expected[meta.name]
            n = want.numel() * want.element_size()
            got = buf.buffer[offset : offset + n]
            assert torch.equal(got, want.reshape(-1).view(torch.uint8)), meta.name
            offset += meta.aligned_size


def test_a_pool_refills_the_same_buffers_with_the_next_checkpoint(tmp_path: Path) -> None:
    """serve --register-mode direct: the second checkpoint is read into the first one's
    buffers (no new allocation, so no new pinning), every byte its own."""
    pool = host_memory.PinnedPool()
    first, _ = _share_of(tmp_path / "a", seed=1)
    second, want = _share_of(tmp_path / "b", seed=2)
    a = read_checkpoint(first)
    buffers = host_memory.ShareReader(a, list(a.tensors), pool=pool, pin=False).result()
    ptrs = sorted(b.buffer.data_ptr() for b in buffers)
    pool.give_back(buffers)
    assert pool.pinned_bytes == sum(b.size for b in buffers)

    b = read_checkpoint(second)
    again = host_memory.ShareReader(b, list(b.tensors), pool=pool, pin=False)
    refilled = again.result()
    assert sorted(x.buffer.data_ptr() for x in refilled) == ptrs  # the same memory
    _check_bytes(refilled, want)
    assert pool.pinned_bytes == sum(b.size for b in buffers)  # nothing new was allocated


def test_a_failed_read_gives_the_pools_memory_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A push whose file changed under it: the pinned buffer goes back to the pool for the
    next push, the new (unpinned) one is dropped rather than kept as if pinned."""
    unpinned: list[int] = []
    monkeypatch.setattr(cuda, "unpin", lambda b: unpinned.append(b.numel()))  # no CUDA here
    pool = host_memory.PinnedPool()
    first, _ = _share_of(tmp_path / "a", seed=1)
    a = read_checkpoint(first)
    pool.give_back(host_memory.ShareReader(a, list(a.tensors), pool=pool, pin=False).result())
    pinned_before = pool.pinned_bytes

    second, _ = _share_of(tmp_path / "b", seed=2)
    b = read_checkpoint(second)
    big = {"w.big": torch.zeros(4096, 4096, dtype=torch.bfloat16)}  # too big for the free one
    third = write_real_checkpoint(tmp_path / "c", [big])
    c = read_checkpoint(third)
    for f in c.files:  # the writer is still at it: shorter than its header says
        path = c.path_of(f)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    reader = host_memory.ShareReader(c, list(c.tensors), pool=pool, pin=False)
    with pytest.raises(Exception, match="changed since the checkpoint was planned"):
        reader.result()
    assert pool.pinned_bytes == 0  # the small pinned one was trimmed as surplus, the new dropped
    assert unpinned == [pinned_before]  # ... and the trimmed one unpinned
    again = host_memory.ShareReader(b, list(b.tensors), pool=pool, pin=False).result()
    assert pool.pinned_bytes == sum(x.size for x in again) <= pinned_before


def test_a_failed_read_keeps_a_pooled_buffer_pinned_for_the_next_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda, "unpin", lambda b: None)  # no CUDA here
    pool = host_memory.PinnedPool()
    first, _ = _share_of(tmp_path / "a", seed=1)
    a = read_checkpoint(first)
    taken = host_memory.ShareReader(a, list(a.tensors), pool=pool, pin=False).result()
    ptrs = sorted(x.buffer.data_ptr() for x in taken)
    pool.give_back(taken)

    broken, _ = _share_of(tmp_path / "b", seed=2)  # same shapes, then cut short
    b = read_checkpoint(broken)
    for f in b.files:
        path = b.path_of(f)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(Exception, match="changed since the checkpoint was planned"):
        host_memory.ShareReader(b, list(b.tensors), pool=pool, pin=False).result()
    assert pool.pinned_bytes == sum(x.size for x in taken)  # back in the pool, still pinned
    again = host_memory.ShareReader(a, list(a.tensors), pool=pool, pin=False).result()
    assert sorted(x.buffer.data_ptr() for x in again) == ptrs


def test_pinning_happens_in_the_reading_thread_before_anyone_asks(
    monkeypatch: pytest.MonkeyPatch, ckpt: Path
) -> None:
    """The share is pinned where it is read, while the ParameterServer starts: by the time the
    register stage asks for it, every bucket is pinned (here: pinning recorded, no CUDA)."""
    import threading

    monkeypatch.setattr(reads, "MIN_BUCKET", 700_000)
    pinned_by: list[tuple[str, int]] = []
    monkeypatch.setattr(
        cuda,
        "pin_in_place",
        lambda b: pinned_by.append((threading.current_thread().name, b.numel())),
    )
    checkpoint = read_checkpoint(ckpt)
    reader = host_memory.ShareReader(checkpoint, list(checkpoint.tensors), pin=True)
    assert reader.wait(60)  # done on its own, before result() is called
    assert [size for _, size in pinned_by] == [b.size for b in reader.buckets]
    assert all(name.startswith("ckptctl-read") for name, _ in pinned_by)
    assert reader.pin_seconds is not None
    buffers = reader.result()
    assert len(buffers) == len(reader.buckets) >= 3
    assert all(b.manually_pinned for b in buffers)
    assert len(pinned_by) == len(reader.buckets)  # result() pinned nothing again


def test_a_failed_pin_unpins_what_was_pinned_and_says_so(
    monkeypatch: pytest.MonkeyPatch, ckpt: Path
) -> None:
    from ckptctl.errors import OperationFailed

    monkeypatch.setattr(reads, "MIN_BUCKET", 700_000)
    pinned: list[int] = []
    unpinned: list[int] = []

    def pin(buffer: torch.Tensor) -> None:
        if len(pinned) == 2:
            raise OperationFailed(
                f"cannot pin {buffer.numel()} bytes of host memory (CUDA error 2)"
            )
        pinned.append(buffer.data_ptr())

    monkeypatch.setattr(cuda, "pin_in_place", pin)
    monkeypatch.setattr(cuda, "unpin", lambda b: unpinned.append(b.data_ptr()))
    checkpoint = read_checkpoint(ckpt)
    reader = host_memory.ShareReader(checkpoint, list(checkpoint.tensors), pin=True)
    with pytest.raises(OperationFailed, match="cannot pin"):
        reader.result()
    assert sorted(unpinned) == sorted(pinned) and len(pinned) == 2


def test_the_reading_thread_pins_on_this_ranks_gpu(
    monkeypatch: pytest.MonkeyPatch, ckpt: Path
) -> None:
    """The current CUDA device is per thread: the reading thread must select the rank's GPU
    (checkpoint-engine's rule, rank modulo the visible GPUs) before it pins, or every rank
    would pin through GPU 0's context. Recorded here with CUDA stood in."""
    import threading

    chosen: list[tuple[str, int]] = []
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda i: chosen.append((threading.current_thread().name, i))
    )
    pinned_in: list[str] = []
    monkeypatch.setattr(
        cuda, "pin_in_place", lambda b: pinned_in.append(threading.current_thread().name)
    )
    checkpoint = read_checkpoint(ckpt)
    host_memory.ShareReader(checkpoint, list(checkpoint.tensors), pin=True).result()
    assert [index for _, index in chosen] == [1]  # rank 3 of 2 GPUs per node: GPU 1
    assert chosen[0][0] == pinned_in[0] and pinned_in[0].startswith("ckptctl-read")


def _many_small(root: Path, count: int = 300) -> Path:
    """Small tensors of odd sizes in two files: padding between every two in the buffers."""
    g = torch.Generator().manual_seed(7)
    shards = [
        {
            f"s{k}.t{i}": torch.randint(0, 255, (37 + i % 11,), generator=g, dtype=torch.uint8)
            for i in range(count)
        }  # fmt: skip
        for k in range(2)
    ]
    return write_real_checkpoint(root, shards)


def test_neighbours_are_read_in_one_request_skipping_the_padding(tmp_path: Path) -> None:
    checkpoint = read_checkpoint(_many_small(tmp_path / "ck"))
    buckets = reads.layout(checkpoint.tensors)
    runs = reads.read_runs(buckets)
    assert len(runs) == 2  # one per file: 600 tensors, two preadv calls
    assert [len(r.pieces) for r in runs] == [300, 300]  # each tensor its buffer: no copy
    expected = {}
    for f in checkpoint.files:
        expected |= load_file(str(checkpoint.path_of(f)))
    _check_bytes(read_share(checkpoint, list(checkpoint.tensors), pin=False), expected)


@pytest.mark.parametrize(("iov_max", "chunk"), [(7, 1 << 20), (1024, 300), (3, 100)])
def test_requests_are_bounded_by_iov_max_and_the_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, iov_max: int, chunk: int
) -> None:
    monkeypatch.setattr(reads, "IOV_MAX", iov_max)
    monkeypatch.setattr(reads, "READ_CHUNK", chunk)
    checkpoint = read_checkpoint(_many_small(tmp_path / "ck", count=50))
    runs = reads.read_runs(reads.layout(checkpoint.tensors))
    assert all(len(r.pieces) <= iov_max and r.nbytes <= chunk for r in runs)
    assert sum(r.nbytes for r in runs) == checkpoint.total_bytes
    expected = {}
    for f in checkpoint.files:
        expected |= load_file(str(checkpoint.path_of(f)))
    for threads in (1, 3):
        buffers = read_share(checkpoint, list(checkpoint.tensors), pin=False, threads=threads)
        _check_bytes(buffers, expected)


def test_a_tensors_split_of_many_small_tensors_reads_runs(tmp_path: Path) -> None:
    """90k small tensors split by tensors: each rank reads a few long runs, not one request
    per tensor (plan.py cuts contiguous runs when they balance)."""
    checkpoint = read_checkpoint(_many_small(tmp_path / "ck", count=1000))
    plan = plan_split(checkpoint, 3, "tensors")
    assert plan.max_rank_bytes <= plan.lower_bound_bytes * 1.005
    for share in plan.ranks:
        runs = reads.read_runs(reads.layout(share.tensors))
        assert len(runs) <= 2, len(runs)


@pytest.mark.parametrize("chunk", [20, 1 << 20])
def test_the_progress_counts_every_byte_and_tensor_once_it_is_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """ReadProgress: a tensor read in pieces (chunk 20) counts once its last piece is in, and
    neighbours read together (a large chunk) count one each."""
    monkeypatch.setattr(reads, "READ_CHUNK", chunk)
    checkpoint = read_checkpoint(_many_small(tmp_path / "ck", count=30))
    reads_seen: list[int] = []
    reader = host_memory.ShareReader(
        checkpoint, checkpoint.tensors, pin=False, on_read=reads_seen.append
    )
    progress = reader.progress
    assert (progress.total_bytes, progress.total_tensors) == (checkpoint.total_bytes, 60)
    reader.result()
    assert progress.done.is_set() and sum(reads_seen) == progress.bytes_read
    assert (progress.bytes_read, progress.tensors_read) == (checkpoint.total_bytes, 60)
    assert (len(reads_seen) > 60) == (chunk == 20)  # pieces, or runs of many tensors


@pytest.mark.parametrize(
    ("affinity", "cpus", "local", "want"),
    [
        (32, 32, "2", 16),  # the 2x H200 machine: 16 each
        (16, 16, "2", 8),
        (128, 128, "8", 16),
        (2, 2, "1", 2),  # this machine
        (2, 2, "4", 1),
        (4, 32, "2", 4),  # the launcher gave each rank 4 cores of its own: all 4
        (64, 64, "", 16),  # no LOCAL_WORLD_SIZE: one rank
    ],
)
def test_reader_threads_follow_the_cores_and_the_local_ranks(
    monkeypatch: pytest.MonkeyPatch, affinity: int, cpus: int, local: str, want: int
) -> None:
    monkeypatch.setattr(reads.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(reads.os, "cpu_count", lambda: cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert reads.read_threads() == want
    assert reads.read_threads(5) == 5  # --read-threads wins


def test_reading_needs_no_torch(tmp_path: Path) -> None:
    """Planning and reading run before torch is imported (stages.EarlyShare): the buckets
    are anonymous memory, filled with preadv, torch only wraps them afterwards."""
    root = _many_small(tmp_path / "ck", count=20)
    code = f"""
import sys
from ckptctl.checkpoint import plan_split, read_checkpoint
from ckptctl.transfer.host_memory import _file_reads as reads
ck = read_checkpoint({str(root)!r})
share = plan_split(ck, 2, "auto").ranks[0]
buckets = reads.layout(share.tensors)
memory = [reads.anonymous_memory(b.size) for b in buckets]
reads.fill(ck, buckets, [memoryview(m)[: b.size] for m, b in zip(memory, buckets)], 2)
assert "torch" not in sys.modules, "torch was imported"
t, off = buckets[0].placed[0]
with open(ck.path_of(t.file), "rb") as fh:
    fh.seek(t.start)
    assert bytes(memory[0][off : off + t.nbytes]) == fh.read(t.nbytes)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_fresh_memory_is_populated_run_by_run_and_a_kernel_without_it_is_skipped(
    tmp_path: Path,
) -> None:
    """Each run's destination is faulted in with one call before it is read into
    (MADV_POPULATE_WRITE), not a page at a time inside the copy. Where madvise refuses it, the
    read goes on without."""
    checkpoint = read_checkpoint(_many_small(tmp_path / "ck", count=200))
    buckets = reads.layout(checkpoint.tensors)
    runs = reads.read_runs(buckets)
    memory = [reads.anonymous_memory(b.size) for b in buckets]
    targets = [memoryview(m)[: b.size] for m, b in zip(memory, buckets, strict=True)]
    populate = reads._Populate(targets)
    calls: list[tuple[int, int, int]] = []
    real = populate._madvise
    populate._madvise = lambda start, size, advice: (
        calls.append((start, size, advice)) or (real(start, size, advice) if real else 0)
    )
    populate(runs[0])
    (start, size, advice), first, (last, n) = calls[0], runs[0].pieces[0][0], runs[0].pieces[-1]
    base = populate._bases[runs[0].bucket]
    assert advice == reads.MADV_POPULATE_WRITE and start % reads.PAGE == 0
    assert start <= base + first and start + size == base + last + n
    populate._madvise = lambda *args: -1  # EINVAL: a kernel before 5.14
    populate(runs[1])
    assert populate._madvise is None
    reads.fill(checkpoint, buckets, targets, 2, fresh=True)  # and the bytes are right
    expected = {}
    for f in checkpoint.files:
        expected |= load_file(str(checkpoint.path_of(f)))
    for t, off in buckets[0].placed:
        want = expected[t.name].reshape(-1).view(torch.uint8)
        assert bytes(memory[0][off : off + t.nbytes]) == bytes(want.numpy()), t.name


def test_the_first_import_of_torch_is_timed_once() -> None:
    """A one-process job's first `import torch` falls in its start stage, which says so
    (stages.start_parameter_server): timed where torch was not imported yet, None after."""
    code = (
        "from ckptctl.transfer.host_memory._cuda_pinning import import_torch, torch_is_imported\n"
        "before = torch_is_imported()\n"
        "first, second = import_torch(), import_torch()\n"
        "print(before, first is not None and first > 0, second, torch_is_imported())\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "True", "None", "True"]


def test_torch_being_imported_is_not_imported_yet(tmp_path: Path) -> None:
    """The "before torch" label (and the start stage's timing) hang on this: a torch whose
    import is under way - in sys.modules already - is not imported yet."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "from ckptctl.transfer.host_memory._cuda_pinning import torch_is_imported\nDURING = torch_is_imported()\n"
    )
    code = (
        "from ckptctl.transfer.host_memory._cuda_pinning import torch_is_imported\n"
        "import torch\n"
        "print(torch.DURING, torch_is_imported())\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("fails", [False, True])
def test_a_failed_unpin_is_logged_and_its_buffer_kept_mapped(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fails: bool,
) -> None:
    """Issue 23 item 6: memory CUDA still has registered must never be unmapped. A pool's
    buffer whose cudaHostUnregister fails (made to fail here: no CUDA) is logged and kept
    alive; one that was unpinned is freed as before."""
    import gc
    import weakref

    monkeypatch.setattr(cuda, "_unregister", lambda address: 1 if fails else 0)
    monkeypatch.setattr(cuda, "kept_registered", [])
    pool = host_memory.PinnedPool()
    a = read_checkpoint(_share_of(tmp_path / "a", seed=1)[0])
    buffers = host_memory.ShareReader(a, list(a.tensors), pool=pool, pin=False).result()
    pool.give_back(buffers)
    size, alive = pool.pinned_bytes, [weakref.ref(b.buffer) for b in buffers]
    del buffers
    pool.close()
    gc.collect()
    err = capsys.readouterr().err
    if fails:
        assert f"warning: could not unpin {size} bytes of host memory" in err
        assert "CUDA error 1" in err and "keeping them mapped" in err
        assert all(ref() is not None for ref in alive)  # still mapped
        assert [t.numel() for t in cuda.kept_registered] == [size]
    else:
        assert err == "" and cuda.kept_registered == []
        assert all(ref() is None for ref in alive)  # freed


class _Driver:
    """What DriverPin calls in libcuda, on CPU: pins are recorded, and unregistering the
    addresses in `stuck` fails (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, 713)."""

    def __init__(self) -> None:
        self.stuck: set[int] = set()
        self.unregistered: list[int] = []

    def cuMemHostUnregister(self, address: int) -> int:  # noqa: N802 - libcuda's name
        self.unregistered.append(address)
        return 713 if address in self.stuck else 0

    def cuCtxSetCurrent(self, context: object) -> int:  # noqa: N802 - libcuda's name
        return 0


def test_memory_the_driver_would_not_unpin_stays_mapped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], ckpt: Path
) -> None:
    """Pinned through the driver, then found not to be torch's GPU (always, on CPU): the
    buckets are unpinned to be pinned again. One the driver would not unpin is kept (logged),
    the read fails rather than pin it twice, and no bucket is unpinned twice."""
    from ckptctl.errors import OperationFailed

    monkeypatch.setattr(reads, "MIN_BUCKET", 700_000)
    monkeypatch.setattr(cuda, "kept_registered", [])
    lib = _Driver()
    pinned: list[int] = []

    def register(address: int, size: int, flags: int) -> int:
        pinned.append(address)
        lib.stuck = {pinned[0]}
        return 0

    driver = cuda.DriverPin(lib, register, lambda device: 0, 0, 0)
    monkeypatch.setattr(cuda.DriverPin, "for_rank", classmethod(lambda cls, rank: driver))
    monkeypatch.setattr(cuda, "pin_in_place", lambda b: pytest.fail("pinned again"))
    monkeypatch.setattr(cuda, "unpin", lambda b: pytest.fail("unpinned again"))
    checkpoint = read_checkpoint(ckpt)
    reader = host_memory.ShareReader(checkpoint, list(checkpoint.tensors), pin=True)
    with pytest.raises(OperationFailed, match="could not unpin host memory"):
        reader.result()
    assert len(pinned) >= 3 and sorted(lib.unregistered) == sorted(pinned)
    assert [t.data_ptr() for t in cuda.kept_registered] == [pinned[0]]  # as a tensor
    assert "warning: could not unpin" in capsys.readouterr().err

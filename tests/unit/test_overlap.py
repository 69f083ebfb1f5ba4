"""A read overlapping the transfer, on CPU, in parts: how far the reader has filled each buffer
(host_memory.ReadProgress), and the gate's refusal of a checkpoint-engine whose bucket copy it
does not know (ce_internals.wrap_bucket_copy). The whole push, bytes and failures included, is
in tests/serve/test_serve_overlap.py."""

from __future__ import annotations

import inspect
import random
import threading
from pathlib import Path

import pytest
import torch
from ckpt_factory import write_real_checkpoint

from ckptctl.ce import internals as ce_internals
from ckptctl.checkpoint import read_checkpoint
from ckptctl.errors import InvalidInput, OperationFailed
from ckptctl.transfer.host_memory import ReadProgress
from ckptctl.transfer.host_memory import _file_reads as reads


@pytest.fixture(scope="module")
def buckets(tmp_path_factory: pytest.TempPathFactory) -> list[reads.HostBucket]:
    g = torch.Generator().manual_seed(5)
    shards = [
        {f"s{s}.t{i}": torch.randn(17 * (i + 1), 33, generator=g) for i in range(6)}
        for s in range(3)
    ]
    root = write_real_checkpoint(tmp_path_factory.mktemp("ck"), shards)
    return reads.layout(list(read_checkpoint(root).tensors))


def test_a_buffer_is_filled_up_to_its_first_run_not_read(
    buckets: list[reads.HostBucket], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reads, "READ_CHUNK", 8192)  # many runs, some a piece of a tensor
    progress = ReadProgress(buckets)
    assert progress.filled(0) == 0  # nothing read: not even the runs are known yet
    runs = reads.read_runs(buckets)
    progress.begin(runs)
    assert len(runs) > 10
    order = list(range(len(runs)))
    random.Random(3).shuffle(order)  # the reader's threads finish out of order
    done: set[int] = set()
    for k in order:
        progress.add(runs[k])
        done.add(k)
        first_missing = next((i for i in range(len(runs)) if i not in done), None)
        want = buckets[0].size if first_missing is None else runs[first_missing].pieces[0][0]
        assert progress.filled(0) == want
    # ... and what it counts, as before
    assert progress.bytes_read == progress.total_bytes
    assert progress.tensors_read == progress.total_tensors


def test_a_wait_ends_when_the_bytes_are_in_or_with_the_readers_error(
    buckets: list[reads.HostBucket],
) -> None:
    progress = ReadProgress(buckets)
    runs = reads.read_runs(buckets)
    progress.begin(runs)
    end = runs[1].pieces[0][0] + 1  # needs runs 0 and 1
    assert not progress.wait(0, end, 0.01)
    threading.Timer(0.05, lambda: [progress.add(r) for r in runs[:2]]).start()
    assert progress.wait(0, end, 30.0)
    progress.fail(InvalidInput("x.safetensors: ends before tensor 't' does"))
    with pytest.raises(InvalidInput, match="ends before"):
        progress.wait(0, buckets[0].size, 30.0)


def test_a_stopped_read_stops_at_the_next_run(buckets: list[reads.HostBucket]) -> None:
    progress = ReadProgress(buckets)
    runs = reads.read_runs(buckets)
    progress.begin(runs)
    progress.add(runs[0])
    progress.stop()
    with pytest.raises(reads.ReadStopped):
        progress.add(runs[1])


def test_fill_reports_every_run_to_the_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader's own loop: every run it reads moves the frontier, to the end."""
    monkeypatch.setattr(reads, "READ_CHUNK", 4096)
    root = write_real_checkpoint(tmp_path, [{f"s{s}.w": torch.randn(64, 64)} for s in range(3)])
    checkpoint = read_checkpoint(root)
    buckets = reads.layout(list(checkpoint.tensors))
    memory = [bytearray(b.size) for b in buckets]
    progress = ReadProgress(buckets)
    reads.fill(checkpoint, buckets, [memoryview(m) for m in memory], 3, progress=progress)
    assert progress.done.is_set()
    assert [progress.filled(i) for i in range(len(buckets))] == [b.size for b in buckets]


def test_the_installed_checkpoint_engine_has_the_copy_the_gate_wraps() -> None:
    from checkpoint_engine.ps import ParameterServer

    params = list(inspect.signature(ParameterServer._copy_to_buffer).parameters)
    assert params == ["self", *ce_internals.BUCKET_COPY_PARAMETERS]
    assert hasattr(ParameterServer, "_get_memory_pool")


class _Engine:
    """A ParameterServer of another version: its bucket copy named or shaped otherwise."""

    def _get_memory_pool(self, name: str) -> list[object]:
        return []


def test_a_checkpoint_engine_without_that_copy_is_refused_not_worked_around() -> None:
    def wrap(original: object) -> object:
        raise AssertionError("wrapped a copy it does not know")

    with pytest.raises(OperationFailed, match=r"has no _Engine\._copy_to_buffer"):
        ce_internals.wrap_bucket_copy(_Engine(), wrap)  # type: ignore[arg-type]

    class Renamed(_Engine):
        def _copy_to_buffer(self, name: str, bucket: object, buffer: object) -> None:
            pass

    with pytest.raises(OperationFailed, match=r"takes \['name', 'bucket', 'buffer'\], not"):
        ce_internals.wrap_bucket_copy(Renamed(), wrap)  # type: ignore[arg-type]


def test_the_reader_reads_in_the_order_the_gate_waits_for(tmp_path: Path) -> None:
    """The reader's runs go buffer by buffer, front to back: checkpoint-engine's bucket order."""
    root = write_real_checkpoint(tmp_path, [{f"s{s}.w": torch.randn(64, 64)} for s in range(4)])
    runs = reads.read_runs(reads.layout(list(read_checkpoint(root).tensors)))
    keys = [(r.bucket, r.pieces[0][0]) for r in runs]
    assert keys == sorted(keys)

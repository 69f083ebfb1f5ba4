"""A serve push whose read overlaps its transfer (ckptctl.transfer.overlap), on CPU.

A real 2-rank serve job (tests/support/cpu_ps_rank.py, CPU_PS_TRANSFER=zmq) whose stand-in
engine sends the bytes the way checkpoint-engine does (CPU_PS_COPY: its own `_gen_h2d_buckets`,
`_copy_to_buffer` and metas) to the workers of a fake SGLang (tests/support/fake_worker.py), which read
each tensor out of the shared buffer and hash it. A shard's read is held (CPU_PS_READ_HOLD) until
the server has loaded a bucket of the same push: only a push that sends buckets while later ones
are still being read gets past the hold (else it times out, and the test says so). Deadlines are
safety nets; nothing here depends on how long anything takes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from ckpt_factory import write_real_checkpoint
from conftest import cpu_serve_job, wait_for_path
from fake_checker import HeldWeights
from fake_server import Behaviour, FakeServer
from fake_worker import ZmqWorkers
from test_serve_faults import push

pytestmark = pytest.mark.slow

SHARDS = 4
BUCKETS, COPIES, BUFFERS = 3, 4, 7  # tracks of a trace (ckptctl.observe.timeline)


def make_checkpoint(root: Path, seed: int) -> Path:
    """4 shards of bf16/fp32/int8 tensors (about 0.6 MB): many 64 KiB buckets."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shards = []
    for s in range(SHARDS):
        shards.append(
            {
                f"layers.{s}.w": torch.randn(128, 256, generator=g).to(torch.bfloat16),
                f"layers.{s}.b": torch.randn(77, generator=g),
                f"layers.{s}.q": torch.randint(-100, 100, (96, 300), generator=g).to(torch.int8),
                f"layers.{s}.n": torch.randn(64, 64, generator=g),
            }
        )
    return write_real_checkpoint(root, shards)


def file_digests(root: Path) -> dict[str, str]:
    """SHA-256 of every tensor's bytes as the files hold them (from the safetensors headers)."""
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        data = f.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = info["data_offsets"]
            out[name] = hashlib.sha256(data[8 + n + lo : 8 + n + hi]).hexdigest()
    return out


def shards_of(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.safetensors"))


class Job:
    def __init__(self, workers: ZmqWorkers, sock: str, flags: Path) -> None:
        self.workers, self.sock, self.flags = workers, sock, flags
        self.pushing: Path | None = None  # what the server's weights checker expects next
        self.proc: subprocess.Popen[str] | None = None  # torchrun

    def hold(
        self,
        root: Path,
        shard: str,
        *,
        until: str = "loaded",
        cut: bool = False,
        fail: bool = False,
    ) -> None:
        """The next read of `shard` waits for the server's flag `until` of the next push (then,
        with `cut`, cuts the file short; with `fail`, fails as an unreadable file's does)."""
        for flag in ("loaded", "connected", "holds"):
            (self.flags / flag).unlink(missing_ok=True)
        self.workers.flags = self.flags
        (self.flags / f"hold-{shard}").write_text(until)
        for wanted, flag in ((cut, "cut"), (fail, "fail")):
            if wanted:
                (self.flags / f"{flag}-{shard}").touch()

    def release_all(self) -> None:
        for pattern in ("hold-*", "cut-*", "fail-*"):
            for p in self.flags.glob(pattern):
                p.unlink()

    def holds(self) -> list[dict]:
        path = self.flags / "holds"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def loaded_now(self) -> set[str]:
        """Tensors the server's workers loaded in the last update."""
        return {n for buckets in self.workers.loaded.values() for b in buckets for n in b}


@contextmanager
def serving(
    short_tmp: Path,
    tmp_path: Path,
    first: Path,
    checker: bool = False,
    restore: bool = False,
    port: int | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Job]:
    """A serve job whose first push (of `first`, checked bit for bit) pinned its pool; with
    `checker`, its TP2 server answers SGLang's weights checker with what `job.pushing` holds;
    with `restore`, a push that fails part-way is followed by a restore (serve's default);
    `port`: torchrun's (its store's), else a free one; `env`: more for the ranks."""
    flags = tmp_path / "flags"
    ipc = tmp_path / "ipc"
    flags.mkdir()
    ipc.mkdir()
    sock = str(short_tmp / "serve.sock")
    job = Job(ZmqWorkers(), sock, flags)
    behaviour = Behaviour(profile="sglang-pr17009", held=HeldWeights(tp_size=2))

    def on_update(handles: dict[str, str], body: dict) -> None:
        job.workers(handles, body)
        if checker and job.pushing is not None:
            behaviour.held.receive(job.pushing)

    behaviour.on_update = on_update
    env = {
        **(env or {}),
        "CPU_PS_TRANSFER": "zmq",
        "CPU_PS_COPY": str(ipc),
        "CPU_PS_BUCKET_BYTES": str(64 << 10),
        "CPU_PS_READ_HOLD": str(flags),
    }
    with (
        FakeServer(behaviour) as server,
        cpu_serve_job(
            server.endpoint, "--control-socket", sock, "--push-timeout", "120",
            "--read-threads", "1", *([] if restore else ["--no-restore"]), env=env, port=port,
        ) as job.proc,
    ):  # fmt: skip
        try:
            assert wait_for_path(sock), "the serve job did not open its control socket"
            job.pushing = first
            code, _, err = push(sock, path=first)
            assert code == 0, err
            assert job.workers.digests == file_digests(first)
            yield job
        finally:
            job.workers.die()


def test_buckets_go_while_later_ones_are_read_and_every_byte_arrives(
    short_tmp: Path, tmp_path: Path
) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    with serving(short_tmp, tmp_path, a) as job:
        # The pool is pinned now: this push hands its buffers over while they are read. Its
        # last shard is read only once the server has loaded a bucket of it.
        job.hold(b, shards_of(b)[-1])
        trace = tmp_path / "push.json"
        code, doc, err = push(job.sock, "--trace", str(trace), path=b)
        assert code == 0, err
        assert job.holds() and all(h["released"] for h in job.holds()), (
            "the last shard was read before any bucket reached the server: the push did "
            f"not overlap its read with the transfer ({job.holds()})"
        )
        assert job.workers.digests == file_digests(b)  # every tensor, bit for bit
        assert job.loaded_now() == set(file_digests(b))
        # Its timeline: a copy out of host memory per bucket, and when each buffer was read.
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
        for rank in (0, 1):
            copies = [e for e in events if e.get("pid") == rank and e.get("tid") == COPIES]
            buckets = [e for e in events if e.get("pid") == rank and e.get("tid") == BUCKETS]
            assert 0 < len(copies) <= len(buckets), (copies, buckets)  # (its own buckets)
            assert sum(e["args"]["bytes"] for e in copies) > 0
            filled = [e for e in events if e.get("pid") == rank and e.get("tid") == BUFFERS]
            assert filled, "no host buffer's read in the trace"


def test_a_read_failing_mid_push_fails_it_cleanly_and_the_next_push_is_whole(
    short_tmp: Path, tmp_path: Path
) -> None:
    a = make_checkpoint(tmp_path / "a", seed=1)
    cut_late = make_checkpoint(tmp_path / "late", seed=3)
    cut_early = make_checkpoint(tmp_path / "early", seed=4)
    with serving(short_tmp, tmp_path, a) as job:
        # Cut short after the server took a bucket of this push: exit 3, naming the file;
        # the server holds part of it (and says so), the job serves on.
        last = shards_of(cut_late)[-1]
        job.hold(cut_late, last, cut=True)
        code, doc, err = push(job.sock, path=cut_late)
        assert code == 3, err
        assert last in doc["error"] and "reading the checkpoint failed mid-push" in doc["error"]
        assert all(h["released"] for h in job.holds()), job.holds()
        assert doc["server_weights"] == "partial", doc
        assert job.loaded_now(), "no bucket reached the server before the read failed"
        job.release_all()

        # Cut short once the server connected, before any bucket of it was read: the server
        # is told to give up before any bucket: its weights are untouched.
        first = shards_of(cut_early)[0]
        job.hold(cut_early, first, until="connected", cut=True)
        code, doc, err = push(job.sock, path=cut_early)
        assert code == 3, err
        assert first in doc["error"], doc
        assert doc["server_weights"] is None, doc
        assert job.loaded_now() == set(), "a bucket went to the server after the read failed"
        job.release_all()

        # The same pool, refilled: every byte of a whole checkpoint arrives.
        fresh = tmp_path / "fresh"
        shutil.copytree(a, fresh)
        code, _, err = push(job.sock, path=fresh)
        assert code == 0, err
        assert job.workers.digests == file_digests(a)
        assert job.loaded_now() == set(file_digests(a))


def test_push_verify_hashes_the_bytes_once_they_are_read(short_tmp: Path, tmp_path: Path) -> None:
    """--verify hashes the registered bytes while the update runs: here they are still being
    read when the push starts, and the hashes must be of this checkpoint, not of the one the
    pool held before."""
    a = make_checkpoint(tmp_path / "a", seed=1)
    b = make_checkpoint(tmp_path / "b", seed=2)
    with serving(short_tmp, tmp_path, a, checker=True) as job:
        job.hold(b, shards_of(b)[-1])
        job.pushing = b
        code, doc, err = push(job.sock, "--verify", path=b)
        assert code == 0, err
        assert doc["verified"] == "checksum", doc
        assert all(h["released"] for h in job.holds()), job.holds()
        assert job.workers.digests == file_digests(b)

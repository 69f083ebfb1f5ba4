"""`ckptctl serve` on a real GPU under the faults of issue 23 (needs CUDA; tests/gpu/README.md):
the real ParameterServer, and a receiver (tests/support/gpu_receiver.py, a process of its own that can
be killed) whose worker loads every tensor through checkpoint_engine.worker.update_weights_from_ipc
and checks it bit for bit. One serve job lives through all of them, in order:

- a checkpoint of other shapes: refused (exit 3) before any byte moves;
- the server refuses mid-way (a worker raises in bucket 3): the push fails, the last whole
  checkpoint is pushed again, the server ends whole on it;
- Ctrl-C on `push` mid-transfer: exit 130, the server restored;
- the server down (connection refused): exit 1 at --server-wait; the next push, once it is
  back, whole;
- the server killed mid-push: exit 1, the job serves on; the next push, once it is back, whole;
- `ckptctl stop` mid-push: the job ends (exit 0), the push fails "stopped", the server restored.

Each fault's figures (seconds from the fault to the exit, exit codes, the server's weights
afterwards) land in $CKPTCTL_GPU_RESULTS/serve-faults.json. The seconds are reported, never
asserted: the assertions are on outcomes, with safety deadlines far below --push-timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ckpt_factory import write_real_checkpoint
from conftest import ckptctl_script, run_script, wait_for_path, wait_until
from fake_server import reserved_port
from gpu_jobs import RESULTS, gpu_memory_used_mib, kill_tree, start_serve_job
from locations import GPU_RECEIVER

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_serial, pytest.mark.slow]


def _checkpoint(root: Path, seed: int, width: int = 4096) -> Path:
    """16 bf16 tensors of 8 MiB (at width 4096) in 2 shards: with 10 MB buckets, a bucket each
    - a push long enough to interrupt when each bucket takes a while to load."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"layers.{i}.w": torch.randn(1024, width, generator=g).to(torch.bfloat16) for i in range(16)
    }
    names = sorted(tensors)
    return write_real_checkpoint(
        root, [{n: tensors[n] for n in names[:8]}, {n: tensors[n] for n in names[8:]}]
    )


class Receiver:
    """tests/support/gpu_receiver.py as a process (group) of its own on a fixed port: killable."""

    def __init__(self, checkpoint: Path, port: int) -> None:
        self.checkpoint, self.port = checkpoint, port
        self.endpoint = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> Receiver:
        self.proc = subprocess.Popen(
            [sys.executable, GPU_RECEIVER, "--checkpoint-path", str(self.checkpoint),
             "--devices", "0", "--port", str(self.port)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), f"the receiver did not start: {line!r}"
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def config(self, **changes: Any) -> None:
        r = httpx.post(f"{self.endpoint}/receiver/config", json=changes, timeout=30)
        r.raise_for_status()

    def report(self) -> dict[str, Any]:
        return httpx.get(f"{self.endpoint}/receiver/report", timeout=120).json()

    def whole(self) -> bool:
        """The last update delivered every tensor, each bit-exact against `verify_against`."""
        rep = self.report()
        return bool(rep["ok"]) and all(
            not w["mismatches"] and not w["missing"] and not w["errors"] for w in rep["workers"]
        )


def test_serve_survives_each_fault_and_the_server_ends_whole(
    tmp_path: Path, short_tmp: Path
) -> None:
    a = _checkpoint(tmp_path / "a", seed=1)
    b = _checkpoint(tmp_path / "b", seed=2)
    other = _checkpoint(tmp_path / "other", seed=3, width=2048)
    sock = str(short_tmp / "serve.sock")
    figures: dict[str, Any] = {}

    def record(fault: str, **fields: Any) -> None:
        figures[fault] = {**fields, "gpu_memory_used_mib": gpu_memory_used_mib()}
        if RESULTS:
            Path(RESULTS).mkdir(parents=True, exist_ok=True)
            (Path(RESULTS) / "serve-faults.json").write_text(json.dumps(figures, indent=1))

    def push(path: Path, *flags: str) -> tuple[int, dict[str, Any], float]:
        t0 = time.monotonic()
        r = run_script("push", "--control-socket", sock, "--checkpoint-path", str(path),
                       "--json", *flags, timeout=180)  # fmt: skip
        return r.returncode, json.loads(r.stdout), round(time.monotonic() - t0, 3)

    def push_in_background(path: Path, *flags: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [ckptctl_script(), "push", "--control-socket", sock, "--checkpoint-path", str(path),
             "--json", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def mid_transfer() -> None:
        from ckptctl import client

        def loading() -> bool:
            now = client.status(control_socket=sock).get("running") or {}
            return now.get("stage") == "update" and (now.get("bytes_done") or 0) > 0

        wait_until(loading, timeout=120, what="a push half-way through its transfer")

    with reserved_port() as held:
        port = held.getsockname()[1]
    rx = Receiver(a, port).start()
    job = start_serve_job(
        rx.endpoint, sock, short_tmp / "serve.log",
        "--push-timeout", "300", "--server-wait", "5", "--bucket-size-gb", "0.01",
    )  # fmt: skip
    try:
        assert wait_for_path(sock, timeout=180), (short_tmp / "serve.log").read_text()[-3000:]
        code, doc, secs = push(a, "--weight-version", "a1")
        assert code == 0, doc
        assert rx.whole()
        record("first push", exit_code=code, seconds=secs, whole=True)

        # A checkpoint of other shapes: refused before any byte moves.
        updates = rx.report()["updates"]
        code, doc, secs = push(other, "--weight-version", "x")
        assert code == 3, doc
        assert "layers.0.w" in doc["error"]
        assert rx.report()["updates"] == updates and rx.whole()
        record("other shapes", exit_code=code, seconds=secs, updates_sent=0, whole=True,
               error=doc["error"])  # fmt: skip

        # Refused mid-way: a worker raises in bucket 3; the restore makes the server whole.
        rx.config(fail_bucket=3, once=True, verify_against=str(a))
        code, doc, secs = push(b, "--weight-version", "b1")
        assert code == 1, doc
        assert doc["server_weights"] == "whole" and doc["restore"]["ok"], doc
        rep = rx.report()
        assert rx.whole() and rep["weight_version"] == "a1"
        record("refused mid-way", exit_code=code, seconds=secs, whole=True,
               restore_seconds=doc["restore"]["seconds"], error=doc["error"])  # fmt: skip

        # Ctrl-C on push, mid-transfer.
        rx.config(bucket_delay_s=0.4, verify_against=str(a))
        running = push_in_background(b, "--weight-version", "b2")
        mid_transfer()
        rx.config(bucket_delay_s=0)  # (the update under way keeps its own; the restore: none)
        t0 = time.monotonic()
        running.send_signal(signal.SIGINT)
        out, err = running.communicate(timeout=120)
        secs = round(time.monotonic() - t0, 3)
        assert running.returncode == 130, err
        doc = json.loads(out)
        assert doc["server_weights"] == "whole", doc
        assert rx.whole() and rx.report()["weight_version"] == "a1"
        record("ctrl-c on push", exit_code=running.returncode, seconds_to_exit=secs,
               whole=True, error=doc["error"])  # fmt: skip

        # The server down: the push fails at --server-wait; once it is back, a whole push.
        rx.kill()
        code, doc, secs = push(b, "--weight-version", "b3")
        assert code == 1, doc
        assert "connection refused" in doc["error"] and doc["server_weights"] is None
        rx = Receiver(a, port).start()
        code2, _, secs2 = push(a, "--weight-version", "a2")
        assert code2 == 0 and rx.whole()
        record("server down", exit_code=code, seconds_to_exit=secs, error=doc["error"],
               next_push_exit_code=code2, next_push_seconds=secs2, next_push_whole=True)  # fmt: skip

        # The server killed mid-push: the push fails, the job serves on.
        rx.config(bucket_delay_s=0.4, verify_against=str(a))
        running = push_in_background(b, "--weight-version", "b4")
        mid_transfer()
        t0 = time.monotonic()
        rx.kill()
        out, err = running.communicate(timeout=120)
        secs = round(time.monotonic() - t0, 3)
        assert running.returncode == 1, err
        doc = json.loads(out)
        assert job.poll() is None
        rx = Receiver(a, port).start()
        code2, _, secs2 = push(a, "--weight-version", "a3")
        assert code2 == 0 and rx.whole()
        record("server killed mid-push", exit_code=running.returncode, seconds_to_exit=secs,
               server_weights=doc["server_weights"], error=doc["error"],
               next_push_exit_code=code2, next_push_whole=True)  # fmt: skip

        # stop mid-push: the job ends, the push fails "stopped", the server is restored.
        rx.config(bucket_delay_s=0.4, verify_against=str(a))
        running = push_in_background(b, "--weight-version", "b5")
        mid_transfer()
        rx.config(bucket_delay_s=0)  # (the update under way keeps its own)
        t0 = time.monotonic()
        assert run_script("stop", "--control-socket", sock, timeout=30).returncode == 0
        job.wait(timeout=60)
        secs = round(time.monotonic() - t0, 3)
        out, err = running.communicate(timeout=60)
        assert job.returncode == 0, (short_tmp / "serve.log").read_text()[-3000:]
        assert running.returncode == 1, err
        doc = json.loads(out)
        assert "stopped" in doc["error"]
        whole = rx.whole()
        record("stop mid-push", job_exit_code=job.returncode, seconds_to_job_exit=secs,
               push_exit_code=running.returncode, server_weights=doc["server_weights"],
               whole=whole, error=doc["error"])  # fmt: skip
        assert whole and doc["server_weights"] == "whole"
    finally:
        if job.poll() is None:
            kill_tree(job)
        rx.kill()

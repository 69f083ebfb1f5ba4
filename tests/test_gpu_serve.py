"""`ckptctl serve` on a real GPU: pushes of different checkpoints in a row into one receiver,
each bit-exact, and a push that fails before the transfer leaves the job serving (needs CUDA;
tests/README-gpu.md). Figures land in $CKPTCTL_GPU_RESULTS."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from ckpt_factory import write_real_checkpoint
from conftest import run_script
from fake_server import torchrun_cmd
from gpu_receiver import ReceiverServer

pytestmark = [pytest.mark.gpu]
RESULTS = os.environ.get("CKPTCTL_GPU_RESULTS")


def _checkpoint(root: Path, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"layers.{i}.w": torch.randn(512, 1024, generator=g).to(torch.bfloat16) for i in range(6)
    }
    tensors["norm"] = torch.randn(1024, generator=g)
    return write_real_checkpoint(root, [tensors])


def _gpu_memory_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.strip())


def test_ten_pushes_in_a_row_each_bit_exact(tmp_path: Path, short_tmp: Path) -> None:
    ckpts = [_checkpoint(tmp_path / f"ck{i}", seed=i) for i in range(3)]
    sock = str(short_tmp / "serve.sock")
    with ReceiverServer(ckpts[0], [0]) as rx:
        job = subprocess.Popen(
            torchrun_cmd(
                "--no-python",
                "ckptctl",
                "serve",
                "--control-socket",
                sock,
                "--inference-parallel-size",
                "1",
                "--endpoint",
                rx.endpoint,
                "--push-timeout",
                "120",
                nproc=1,
            ),  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "NCCL_NVLS_ENABLE": "0"},
        )
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(sock) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert os.path.exists(sock)
            seconds = []
            for i in range(10):
                ck = ckpts[i % 3]
                rx.set_config(verify_against=str(ck))
                t0 = time.monotonic()
                r = run_script(
                    "push",
                    "--control-socket",
                    sock,
                    "--checkpoint-path",
                    str(ck),
                    "--weight-version",
                    f"v{i}",
                    "--json",
                    timeout=180,
                )
                seconds.append(round(time.monotonic() - t0, 3))
                assert r.returncode == 0, r.stdout + r.stderr
                report = rx.report()
                assert report["ok"] and report["weight_version"] == f"v{i}"
                assert all(not w["mismatches"] and not w["missing"] for w in report["workers"])
                if i == 4:  # a push that fails before the transfer: the job goes on
                    bad = run_script(
                        "push",
                        "--control-socket",
                        sock,
                        "--checkpoint-path",
                        str(tmp_path / "nope"),
                        timeout=60,
                    )
                    assert bad.returncode == 3
                if i == 6:  # the server refuses (HTTP 400): this push fails, the job goes on
                    gpu_before_refusal = _gpu_memory_used_mib()
                    rx.set_config(refuse="IPC weight update failed: busy")
                    refused = run_script(
                        "push", "--control-socket", sock, "--checkpoint-path", str(ck), timeout=120
                    )
                    rx.set_config(refuse=None)
                    assert refused.returncode == 1, refused.stderr
                    assert "refused the update: HTTP 400" in refused.stderr
                if i == 7:  # the refused push's IPC buffer was given back (release_ipc_reference)
                    grown = _gpu_memory_used_mib() - gpu_before_refusal
                    assert grown < 1024, f"GPU memory grew by {grown} MiB after a refused push"
            with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=10) as client:
                client.post("http://serve/stop")
            out, err = job.communicate(timeout=60)
        finally:
            if job.poll() is None:
                job.kill()
    assert job.returncode == 0, err[-3000:]
    if RESULTS:
        with open(Path(RESULTS) / "gpu_tests.jsonl", "a") as fh:
            fh.write(json.dumps({"test": "serve: 10 pushes", "push_seconds": seconds}) + "\n")

"""The GPU receiver end to end: checkpoint-engine's ParameterServer under torchrun pushes a
mixed-dtype checkpoint into `ReceiverServer` workers over CUDA IPC (needs CUDA; see
tests/README-gpu.md for running these on the device)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_server import free_port
from gpu_receiver import ReceiverConfig, ReceiverServer
from gpu_smoke_ps import write_checkpoint

pytestmark = [pytest.mark.gpu]
HERE = Path(__file__).resolve().parent


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(str(out))
    return out


def _torchrun(nproc: int, *args: str) -> subprocess.Popen[str]:
    """torchrun in its own process group, so a hung PS can be killed with all its ranks."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    cmd += ["--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    cmd += [str(HERE / "gpu_smoke_ps.py"), "drive", *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int | None, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        return None, out


@pytest.fixture
def short_uds() -> Iterator[str]:
    path = f"/tmp/rx-{os.getpid()}-{time.monotonic_ns()}.sock"
    yield path
    if os.path.exists(path):
        os.unlink(path)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_ps_rounds_arrive_bit_exact_and_failures_are_caught(
    ckpt: Path, tmp_path: Path, tp: int
) -> None:
    if _gpus() < tp:
        pytest.skip(f"needs {tp} GPUs")
    out = tmp_path / "result.json"
    with ReceiverServer(ckpt, devices=list(range(tp))) as rx:
        proc = _torchrun(tp, "--checkpoint", str(ckpt), "--endpoint", rx.endpoint,
                         "--rounds", "ok,fail_last,fail_mid,ok", "--out", str(out))  # fmt: skip
        rc, log = _finish(proc, timeout=240)
    assert rc == 0, log[-4000:]
    doc = json.loads(out.read_text())
    assert doc["passed"], log[-4000:]
    first = doc["rounds"][0]["report"]
    assert [w["device"] for w in first["workers"]] == list(range(tp))
    assert all(w["buckets"] > 1 for w in first["workers"])


@pytest.mark.slow
def test_vllm_profile_over_a_unix_socket(ckpt: Path, tmp_path: Path, short_uds: str) -> None:
    out = tmp_path / "result.json"
    with ReceiverServer(ckpt, devices=[0], profile="vllm", uds=short_uds):
        proc = _torchrun(1, "--checkpoint", str(ckpt), "--uds", short_uds, "--engine", "vllm",
                         "--rounds", "ok,fail_last", "--out", str(out))  # fmt: skip
        rc, log = _finish(proc, timeout=180)
    assert rc == 0, log[-4000:]
    assert json.loads(out.read_text())["passed"]


def test_worker_gives_up_when_no_parameter_server_talks(ckpt: Path) -> None:
    config = ReceiverConfig(worker_timeout_s=2.0)
    with ReceiverServer(ckpt, devices=[0], config=config) as rx:
        uuid = rx.report()["workers"][0]["uuid"]
        body = {"zmq_handles": {uuid: f"ipc://@ckptctl-nobody-{os.getpid()}.sock"}}
        t0 = time.monotonic()
        r = httpx.post(f"{rx.endpoint}/update_weights_from_ipc", json=body, timeout=60)
        took = time.monotonic() - t0
        w = rx.report()["workers"][0]
    assert r.status_code == 400 and "TimeoutError" in r.json()["message"]
    assert 2.0 <= took < 30
    assert w["tensors_received"] == 0 and len(w["missing"]) == rx.report()["expected_tensors"]


def test_unknown_gpu_uuid_fails_like_sglang(ckpt: Path) -> None:
    with ReceiverServer(ckpt, devices=[0]) as rx:
        body = {"zmq_handles": {"GPU-not-this-one": "ipc://@x.sock"}}
        r = httpx.post(f"{rx.endpoint}/update_weights_from_ipc", json=body, timeout=60)
    assert r.status_code == 400
    assert "not found in zmq_handles" in r.json()["message"]


@pytest.mark.slow
def test_a_worker_that_dies_mid_update_is_reported(ckpt: Path, tmp_path: Path) -> None:
    config = ReceiverConfig(die_in_bucket=1)
    with ReceiverServer(ckpt, devices=[0], config=config) as rx:
        proc = _torchrun(1, "--checkpoint", str(ckpt), "--endpoint", rx.endpoint,
                         "--rounds", "ok")  # fmt: skip
        # checkpoint-engine's PS then waits forever on the dead worker: watch the report,
        # then kill it.
        deadline = time.monotonic() + 120
        while rx.report()["updates"] == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        _finish(proc, timeout=1)
        doc = rx.report()
        # a later update is refused at once: the worker is gone
        later = httpx.post(
            f"{rx.endpoint}/update_weights_from_ipc", json={"zmq_handles": {}}, timeout=30
        )
    w = doc["workers"][0]
    assert doc["updates"] == 1 and doc["ok"] is False
    assert w["alive"] is False and "exited with code 17" in w["errors"][0]
    assert later.status_code == 400 and "dead" in later.json()["message"]

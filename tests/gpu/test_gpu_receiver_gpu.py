"""The GPU receiver end to end: checkpoint-engine's ParameterServer under torchrun pushes a
mixed-dtype checkpoint into `ReceiverServer` workers over CUDA IPC (needs CUDA; see
tests/gpu/README.md for running these on the device)."""

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
from gpu_jobs import gpu_count
from gpu_receiver import ReceiverConfig, ReceiverServer
from gpu_smoke_ps import write_checkpoint
from torchrun_launch import free_master_port

pytestmark = [pytest.mark.gpu]
HERE = Path(__file__).resolve().parents[1] / "support"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(str(out))
    return out


# checkpoint-engine's own ParameterServer binds one IPC socket name per GPU (its UUID and a
# counter from 0): two of these tests beside each other on one GPU collide on it, so they run
# with the gpu_serial ones. (ckptctl's own jobs pick a free name: ce_internals.)
SMOKE_PS = pytest.mark.gpu_serial


class Ranks:
    """The parameter-server ranks, started the way torchrun starts them (RANK, WORLD_SIZE,
    MASTER_* in the environment) but each in its own session, so a rank that hangs in
    checkpoint-engine is killed for sure. (torchrun starts its workers in new sessions
    too, so killing torchrun's process group would leave them running.)"""

    def __init__(self, tmp: Path, world: int, *args: str) -> None:
        env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_master_port()))
        env.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        cmd = [sys.executable, str(HERE / "gpu_smoke_ps.py"), "drive", *args]
        self.logs = [tmp / f"rank{r}.log" for r in range(world)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            with open(log, "w") as fh:
                self.procs.append(
                    subprocess.Popen(
                        cmd,
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def finish(self, timeout: float) -> list[int | None]:
        """Exit codes; None for a rank still running at the deadline (then killed)."""
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        return codes

    def log(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in self.logs)


@pytest.fixture
def short_uds() -> Iterator[str]:
    path = f"/tmp/rx-{os.getpid()}-{time.monotonic_ns()}.sock"
    yield path
    if os.path.exists(path):
        os.unlink(path)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@SMOKE_PS
def test_ps_rounds_arrive_bit_exact_and_failures_are_caught(
    ckpt: Path, tmp_path: Path, tp: int
) -> None:
    if gpu_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    out = tmp_path / "result.json"
    with ReceiverServer(ckpt, devices=list(range(tp))) as rx:
        ranks = Ranks(tmp_path, tp, "--checkpoint", str(ckpt), "--endpoint", rx.endpoint,
                      "--rounds", "ok,fail_last,fail_mid,ok", "--out", str(out))  # fmt: skip
        codes = ranks.finish(timeout=240)
    assert codes == [0] * tp, ranks.log()
    doc = json.loads(out.read_text())
    assert doc["passed"], ranks.log()
    first = doc["rounds"][0]["report"]
    assert [w["device"] for w in first["workers"]] == list(range(tp))
    assert all(w["buckets"] > 1 for w in first["workers"])


@pytest.mark.slow
@SMOKE_PS
def test_vllm_profile_over_a_unix_socket(ckpt: Path, tmp_path: Path, short_uds: str) -> None:
    out = tmp_path / "result.json"
    with ReceiverServer(ckpt, devices=[0], profile="vllm", uds=short_uds):
        ranks = Ranks(tmp_path, 1, "--checkpoint", str(ckpt), "--uds", short_uds,
                      "--engine", "vllm", "--rounds", "ok,fail_last", "--out", str(out))  # fmt: skip
        codes = ranks.finish(timeout=180)
    assert codes == [0], ranks.log()
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
@SMOKE_PS
def test_a_worker_that_dies_mid_update_is_reported(ckpt: Path, tmp_path: Path) -> None:
    config = ReceiverConfig(die_in_bucket=1)
    with ReceiverServer(ckpt, devices=[0], config=config) as rx:
        ranks = Ranks(tmp_path, 1, "--checkpoint", str(ckpt), "--endpoint", rx.endpoint,
                      "--rounds", "ok")  # fmt: skip
        # checkpoint-engine's PS then waits forever on the dead worker: watch the report,
        # then kill it.
        deadline = time.monotonic() + 120
        while rx.report()["updates"] == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        codes = ranks.finish(timeout=2)
        doc = rx.report()
        # a later update is refused at once: the worker is gone
        later = httpx.post(
            f"{rx.endpoint}/update_weights_from_ipc", json={"zmq_handles": {}}, timeout=30
        )
    w = doc["workers"][0]
    assert codes == [None], ranks.log()  # the PS was still hanging: the known bug
    assert doc["updates"] == 1 and doc["ok"] is False
    assert w["alive"] is False and "code 17" in w["errors"][0]
    assert later.status_code == 400 and "dead" in later.json()["message"]

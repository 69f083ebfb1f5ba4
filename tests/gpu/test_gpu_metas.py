"""save-metas → inspect-metas → join's refusal, on real GPUs (needs CUDA; tests/gpu/README.md).

p2p itself needs mooncake and RDMA, which the GPU machine lacks: there the metas file is written
without p2p addresses, save-metas says it is not joinable, and join refuses it with exit 3
before touching the server.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import run_script
from gpu_jobs import record, torchrun_ckptctl
from gpu_receiver import ReceiverServer

pytestmark = [pytest.mark.gpu]


@pytest.fixture
def ckpt(mixed_checkpoint: Path) -> Path:
    return mixed_checkpoint


@pytest.mark.parametrize("register_mode", [None, "engine"])  # None: the default, direct
def test_save_metas_then_inspect_then_join_refuses(
    ckpt: Path, tmp_path: Path, register_mode: str | None
) -> None:
    metas = tmp_path / "metas.json"
    proc = torchrun_ckptctl(
        1,
        "save-metas",
        "--checkpoint-path",
        str(ckpt),
        "--metas-file",
        str(metas),
        "--checkpoint-name",
        "ck-gpu",
        "--sleep-time",
        "3",
        "--json",
        *(["--register-mode", register_mode] if register_mode else []),
        wait=False,
    )
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads(out)
    assert summary["joinable"] is False and "not joinable" in err
    assert summary["served"] == "time is up"

    inspected = run_script("inspect-metas", str(metas), "--checkpoint-path", str(ckpt), "--json")
    assert inspected.returncode == 0, inspected.stderr
    doc = json.loads(inspected.stdout)
    assert doc["checkpoint_name"] == "ck-gpu" and doc["world_size"] == 1
    assert doc["total_parameters"] == summary["tensor_count"]

    with ReceiverServer(ckpt, [0]) as rx:
        t0 = time.monotonic()
        r = run_script(
            "join",
            "--load-metas-file",
            str(metas),
            "--endpoint",
            rx.endpoint,
            "--inference-parallel-size",
            "1",
            timeout=120,
        )
        took = time.monotonic() - t0
        assert r.returncode == 3
        assert "no p2p store address" in r.stderr
        assert rx.behaviour.requests == []  # refused before touching the server
    record(
        f"save-metas ({register_mode or 'direct'}) -> inspect-metas -> join refusal",
        {
            "save_metas_wall_s": summary["ranks"][0]["wall_s"],
            "join_exit": 3,
            "join_seconds": round(took, 2),
            "join_error": r.stderr.strip().splitlines()[-1],
        },
    )


def test_save_metas_serves_until_sigterm_then_unregisters(ckpt: Path, tmp_path: Path) -> None:
    metas = tmp_path / "metas.json"
    proc = torchrun_ckptctl(
        1,
        "save-metas",
        "--checkpoint-path",
        str(ckpt),
        "--metas-file",
        str(metas),
        "--json",
        wait=False,
    )
    deadline = time.monotonic() + 120
    while not metas.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert metas.exists(), proc.communicate(timeout=5)[1][-3000:]
    time.sleep(1.0)
    ranks = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and b"ckptctl\0save-metas" in (cmd := (p / "cmdline").read_bytes())
        and b"torch.distributed.run" not in cmd  # the ranks, not torchrun itself
    ]
    assert ranks
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out)["served"] == "stopped by SIGTERM"


def test_update_save_metas_file_uses_the_same_writer(ckpt: Path, tmp_path: Path) -> None:
    metas = tmp_path / "from-update.json"
    with ReceiverServer(ckpt, [0]) as rx:
        proc = torchrun_ckptctl(
            1,
            "update",
            "--checkpoint-path",
            str(ckpt),
            "--inference-parallel-size",
            "1",
            "--endpoint",
            rx.endpoint,
            "--save-metas-file",
            str(metas),
            wait=False,
        )
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-3000:]
        assert rx.report()["ok"]
    r = run_script("inspect-metas", str(metas), "--checkpoint-path", str(ckpt))
    assert r.returncode == 0, r.stderr

"""The update pipeline's wiring across real torchrun ranks on CPU: the split, the store
barrier and plan check, the group leaders' requests to real servers, the read-back, the
figures gathered on rank 0, failures ending every rank. Only checkpoint-engine's
ParameterServer is replaced (tests/support/cpu_ps_rank.py): it needs CUDA, and the GPU tests run it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import cpu_serve_job, wait_for_path
from cpu_jobs import update_on_cpu
from fake_server import Behaviour, FakeServer, run_torchrun
from locations import CPU_PS_RANK, TINY
from warm_launch import torchrun_cmd

pytestmark = pytest.mark.slow


def _updates(server: FakeServer) -> list[dict]:
    return [json.loads(r["body"]) for r in server.behaviour.requests if r["method"] == "POST"]


def test_one_tp2_server_gets_one_request_with_both_handles() -> None:
    with FakeServer(Behaviour()) as s:
        r = update_on_cpu(
            "--inference-parallel-size",
            "2",
            "--endpoint",
            s.endpoint,
            "--weight-version",
            "step-7",
            "--json",
        )
        posts = _updates(s)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["ok"] and summary["world_size"] == 2 and len(summary["ranks"]) == 2
    assert summary["verified"] is None  # no --verify
    assert summary["ranks"][0]["stages"]["verify"]["detail"] == "weight version 'step-7'"
    assert "wait_server" in summary["ranks"][1]["stages"]  # every rank met at the barrier
    assert len(posts) == 1
    assert set(posts[0]["zmq_handles"]) == {"GPU-fake-0", "GPU-fake-1"}
    assert posts[0]["weight_version"] == "step-7"


@pytest.mark.parametrize("mode", ["direct", "engine"])
def test_an_early_plan_that_finishes_late_is_still_the_one_registered(mode: str) -> None:
    """The split is planned (and, direct, the share read) from the command's start, in a thread;
    when the job gets to it first, it waits for that thread instead of taking what is not there
    yet (it took no reader, and the register stage failed on a busy machine)."""
    with FakeServer(Behaviour()) as s:
        r = update_on_cpu(
            "--inference-parallel-size", "2", "--endpoint", s.endpoint, "--register-mode", mode,
            "--json",
            env={**os.environ, "CPU_PS_PLAN_LATE": "1"},
        )  # fmt: skip
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["ok"] and summary["tensor_count"] > 0


def test_two_tp1_servers_each_get_their_own_rank() -> None:
    with FakeServer(Behaviour(profile="vllm")) as a, FakeServer(Behaviour(profile="vllm")) as b:
        r = update_on_cpu(
            "--inference-parallel-size",
            "1",
            "--engine",
            "vllm",
            "--endpoint",
            a.endpoint,
            "--endpoint",
            b.endpoint,
        )
        first, second = _updates(a), _updates(b)
    assert r.returncode == 0, r.stderr
    assert [p["args"][0] for p in first] == [{"GPU-fake-0": "ipc://@fake-0.sock"}]
    assert [p["args"][0] for p in second] == [{"GPU-fake-1": "ipc://@fake-1.sock"}]


def test_a_refusal_ends_both_ranks_with_the_servers_message() -> None:
    with FakeServer(Behaviour(update_status=400, update_message="no room")) as s:
        r = update_on_cpu("--inference-parallel-size", "2", "--endpoint", s.endpoint, "--json")
    assert r.returncode != 0
    assert "[rank 0] error:" in r.stderr and "refused the update: HTTP 400: no room" in r.stderr
    assert "[rank 1] error: rank 0 failed" in r.stderr
    assert json.loads(r.stdout)["exit_code"] == 1  # rank 0's one JSON document: the failure
    assert "timed out" not in r.stderr  # the refusal ended it, not the 60 s deadline


def test_a_server_that_is_not_up_in_time_ends_both_ranks_with_exit_4(
    refused_endpoint: str,
) -> None:
    r = update_on_cpu(
        "--inference-parallel-size",
        "2",
        "--endpoint",
        refused_endpoint,
        "--timeout",
        "15",  # (from each rank's start: enough for both to reach the wait, however busy)
    )
    assert r.returncode != 0
    assert "exitcode  : 4" in r.stderr or "exitcode: 4" in r.stderr
    # Whichever rank gave up first says so (torchrun may end the other before it can).
    assert (
        "did not answer within --timeout" in r.stderr
        or "during waiting for the inference server" in r.stderr  # (rank 1 waits at a barrier)
    ), r.stderr[-3000:]


def test_serve_pushes_and_survives_a_refused_push(short_tmp: Path) -> None:
    """(One process: a refusal on 2 ranks is test_serve_push's.)"""
    import httpx
    from conftest import run_script

    sock = str(short_tmp / "serve.sock")
    with (
        FakeServer(Behaviour()) as s,
        cpu_serve_job(s.endpoint, "--control-socket", sock, "--push-timeout", "30", ranks=1) as job,
    ):
        assert wait_for_path(sock)

        def push(*flags: str) -> subprocess.CompletedProcess[str]:
            return run_script(
                "push", "--control-socket", sock, "--checkpoint-path", str(TINY), *flags,
                timeout=60,
            )  # fmt: skip

        ok = push("--weight-version", "v1")
        assert ok.returncode == 0, ok.stderr
        s.behaviour.update_status, s.behaviour.update_message = 400, "busy"
        refused = push()
        s.behaviour.update_status = 200
        assert refused.returncode == 1
        assert "refused the update: HTTP 400: busy" in refused.stderr
        again = push("--weight-version", "v3")
        assert again.returncode == 0, again.stderr
        assert s.behaviour.weight_version == "v3"
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=10) as client:
            client.post("http://serve/stop")
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err


def _filled_checkpoint(root: Path, fill: int) -> Path:
    """Every byte of every tensor is `fill`: what a rank registered tells which one it was."""
    import torch
    from ckpt_factory import write_real_checkpoint

    def full(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        n = dtype.itemsize * int(torch.Size(shape).numel())
        return torch.full((n,), fill, dtype=torch.uint8).view(dtype).reshape(shape)

    shard = {f"layers.{i}.w": full(64, 96, dtype=torch.bfloat16) for i in range(4)}
    shard["norm"] = full(96, dtype=torch.float32)
    return write_real_checkpoint(root, [shard])


def test_serve_direct_refills_one_pool_push_after_push(tmp_path: Path, short_tmp: Path) -> None:
    """serve --register-mode direct: every push reads its checkpoint into the buffers the first
    push allocated (and pinned, on a GPU), a refused push included, each time with the right
    bytes."""

    import httpx
    from conftest import run_script

    ck1, ck2 = _filled_checkpoint(tmp_path / "one", 1), _filled_checkpoint(tmp_path / "two", 2)
    sock, log = str(short_tmp / "serve.sock"), str(tmp_path / "registered")
    with FakeServer(Behaviour()) as s, cpu_serve_job(
        s.endpoint, "--control-socket", sock, "--push-timeout", "30",
        "--register-mode", "direct", env={"CPU_PS_LOG": log},
    ) as job:  # fmt: skip
        assert wait_for_path(sock)

        def push(ck: Path) -> subprocess.CompletedProcess[str]:
            return run_script(
                "push", "--control-socket", sock, "--checkpoint-path", str(ck), timeout=60
            )

        assert push(ck1).returncode == 0
        assert push(ck2).returncode == 0
        s.behaviour.update_status, s.behaviour.update_message = 400, "busy"
        assert push(ck1).returncode == 1
        s.behaviour.update_status = 200
        last = push(ck1)
        assert last.returncode == 0, last.stderr
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=10) as client:
            client.post("http://serve/stop")
        _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    # The refused push (the third) ends when rank 0, the leader, hears the server refuse, after
    # its own register and gather. Rank 1 may not have reached its gather by then, or even its
    # register: the stand-in's gather is not collective (checkpoint-engine's is), so on a busy
    # machine rank 1 can lack the lines of that push, never those of the others.
    every = {"fills": [[1], [2], [1], [1]], "gathered": [[0, 1]] * 4}
    refused_early = {"fills": [[1], [2], [1]], "gathered": [[0, 1]] * 3}
    for rank in (0, 1):
        rows = [json.loads(line) for line in Path(f"{log}.{rank}").read_text().splitlines()]
        assert all(r["ptrs"] == rows[0]["ptrs"] for r in rows)  # the same memory every time
        gathered = Path(f"{log}.gathered.{rank}").read_text().splitlines()
        seen = {
            "fills": [r["fills"] for r in rows],
            "gathered": [json.loads(line)["planned_ranks"] for line in gathered],
        }
        assert seen == every or (
            rank == 1
            and seen["gathered"] == refused_early["gathered"]
            and seen["fills"] in (every["fills"], refused_early["fills"])
        ), seen


def test_direct_update_registers_every_tensor_and_gathers_from_the_plan(tmp_path: Path) -> None:
    """update --register-mode direct on 2 ranks: the plan is made and the share read before
    the job starts (stages.EarlyShare), and the metas come from the plan, not a pickle."""
    log = str(tmp_path / "registered")
    with FakeServer(Behaviour()) as s:
        cmd = torchrun_cmd(
            CPU_PS_RANK, "update", "--checkpoint-path", str(TINY), "--timeout", "60", "--json",
            "--inference-parallel-size", "2", "--endpoint", s.endpoint,
            "--register-mode", "direct", "--read-threads", "3",
        )  # fmt: skip
        r = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "CPU_PS_LOG": log}
        )
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    for rank in summary["ranks"]:
        stages = rank["stages"]
        assert "planned in" in stages["split"]["detail"]
        assert stages["register"]["detail"].startswith("direct registration")
        assert "3 reader threads" in stages["register"]["detail"]
        assert stages["gather_metas"]["detail"] == "planned metas, addresses gathered"
        gathered = Path(f"{log}.gathered.{rank['rank']}").read_text().splitlines()
        assert [json.loads(line)["planned_ranks"] for line in gathered] == [[0, 1]]


def test_no_rank_consumes_a_file_before_every_rank_has_checked_them_all() -> None:
    """--consume-shm-files: checkpoint-engine deletes a rank's files as it pins them, and every
    rank checks every file first. Rank 0 checks late here; rank 1 must wait for it (on 2x
    H200 it did not, and rank 0 failed on a file rank 1 had already consumed)."""
    shm = Path(tempfile.mkdtemp(prefix="ckptctl-test-consume-", dir="/dev/shm")) / "ck"
    shutil.copytree(TINY, shm)
    try:
        with FakeServer(Behaviour()) as s:
            r = run_torchrun(
                CPU_PS_RANK, "update", "--checkpoint-path", str(shm), "--consume-shm-files",
                "--inference-parallel-size", "2", "--endpoint", s.endpoint, "--timeout", "60",
                "--json", env={**os.environ, "CPU_PS_SLOW_CHECK_RANK": "0"},
            )  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout)["split"] == "files"
        assert sorted(os.listdir(shm)) == ["model.safetensors.index.json"]  # all consumed
    finally:
        shutil.rmtree(shm.parent, ignore_errors=True)

"""What the GPU tests share: a `torchrun ... ckptctl` job on the GPUs and how to end it for
sure, the receiver's bit-exact report, the JSON summary, figures for $CKPTCTL_GPU_RESULTS."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from gpu_receiver import ReceiverServer
from torchrun_launch import free_master_port, torchrun_cmd

RESULTS = os.environ.get("CKPTCTL_GPU_RESULTS")


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


needs_two = pytest.mark.skipif(
    "not __import__('torch').cuda.is_available() or __import__('torch').cuda.device_count() < 2",
    reason="needs 2 GPUs",
)


def big_tensors(seed: int) -> dict[str, Any]:
    """A few MB so that 1 MiB buckets make several buckets."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        f"model.layers.{i}.mlp.up_proj.weight": torch.randn(512, 1024, generator=g).to(
            torch.bfloat16
        )
        for i in range(4)
    } | {"model.norm.weight": torch.randn(1024, generator=g)}


def record(name: str, doc: dict[str, Any]) -> None:
    """A test's figures, one line of $CKPTCTL_GPU_RESULTS/gpu_tests.jsonl (when it is set)."""
    if RESULTS:
        Path(RESULTS).mkdir(parents=True, exist_ok=True)
        with open(Path(RESULTS) / "gpu_tests.jsonl", "a") as fh:
            fh.write(json.dumps({"test": name, **doc}) + "\n")


def torchrun_ckptctl(
    nproc: int,
    *args: str,
    timeout: float = 180,
    nnodes: int = 1,
    node_rank: int = 0,
    master_port: int | None = None,
    wait: bool = True,
) -> Any:
    """`torchrun ... ckptctl ARGS` of `nproc` ranks in a session of its own (end it with
    `kill_tree`): run to its end, (exit code, stdout, stderr, seconds), or with wait=False
    the running process, its output piped."""
    master_port = master_port or free_master_port()
    cmd = torchrun_cmd(
        "--no-python", "ckptctl", *args,
        nproc=nproc, nnodes=nnodes, node_rank=node_rank, port=master_port,
    )  # fmt: skip
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    proc.master_port = master_port  # type: ignore[attr-defined] - names this job's ranks
    if not wait:
        return proc
    return finish(proc, timeout)


def torchrun_update(nproc: int, *args: str, **kw: Any) -> Any:
    """`torchrun_ckptctl(nproc, "update", *args, **kw)`."""
    return torchrun_ckptctl(nproc, "update", *args, **kw)


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not end within {timeout}s\n{err[-4000:]}")
    return proc.returncode, out, err, time.monotonic() - t0


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """torchrun starts its workers in their own sessions: kill them by environment too."""
    for pid in ckptctl_pids(master_port=proc.master_port):  # type: ignore[attr-defined]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)


def ckptctl_pids(rank: int | None = None, *, master_port: int) -> list[int]:
    """The ranks of the job on `master_port`, whatever their command (update, serve, ...); GPU
    tests run four at a time: never another test's ranks - a search by rank alone once killed
    the rank of a test running beside."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"ckptctl" in cmd
            and b"torch.distributed.run" not in cmd
            and f"MASTER_PORT={master_port}".encode() in env
            and (rank is None or f"RANK={rank}".encode() in env)
        ):
            pids.append(int(d.name))
    return pids


def assert_bit_exact(rx: ReceiverServer, ckpt: Path) -> dict[str, Any]:
    """The receiver got every tensor, bit for bit, once, and nothing else; its report."""
    report = rx.report()
    assert report["ok"], json.dumps(report, indent=1)[:4000]
    for w in report["workers"]:
        assert w["mismatches"] == [] and w["missing"] == [] and w["unexpected"] == []
        assert w["duplicates"] == [] and w["errors"] == [] and w["swallowed_errors"] == []
        assert w["tensors_received"] == report["expected_tensors"]
    return report


def json_summary(out: str) -> dict[str, Any]:
    """The one JSON document a `--json` command wrote on stdout."""
    docs = [line for line in out.splitlines() if line.strip()]
    assert len(docs) == 1, out
    return json.loads(docs[0])


def start_serve_job(endpoint: str, sock: str, log: Path, *flags: str) -> subprocess.Popen[str]:
    """`torchrun ... ckptctl serve` with one rank, feeding `endpoint`, its control socket at
    `sock` and its output in the file `log` (never a pipe nobody reads while it runs). Its rank
    has a session of its own: end a job that is still running with `kill_tree(job)`."""
    port = free_master_port()
    with log.open("w") as out:  # (the job keeps its own copy of the descriptor)
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
                endpoint,
                *flags,
                nproc=1,
                port=port,
            ),  # fmt: skip
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "NCCL_NVLS_ENABLE": "0"},
            start_new_session=True,
        )
    job.master_port = port  # type: ignore[attr-defined] - names its ranks for kill_tree
    return job


def gpu_memory_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.strip())

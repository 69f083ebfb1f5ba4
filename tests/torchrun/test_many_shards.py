"""A checkpoint of more shards than a process may have files open (`ulimit -n`): every path
that reads it opens a shard as it reads it, never all at once, and a process that really runs
out of file descriptors is told so (not that its files changed)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_factory import write_real_checkpoint
from fake_server import Behaviour, FakeServer, run_torchrun
from locations import CPU_PS_RANK

SHARDS = 400
LIMIT = 256  # file descriptors: far fewer than the shards, plenty for torch and the rest


def _limited(limit: int = LIMIT) -> Callable[[], None]:
    def lower() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))

    return lower


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many") / "ckpt"
    shards = [{f"layer.{i}.w": torch.full((4, 4), float(i))} for i in range(SHARDS)]
    return write_real_checkpoint(root, shards)


def test_the_dry_run_reads_every_header_under_a_low_limit(many_shards: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ckptctl", "update", "--dry-run", "--checkpoint-path",
         str(many_shards), "--world-size", "2", "--inference-parallel-size", "2", "--json"],
        capture_output=True, text=True, timeout=120, preexec_fn=_limited(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["total_bytes"] == SHARDS * 64
    assert sum(len(rank["files"]) for rank in doc["ranks"]) == SHARDS


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["direct", "engine"])
def test_a_torchrun_update_reads_every_shard_under_a_low_limit(
    many_shards: Path, mode: str
) -> None:
    with FakeServer(Behaviour()) as server:
        r = run_torchrun(
            CPU_PS_RANK, "update", "--checkpoint-path", str(many_shards), "--register-mode", mode,
            "--inference-parallel-size", "1", "--endpoint", server.endpoint, "--timeout", "90",
            "--json",
            nproc=1, preexec_fn=_limited(),
        )  # fmt: skip
        posts = [r for r in server.behaviour.requests if r["method"] == "POST"]
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["tensor_count"] == SHARDS and doc["total_bytes"] == SHARDS * 64
    assert len(posts) == 1


OUT_OF_FDS = """
import os, resource, sys
from ckptctl.checkpoint import read_checkpoint
from ckptctl.checkpoint.headers import open_planned
from ckptctl.errors import CkptctlError

checkpoint = read_checkpoint(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    open_planned(checkpoint, checkpoint.files[0])
except CkptctlError as exc:
    print(type(exc).__name__, exc)
"""


def test_running_out_of_descriptors_is_said_as_such(many_shards: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(OUT_OF_FDS), str(many_shards)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OperationFailed "), r.stdout
    assert "too many open files" in r.stdout and "(`ulimit -n`)" in r.stdout
    assert "64 open at once" in r.stdout
    assert "changed since the checkpoint was planned" not in r.stdout

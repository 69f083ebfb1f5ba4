"""p2p end to end on real GPUs, over mooncake's TCP transport (issue 18).

`save-metas` holds a checkpoint in one torchrun job; `join --load-metas-file` pulls it over p2p
from a second torchrun job into a receiver (tests/support/gpu_receiver.py), bit for bit;
`update --update-method p2p` and `all` likewise; a holder that is gone, or killed mid-transfer,
ends the joiner with exit 1 soon, and the receiver takes the next update.

Needs CUDA and mooncake (`bench/gpu_session.sh p2p` sets it up: tests/gpu/README.md, "p2p").
The lent machines have no RDMA NIC: every p2p job runs through tests/support/p2p_rank.py with
`P2P_TCP_ENV`, which puts checkpoint-engine's p2p store on mooncake's TCP transport on
loopback. That is the test job's doing, never the product's default.

GPUs: every job sees both. checkpoint-engine puts rank r on GPU r % 2, where the receiver's
worker for that rank is (TP2: GPUs 0 and 1; TP1: GPU 0). The holders' ranks keep host memory
registered and a CUDA context each, so they share the GPUs with the joiners and receivers.
Figures (wall, the update stage's GB/s) land in $CKPTCTL_GPU_RESULTS/gpu_tests.jsonl.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from ckpt_factory import mixed_tensors, write_real_checkpoint
from conftest import run_script
from gpu_jobs import RESULTS, json_summary, record
from gpu_receiver import ReceiverConfig, ReceiverServer, read_headers
from locations import P2P_RANK
from p2p_rank import P2P_TCP_ENV
from torchrun_launch import torchrun_cmd

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="needs mooncake-transfer-engine (bench/gpu_session.sh p2p; tests/gpu/README.md)",
    ),
]
BIG_TENSORS = 32  # of 32 MiB each: 1 GiB, so that 32 MiB buckets make a transfer of 33 buckets
JOB_TIMEOUT_S = 120  # each job's --timeout
BOUND_S = 60.0  # a failing joiner must end well within this (and within its own --timeout)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every dtype (mixed_tensors) + 32 random 32 MiB bf16 tensors, in two shards: 1 GiB."""
    import torch

    g = torch.Generator().manual_seed(18)

    def big(i: int) -> Any:
        raw = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8, generator=g)
        return raw.view(torch.bfloat16).reshape(4096, 4096)

    half = BIG_TENSORS // 2
    first = mixed_tensors(seed=18) | {f"model.layers.{i}.w": big(i) for i in range(half)}
    second = {f"model.layers.{i}.w": big(i) for i in range(half, BIG_TENSORS)}
    return write_real_checkpoint(tmp_path_factory.mktemp("p2p-ckpt"), [first, second])


@pytest.fixture(scope="module")
def rx2(ckpt: Path) -> Any:
    """The TP2 server: GPUs 0 and 1."""
    with ReceiverServer(ckpt, [0, 1], config=ReceiverConfig(worker_timeout_s=60)) as rx:
        yield rx


@pytest.fixture(scope="module")
def rx1(ckpt: Path) -> Any:
    """The TP1 server of the failure tests: GPU 0 (a TP1 joiner's rank 0 is there)."""
    with ReceiverServer(ckpt, [0], config=ReceiverConfig(worker_timeout_s=60)) as rx:
        yield rx


# -- jobs -------------------------------------------------------------------------------------


class Job:
    """One torchrun job of tests/support/p2p_rank.py, found again through a marker in its environment
    (torchrun starts its ranks in sessions of their own)."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        nproc: int,
        *args: str,
        env: dict[str, str] | None = None,
        watch: re.Pattern[str] | None = None,
        on_match: Any = None,
    ) -> None:
        self.name = name
        self.marker = f"{name}-{uuid.uuid4().hex[:8]}"
        # The jobs' logs come back with the results (one GPU call: keep what explains a failure).
        logs = Path(RESULTS) / "p2p-logs" if RESULTS else tmp
        logs.mkdir(parents=True, exist_ok=True)
        self.out_path = logs / f"{name}.out"
        self.err_path = logs / f"{name}.err"
        full_env = {
            **os.environ,
            **P2P_TCP_ENV,
            **(env or {}),
            "NCCL_NVLS_ENABLE": "0",
            "PYTHONUNBUFFERED": "1",
            "CKPTCTL_P2P_JOB": self.marker,
        }
        self.started = time.monotonic()
        self._out = open(self.out_path, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            torchrun_cmd(P2P_RANK, *args, nproc=nproc),
            stdout=self._out,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            start_new_session=True,
        )
        # stderr through a thread: a file for the record, and a pattern to act on at once.
        self.matched_at: float | None = None
        self._err_lines: list[str] = []
        self._reader = threading.Thread(target=self._read_err, args=(watch, on_match))
        self._reader.start()

    def _read_err(self, watch: re.Pattern[str] | None, on_match: Any) -> None:
        assert self.proc.stderr is not None
        with open(self.err_path, "w") as log:
            for line in self.proc.stderr:
                log.write(line)
                self._err_lines.append(line)
                if watch is not None and self.matched_at is None and watch.search(line):
                    self.matched_at = time.monotonic()
                    on_match()

    @property
    def stderr(self) -> str:
        return "".join(self._err_lines)

    def pids(self, ranks_only: bool = False) -> list[int]:
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if f"CKPTCTL_P2P_JOB={self.marker}".encode() not in env:
                continue
            if ranks_only and (b"p2p_rank.py" not in cmd or b"torch.distributed.run" in cmd):
                continue
            found.append(int(d.name))
        return found

    def signal(self, sig: int, ranks_only: bool = True) -> list[int]:
        pids = self.pids(ranks_only=ranks_only)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def wait(self, timeout: float) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); fails the test (after killing the job) past `timeout`."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.name} did not end within {timeout:g}s\n{self.stderr[-4000:]}")
        self._close()
        return code, self.out_path.read_text(), self.stderr

    def kill(self) -> None:
        self.signal(signal.SIGKILL, ranks_only=False)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        self._close()

    def _close(self) -> None:
        self._reader.join(timeout=30)
        self._out.close()


def _failed_with_1(code: int, err: str) -> str:
    """torchrun's exit code is 1 for any failed rank; its report says the rank's own (a crash
    would be negative). Returns ckptctl's error line."""
    assert code == 1, err[-4000:]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", err)) == {"1"}, err[-4000:]
    lines = [line for line in err.splitlines() if re.match(r"(\[rank \d+\] )?error: ", line)]
    assert lines, err[-4000:]
    return lines[-1]


def _update_stage(summary: dict[str, Any]) -> dict[str, Any]:
    """The update stage of the rank that pushed (rank 0 leads every group here)."""
    return summary["ranks"][0]["stages"]["update"]


def _start_holder(tmp: Path, name: str, nproc: int, ckpt: Path, checkpoint_name: str) -> Any:
    """`save-metas` serving until SIGTERM; returns (job, metas file) once the file is written."""
    metas = tmp / f"{name}.json"
    job = Job(
        tmp, name, nproc,
        "save-metas", "--checkpoint-path", str(ckpt), "--metas-file", str(metas),
        "--checkpoint-name", checkpoint_name, "--json", "--timeout", str(JOB_TIMEOUT_S),
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while not metas.exists() and time.monotonic() < deadline and job.proc.poll() is None:
        time.sleep(0.2)
    if not metas.exists():
        job.kill()
        pytest.fail(f"{name}: no metas file\n{job.stderr[-4000:]}")
    time.sleep(1.0)  # rank 0 writes the file once every rank has registered
    return job, metas


@pytest.fixture(scope="module")
def holder(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Two ranks holding the checkpoint (ranks on GPUs 0 and 1), for every join below."""
    tmp = tmp_path_factory.mktemp("holder")
    job, metas = _start_holder(tmp, "holder", 2, ckpt, "p2p-held")
    yield job, metas
    if job.proc.poll() is None:
        job.kill()


def _join(
    tmp: Path, name: str, metas: Path, rx: ReceiverServer, tp: int, *extra: str, **kw: Any
) -> Job:
    return Job(
        tmp, name, tp,
        "join", "--load-metas-file", str(metas), "--endpoint", rx.endpoint,
        "--inference-parallel-size", str(tp), "--json", "--timeout", str(JOB_TIMEOUT_S), *extra,
        **kw,
    )  # fmt: skip


def _assert_bit_exact(rx: ReceiverServer, updates: int = 1) -> dict[str, Any]:
    report = rx.report()
    assert report["updates"] == updates, json.dumps(report["history"])
    assert all(h["ok"] for h in report["history"]), json.dumps(report, indent=1)[:4000]
    for w in report["workers"]:
        assert w["mismatches"] == [] and w["missing"] == [] and w["unexpected"] == []
        assert w["duplicates"] == [] and w["errors"] == [] and w["swallowed_errors"] == []
        assert w["tensors_received"] == report["expected_tensors"]
    return report


def _failed_update(rx: ReceiverServer, timeout: float = 90.0) -> dict[str, Any]:
    """The receiver's report once its (single) update has ended."""
    deadline = time.monotonic() + timeout
    while rx.report()["updates"] < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    report = rx.report()
    assert report["updates"] == 1, "the server's update never ended: its worker is stuck"
    return report


# -- it works ---------------------------------------------------------------------------------


def test_save_metas_holds_a_joinable_checkpoint(holder: Any, ckpt: Path) -> None:
    job, metas = holder
    assert job.proc.poll() is None, job.stderr[-4000:]
    r = run_script("inspect-metas", str(metas), "--checkpoint-path", str(ckpt), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    # If not: checkpoint-engine's p2p store did not start, and the holder's log says why.
    assert doc["p2p_ready"] is True, job.stderr[-4000:]
    assert doc["world_size"] == 2
    assert [x["rdma_device"] for x in doc["ranks"]] == ["tcp", "tcp"]
    addrs = [x["p2p_store_addr"] for x in doc["ranks"]]
    assert all(a.startswith("127.0.0.1:") for a in addrs) and len(set(addrs)) == 2
    assert doc["total_parameters"] == len(read_headers(ckpt))
    record(
        "p2p: save-metas holder, 2 ranks", {"p2p_store_addrs": addrs, "bytes": doc["total_bytes"]}
    )


def test_join_tp2_pulls_bit_exact(holder: Any, rx2: ReceiverServer, tmp_path: Path) -> None:
    _, metas = holder
    rx2.reset()
    job = _join(tmp_path, "join-tp2", metas, rx2, 2, "--checkpoint-name", "p2p-held")
    code, out, err = job.wait(180)
    assert code == 0, err[-4000:]
    _assert_bit_exact(rx2)
    summary = json_summary(out)
    stage = _update_stage(summary)
    record(
        "p2p: join TP2 from a 2-rank holder",
        {"wall_s": round(time.monotonic() - job.started, 2), "update": stage, "summary": summary},
    )


def test_join_tp1_pulls_bit_exact_in_many_buckets(
    holder: Any, rx1: ReceiverServer, tmp_path: Path
) -> None:
    _, metas = holder
    rx1.reset()
    job = _join(
        tmp_path, "join-tp1", metas, rx1, 1, "--checkpoint-name", "p2p-held",
        env={"PS_MAX_BUCKET_SIZE_GB": repr(32 / 1024)},
    )  # fmt: skip
    code, out, err = job.wait(180)
    assert code == 0, err[-4000:]
    _assert_bit_exact(rx1)
    summary = json_summary(out)
    record(
        "p2p: join TP1, 32 MiB buckets",
        {"wall_s": round(time.monotonic() - job.started, 2), "update": _update_stage(summary)},
    )


@pytest.mark.parametrize("method", ["p2p", "all"])
def test_update_method_bit_exact(
    method: str, ckpt: Path, rx2: ReceiverServer, tmp_path: Path
) -> None:
    rx2.reset()
    job = Job(
        tmp_path, f"update-{method}", 2,
        "update", "--checkpoint-path", str(ckpt), "--inference-parallel-size", "2",
        "--endpoint", rx2.endpoint, "--update-method", method, "--json",
        "--timeout", str(JOB_TIMEOUT_S),
    )  # fmt: skip
    code, out, err = job.wait(180)
    assert code == 0, err[-4000:]
    # `all` is the seed's: a broadcast, then p2p into the same ranks - two updates, both whole.
    _assert_bit_exact(rx2, updates=2 if method == "all" else 1)
    summary = json_summary(out)
    assert summary["update_method"] == method
    record(
        f"p2p: update --update-method {method}, TP2",
        {"wall_s": round(time.monotonic() - job.started, 2), "update": _update_stage(summary)},
    )


def test_holder_stops_on_sigterm_and_was_joinable(holder: Any) -> None:
    job, _ = holder
    assert job.signal(signal.SIGTERM), "no holder ranks found"
    code, out, err = job.wait(60)
    assert code == 0, err[-4000:]
    summary = json_summary(out)
    assert summary["joinable"] is True and summary["why_not_joinable"] is None
    assert summary["served"] == "stopped by SIGTERM"


# -- a holder that is gone, or killed mid-transfer ---------------------------------------------


def test_join_from_a_holder_that_is_gone_fails_fast(
    holder: Any, rx1: ReceiverServer, tmp_path: Path
) -> None:
    job, metas = holder
    assert job.proc.poll() is not None, "the holder should have stopped (previous test)"
    rx1.reset()
    joiner = _join(tmp_path, "join-gone", metas, rx1, 1, "--checkpoint-name", "p2p-held")
    code, out, err = joiner.wait(JOB_TIMEOUT_S + 60)
    took = time.monotonic() - joiner.started
    error = _failed_with_1(code, err)
    assert took < BOUND_S, f"the joiner took {took:.1f}s"
    assert "p2p read" in error and "127.0.0.1:" in error, err[-4000:]
    # The server's worker was told (it does not wait for the next bucket): its update ended
    # with our reason.
    report = _failed_update(rx1)
    errors = [e for w in report["workers"] for e in w["errors"]]
    assert any("p2p read" in e for e in errors), json.dumps(report, indent=1)[:4000]
    record(
        "p2p: join from a stopped holder",
        {"exit_code": code, "seconds": round(took, 2), "error": error},
    )


def test_holder_killed_mid_transfer_ends_the_joiner(
    ckpt: Path, rx1: ReceiverServer, tmp_path: Path
) -> None:
    victim, metas = _start_holder(tmp_path, "victim", 1, ckpt, "p2p-victim")
    try:
        rx1.reset()
        killed: list[float] = []

        def kill_holder() -> None:
            victim.signal(signal.SIGKILL, ranks_only=False)
            killed.append(time.monotonic())

        # checkpoint-engine logs each bucket after reading it over p2p (with --verbose): the
        # holder dies once two of the 33 buckets have come.
        joiner = _join(
            tmp_path, "join-victim", metas, rx1, 1, "--checkpoint-name", "p2p-victim",
            "--verbose",
            env={"PS_MAX_BUCKET_SIZE_GB": repr(32 / 1024)},
            watch=re.compile(r"begin to update bucket ([2-9]|\d\d+)/"), on_match=kill_holder,
        )  # fmt: skip
        code, out, err = joiner.wait(JOB_TIMEOUT_S + 60)
        ended = time.monotonic()
    finally:
        victim.kill()
    assert killed, f"the transfer never reached bucket 2\n{err[-4000:]}"
    took = ended - killed[0]
    error = _failed_with_1(code, err)
    assert took < BOUND_S, f"the joiner took {took:.1f}s after the holder died"
    assert "p2p read" in error, err[-4000:]
    report = _failed_update(rx1)
    worker = report["workers"][0]
    assert any("p2p read" in e for e in worker["errors"]), json.dumps(report, indent=1)[:4000]
    # Mid-transfer indeed: the server had loaded some tensors, not all.
    assert 0 < worker["tensors_received"] < report["expected_tensors"], worker
    record(
        "p2p: holder SIGKILLed mid-transfer",
        {
            "exit_code": code,
            "seconds_after_kill": round(took, 2),
            "tensors_received": worker["tensors_received"],
            "expected_tensors": report["expected_tensors"],
            "error": error,
        },
    )


def test_the_server_takes_updates_after_the_failed_joins(ckpt: Path, rx1: ReceiverServer) -> None:
    """The failed joins told the server's worker to stop: the next update goes through."""
    rx1.reset()
    cmd = torchrun_cmd(
        "--no-python", "ckptctl", "update", "--checkpoint-path", str(ckpt),
        "--inference-parallel-size", "1", "--endpoint", rx1.endpoint, "--json",
        "--timeout", str(JOB_TIMEOUT_S), nproc=1,
    )  # fmt: skip
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    _assert_bit_exact(rx1)
    record(
        "p2p: broadcast update after the failed joins",
        {"update": _update_stage(json_summary(r.stdout))},
    )

"""`ckptctl serve` on a real GPU: pushes of different checkpoints in a row into one receiver,
each bit-exact, and a push that fails before the transfer leaves the job serving (needs CUDA;
tests/gpu/README.md). Figures land in $CKPTCTL_GPU_RESULTS."""

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
from conftest import run_script, wait_for_path
from gpu_jobs import gpu_memory_used_mib, kill_tree, record, start_serve_job
from gpu_receiver import ReceiverServer

# GPU memory is read for the whole device (nvidia-smi): no other GPU test beside these.
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_serial]


def _checkpoint(root: Path, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        f"layers.{i}.w": torch.randn(512, 1024, generator=g).to(torch.bfloat16) for i in range(6)
    }
    tensors["norm"] = torch.randn(1024, generator=g)
    return write_real_checkpoint(root, [tensors])


# register_mode None: the default (direct, one pinned pool refilled by every push); engine:
# checkpoint-engine's own buffers, in fewer pushes (a bad path at 1, a refusal at 2).
@pytest.mark.parametrize(
    ("register_mode", "pushes", "bad_at", "refused_at"), [(None, 10, 4, 6), ("engine", 4, 1, 2)]
)
def test_ten_pushes_in_a_row_each_bit_exact(
    tmp_path: Path,
    short_tmp: Path,
    register_mode: str | None,
    pushes: int,
    bad_at: int,
    refused_at: int,
) -> None:
    ckpts = [_checkpoint(tmp_path / f"ck{i}", seed=i) for i in range(3)]
    sock = str(short_tmp / "serve.sock")
    log = short_tmp / "serve.log"
    with ReceiverServer(ckpts[0], [0]) as rx:
        job = start_serve_job(
            rx.endpoint,
            sock,
            log,
            "--push-timeout",
            "120",
            *(["--register-mode", register_mode] if register_mode else []),
        )
        try:
            deadline = time.monotonic() + 120
            while not os.path.exists(sock) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert os.path.exists(sock)
            seconds = []
            # The last pushes of the default mode are read ahead first (`ckptctl stage`).
            stage_from = 7 if register_mode is None else pushes
            for i in range(pushes):
                ck = ckpts[i % 3]
                rx.set_config(verify_against=str(ck))
                if i >= stage_from:
                    _stage(sock, ck)
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
                if i >= stage_from:  # sent from the buffers read ahead
                    assert all(rank["staged"] for rank in json.loads(r.stdout)["ranks"])
                report = rx.report()
                assert report["ok"] and report["weight_version"] == f"v{i}"
                assert all(not w["mismatches"] and not w["missing"] for w in report["workers"])
                if i == bad_at:  # a push that fails before the transfer: the job goes on
                    bad = run_script(
                        "push",
                        "--control-socket",
                        sock,
                        "--checkpoint-path",
                        str(tmp_path / "nope"),
                        timeout=60,
                    )
                    assert bad.returncode == 3
                if (
                    i == refused_at
                ):  # the server refuses (HTTP 400): the push fails, the job goes on
                    gpu_before_refusal = gpu_memory_used_mib()
                    rx.set_config(refuse="IPC weight update failed: busy")
                    refused = run_script(
                        "push", "--control-socket", sock, "--checkpoint-path", str(ck), timeout=120
                    )
                    rx.set_config(refuse=None)
                    assert refused.returncode == 1, refused.stderr
                    assert "refused the update: HTTP 400" in refused.stderr
                if i == refused_at + 1:  # the refused push's IPC buffer was given back
                    grown = gpu_memory_used_mib() - gpu_before_refusal
                    assert grown < 1024, f"GPU memory grew by {grown} MiB after a refused push"
            with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=10) as client:
                client.post("http://serve/stop")
            job.wait(timeout=60)
        finally:
            if job.poll() is None:
                kill_tree(job)
    assert job.returncode == 0, log.read_text()[-3000:]
    record(f"serve: {pushes} pushes, {register_mode or 'direct'}", {"push_seconds": seconds})


def _stage(sock: str, ck: Path) -> None:
    """`ckptctl stage` of `ck`, then wait until the job has read it ahead."""
    r = run_script(
        "stage", "--control-socket", sock, "--checkpoint-path", str(ck), "--json", timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    deadline = time.monotonic() + 120
    while True:
        status = run_script("status", "--control-socket", sock, "--json", timeout=30)
        staged = json.loads(status.stdout).get("staged")
        if staged and staged["read"]:
            return
        assert time.monotonic() < deadline, f"the staged read did not finish: {staged}"
        time.sleep(0.2)


def _wait_for_memory_back(baseline_mib: int, slack_mib: int = 1024, timeout: float = 20) -> int:
    """GPU 0's used memory once it is back within `slack_mib` of `baseline_mib` (or the last
    reading when the deadline passes: the caller's assertion then says by how much)."""
    deadline = time.monotonic() + timeout
    used = gpu_memory_used_mib()
    while used - baseline_mib >= slack_mib and time.monotonic() < deadline:
        time.sleep(0.5)
        used = gpu_memory_used_mib()
    return used


def test_failed_pushes_give_their_gpu_memory_back(tmp_path: Path, short_tmp: Path) -> None:
    """Issue 13: a refused push kept checkpoint-engine's transfer buffers (24 GiB with the
    default bucket) alive through its exception. After each kind of failed push the GPU's
    memory is back within 1 GiB of where it was, and 20 refusals in a row leave it flat."""
    good = _checkpoint(tmp_path / "good", seed=1)
    late = tmp_path / "late"  # plans fine, fails when this torch has to represent it
    late.mkdir()
    from ckpt_factory import write_raw

    write_raw(
        late / "model.safetensors",
        {"w": {"dtype": "F6_E2M3", "shape": [8], "data_offsets": [0, 6]}},
        data_len=6,
    )
    sock = str(short_tmp / "serve.sock")
    log = short_tmp / "serve.log"
    figures: dict[str, object] = {}
    with ReceiverServer(good, [0]) as rx:
        job = start_serve_job(rx.endpoint, sock, log, "--push-timeout", "120")
        try:
            assert wait_for_path(sock, timeout=120), "the serve job never opened its socket"

            def push(path: Path, expect: int) -> None:
                r = run_script(
                    "push", "--control-socket", sock, "--checkpoint-path", str(path), timeout=180
                )
                assert r.returncode == expect, r.stdout + r.stderr

            push(good, 0)  # the job's steady state: one checkpoint registered and served
            baseline = gpu_memory_used_mib()
            figures["baseline_mib"] = baseline
            rx.set_config(refuse="IPC weight update failed: busy")
            after_refusals = []
            for _ in range(20):
                push(good, 1)
                after_refusals.append(_wait_for_memory_back(baseline) - baseline)
            rx.set_config(refuse=None)
            figures["grown_after_each_refusal_mib"] = after_refusals
            assert max(after_refusals) < 1024, f"GPU memory grew after refusals: {after_refusals}"

            push(late, 3)  # a bad checkpoint found only when registering it
            grown_late = _wait_for_memory_back(baseline) - baseline
            figures["grown_after_bad_checkpoint_mib"] = grown_late
            assert grown_late < 1024, f"GPU memory grew by {grown_late} MiB after exit 3"

            rx.set_config(verify_against=str(good))
            push(good, 0)  # and the job still serves, bit-exact
            report = rx.report()
            assert report["ok"], report
            assert all(not w["mismatches"] and not w["missing"] for w in report["workers"])
            with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=10) as client:
                client.post("http://serve/stop")
            job.wait(timeout=60)
        finally:
            if job.poll() is None:
                kill_tree(job)
    assert job.returncode == 0, log.read_text()[-3000:]
    record("serve: failed pushes give GPU memory back", figures)


def test_a_push_failing_in_bucket_1_is_partial_and_the_next_push_makes_it_whole(
    tmp_path: Path, short_tmp: Path
) -> None:
    """Issue 14 item 9 on a GPU: the receiver's worker raises in bucket 1 (after it connected
    and loaded bucket 0), so the server holds a mix. The push fails (exit 1) saying so, its JSON
    and `status` say "partial", the job keeps serving, and the next push of the same checkpoint
    is bit-exact and `status` says "whole" again."""
    ckpts = [_checkpoint(tmp_path / f"ck{i}", seed=20 + i) for i in range(2)]
    sock = str(short_tmp / "serve.sock")
    log = short_tmp / "serve.log"
    with ReceiverServer(ckpts[0], [0]) as rx:
        # 1 MiB buckets: the 1 MiB tensors of _checkpoint take several.
        job = start_serve_job(
            rx.endpoint, sock, log, "--push-timeout", "120", "--bucket-size-gb", "0.001"
        )

        def push(ck: Path, version: str) -> subprocess.CompletedProcess[str]:
            return run_script(
                "push", "--control-socket", sock, "--checkpoint-path", str(ck),
                "--weight-version", version, "--json", "--wait", "120", timeout=300,
            )  # fmt: skip

        def status() -> dict:
            r = run_script("status", "--control-socket", sock, "--json", timeout=30)
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout)

        try:
            first = push(ckpts[0], "v1")
            assert first.returncode == 0, first.stdout + first.stderr
            assert rx.report()["ok"]

            rx.set_config(fail_bucket=1, verify_against=str(ckpts[1]))
            broken = push(ckpts[1], "v2")
            assert broken.returncode == 1, broken.stdout + broken.stderr
            doc = json.loads(broken.stdout)
            assert doc["server_weights"] == "partial", doc
            assert "partly updated weights" in broken.stderr
            assert rx.report()["ok"] is False
            st = status()
            assert st["server_weights"] == "partial" and st["state"] == "idle", st
            assert job.poll() is None, "a worker's error must not end the serve job"

            rx.set_config(fail_bucket=None)
            again = push(ckpts[1], "v3")
            assert again.returncode == 0, again.stdout + again.stderr
            report = rx.report()
            assert report["ok"] and report["weight_version"] == "v3"
            assert all(not w["mismatches"] and not w["missing"] for w in report["workers"])
            st = status()
            assert st["server_weights"] == "whole"
            assert st["weights"]["checkpoint_path"] == str(ckpts[1].resolve())
            assert st["weights"]["weight_version"] == "v3"

            stop = run_script("stop", "--control-socket", sock, "--wait", "60", timeout=90)
            assert stop.returncode == 0, stop.stderr
            job.wait(timeout=60)
        finally:
            if job.poll() is None:
                kill_tree(job)
    assert job.returncode == 0, log.read_text()[-3000:]


def test_a_paused_push_into_a_generating_server_is_bit_exact(
    tmp_path: Path, short_tmp: Path
) -> None:
    """Issue 35 on a GPU: four generations in flight hold the receiver's model-update reader
    lock; `serve --pause retract` retracts them, the push loads bit-exact, and they go on after
    the resume (none lost); `push --pause in_place` holds them instead, without the cache
    flush SGLang would refuse."""
    from fake_generation import in_flight

    ck = _checkpoint(tmp_path / "ck", seed=35)
    sock, log = str(short_tmp / "serve.sock"), short_tmp / "serve.log"
    with ReceiverServer(ck, [0]) as rx:
        gen = rx.behaviour.generations()
        job = start_serve_job(rx.endpoint, sock, log, "--push-timeout", "120", "--pause", "retract")
        try:
            assert wait_for_path(sock, timeout=120), "the serve job never opened its socket"
            rx.set_config(verify_against=str(ck))
            for i, (mode, count) in enumerate((("retract", "retracted"), ("in_place", "held"))):
                with in_flight(rx.endpoint, gen, 4):
                    r = run_script(
                        "push", "--control-socket", sock, "--checkpoint-path", str(ck),
                        "--weight-version", f"v{i}", "--pause", mode, "--json", timeout=180,
                    )  # fmt: skip
                    assert r.returncode == 0, r.stdout + r.stderr
                    snapshot = gen.snapshot()
                    assert snapshot[count] == 4 and snapshot["running"] == 4, snapshot
                    assert not snapshot["paused"]
                report = rx.report()
                assert report["ok"] and report["weight_version"] == f"v{i}", report
                assert all(not w["mismatches"] and not w["missing"] for w in report["workers"])
                stages = json.loads(r.stdout)["ranks"][0]["figures"]["stages"]
                record(f"serve: a push with --pause {mode}, 4 generations in flight", stages)
            assert gen.snapshot()["completed"] == 8 and gen.snapshot()["aborted"] == 0
            stop = run_script("stop", "--control-socket", sock, "--timeout", "60", timeout=90)
            assert stop.returncode == 0, stop.stderr
            job.wait(timeout=60)
        finally:
            if job.poll() is None:
                kill_tree(job)
    assert job.returncode == 0, log.read_text()[-3000:]

"""`ckptctl update --verify` / `--verify-round-trip` on real GPUs: checkpoint-engine's
ParameterServer pushes into the test receiver (tests/support/gpu_receiver.py), whose workers load
through `checkpoint_engine.worker.update_weights_from_ipc` and answer SGLang's weights checker
over the parameters on their GPUs. A receiver that silently drops or corrupts one tensor (HTTP
200 all the same) must make `--verify` fail with exit 1, naming that tensor.

    python -m pytest -m gpu tests/gpu/test_gpu_verify.py      (2 GPUs for the TP2 and two-server cases)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from ckpt_factory import mixed_tensors, write_real_checkpoint
from gpu_jobs import (
    big_tensors,
    json_summary,
    kill_tree,
    needs_two,
    record,
    start_serve_job,
    torchrun_update,
)
from gpu_receiver import ReceiverServer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]  # several torchruns per test

LOST = "model.layers.1.mlp.up_proj.weight"  # 1 MiB, in the middle of a bucket
FLIPPED = "fp8_e4m3"  # a small one


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two shards: every dtype (0-dim and empty tensors too) and a few MB of bf16."""
    return write_real_checkpoint(
        tmp_path_factory.mktemp("verify"), [mixed_tensors(seed=7), big_tensors(8)]
    )


def _update(rx_endpoints: list[str], ckpt: Path, *flags: str, tp: int = 1) -> tuple[int, str, str]:
    args = ["--checkpoint-path", str(ckpt), "--inference-parallel-size", str(tp), "--json"]
    for endpoint in rx_endpoints:
        args += ["--endpoint", endpoint]
    code, out, err, _ = torchrun_update(
        tp * len(rx_endpoints), *args, "--bucket-size-gb", "0.001", *flags
    )
    return code, out, err


def _failed(code: int, out: str, err: str, *names: str) -> dict[str, Any]:
    doc = json_summary(out)
    assert code != 0 and doc["exit_code"] == 1, err[-3000:]
    for name in names:
        assert name in doc["error"], doc["error"]
    return doc


def _mismatches(rx: ReceiverServer) -> list[list[str]]:
    """What the receiver's own bit-for-bit check found on each GPU (proves the injection)."""
    return [w["mismatches"] for w in rx.report()["workers"]]


def test_compare_checksum_tp1_proves_every_tensor_and_names_a_lost_or_flipped_one(
    ckpt: Path,
) -> None:
    with ReceiverServer(ckpt, [0], profile="sglang-pr17009") as rx:
        code, out, err = _update([rx.endpoint], ckpt, "--verify")
        assert code == 0, err[-3000:]
        doc = json_summary(out)
        assert doc["verified"] == "checksum"
        assert doc["verification"]["tensor_count"] == len(rx.headers)
        record("verify-checksum-tp1", {"verification": doc["verification"]})

        rx.set_config(drop_tensor=LOST)
        _failed(*_update([rx.endpoint], ckpt, "--verify"), LOST)
        assert _mismatches(rx) == [[LOST]]

        rx.set_config(drop_tensor=None, corrupt_tensor=FLIPPED)
        _failed(*_update([rx.endpoint], ckpt, "--verify"), FLIPPED)
        assert _mismatches(rx) == [[FLIPPED]]


def test_released_sglang_with_one_server_cannot_verify_and_pushes_nothing(ckpt: Path) -> None:
    with ReceiverServer(ckpt, [0], profile="sglang-0.5.23") as rx:
        code, out, err = _update([rx.endpoint], ckpt, "--verify")
        assert code != 0 and json_summary(out)["exit_code"] == 3, err[-3000:]
        assert "this job feeds one server" in err
        assert rx.report()["updates"] == 0


def test_round_trip_tp1_passes_then_names_a_lost_tensor(ckpt: Path) -> None:
    flags = ("--verify-round-trip", "--reset-served-weights")
    with ReceiverServer(ckpt, [0], profile="sglang-0.5.23") as rx:
        code, out, err = _update([rx.endpoint], ckpt)  # "started from" the checkpoint
        assert code == 0, err[-3000:]
        code, out, err = _update([rx.endpoint], ckpt, *flags)
        assert code == 0, err[-3000:]
        doc = json_summary(out)
        assert doc["verified"] == "round-trip"
        record("verify-round-trip-tp1", {"verification": doc["verification"]})

        rx.set_config(drop_tensor=LOST)
        _failed(*_update([rx.endpoint], ckpt, *flags), LOST)


@needs_two
def test_compare_checksum_tp2_names_a_lost_tensor(ckpt: Path) -> None:
    with ReceiverServer(ckpt, [0, 1], profile="sglang-pr17009") as rx:
        code, out, err = _update([rx.endpoint], ckpt, "--verify", tp=2)
        assert code == 0, err[-3000:]
        assert json_summary(out)["verified"] == "checksum"
        rx.set_config(drop_tensor=LOST)
        _failed(*_update([rx.endpoint], ckpt, "--verify", tp=2), LOST)
        assert _mismatches(rx) == [[LOST], [LOST]]


@needs_two
def test_two_servers_agree_per_engine_and_a_corrupting_one_is_named(ckpt: Path) -> None:
    with (
        ReceiverServer(ckpt, [0], profile="sglang-0.5.23") as a,
        ReceiverServer(ckpt, [1], profile="sglang-0.5.23") as b,
    ):
        code, out, err = _update([a.endpoint, b.endpoint], ckpt, "--verify")
        assert code == 0, err[-3000:]
        doc = json_summary(out)
        assert doc["verified"] == "per-engine" and doc["verification"]["server_count"] == 2
        record("verify-per-engine-2x-tp1", {"verification": doc["verification"]})

        b.set_config(corrupt_tensor=FLIPPED)
        failed = _failed(*_update([a.endpoint, b.endpoint], ckpt, "--verify"), FLIPPED)
        assert "hold different weights" in failed["error"]
        assert _mismatches(a) == [[]] and _mismatches(b) == [[FLIPPED]]


def test_push_verify_through_a_serve_job_names_a_lost_tensor_and_keeps_serving(
    ckpt: Path, short_tmp: Path
) -> None:
    """`push --verify` (here through ckptctl.client, as a training loop would call it): the
    serve job proves each push with compare_checksum; a push whose tensor the server lost
    fails with its name (exit 1's exception) and the job goes on serving."""

    from conftest import wait_for_path

    from ckptctl import client
    from ckptctl.errors import OperationFailed

    sock = str(short_tmp / "serve.sock")
    log = short_tmp / "serve.log"
    with ReceiverServer(ckpt, [0], profile="sglang-pr17009") as rx:
        job = start_serve_job(
            rx.endpoint, sock, log, "--push-timeout", "120", "--bucket-size-gb", "0.001"
        )
        try:
            assert wait_for_path(sock, timeout=120), "the serve job never opened its socket"
            first = client.push(ckpt, verify=True, control_socket=sock, wait=60, timeout=240)
            assert first["verified"] == "checksum", first
            assert first["verification"]["tensor_count"] == len(rx.headers)

            rx.set_config(drop_tensor=LOST)
            with pytest.raises(OperationFailed, match=LOST.replace(".", r"\.")):
                client.push(ckpt, verify=True, control_socket=sock, timeout=240)
            assert _mismatches(rx) == [[LOST]]

            rx.set_config(drop_tensor=None)
            again = client.push(ckpt, verify=True, control_socket=sock, timeout=240)
            assert again["verified"] == "checksum" and again["server_weights"] == "whole"
            record("push-verify-checksum-tp1", {"verification": again["verification"]})
            client.stop(control_socket=sock, wait=60)
            job.wait(timeout=60)
        finally:
            if job.poll() is None:
                kill_tree(job)  # torchrun and its rank, which has a session of its own
    assert job.returncode == 0, log.read_text()[-3000:]

"""The GPU receiver's parts that run without CUDA, through real HTTP: a receiver with no GPU
workers still serves its control routes, refuses, never connects, and reads checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import wait_until
from gpu_receiver import ReceiverConfig, ReceiverServer, read_headers
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parents[1] / "support"
HANDLES = {"GPU-00000000-0000-0000-0000-000000000000": "ipc://@nobody-listens.sock"}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    save_file(
        {
            "a.bf16": torch.ones(4, 8, dtype=torch.bfloat16),
            "b.fp8": torch.zeros(16, dtype=torch.float8_e4m3fn),
            "c.scalar": torch.tensor(2.5),
        },
        str(tmp_path / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"d.mask": torch.ones(3, 5, dtype=torch.bool), "e.pos": torch.arange(10)},
        str(tmp_path / "model-00002-of-00002.safetensors"),
    )
    return tmp_path


@pytest.fixture
def rx(ckpt: Path) -> Iterator[ReceiverServer]:
    with ReceiverServer(ckpt, devices=[]) as server:
        yield server


def _update(endpoint: str, **kw: object) -> httpx.Response:
    body = {"zmq_handles": HANDLES, "flush_cache": True, "weight_version": "v1"}
    return httpx.post(f"{endpoint}/update_weights_from_ipc", json=body, timeout=10, **kw)


def test_headers_cover_every_dtype_and_shape_without_torch_loading(ckpt: Path) -> None:
    h = read_headers(ckpt)
    assert sorted(h) == ["a.bf16", "b.fp8", "c.scalar", "d.mask", "e.pos"]
    assert h["a.bf16"] == {**h["a.bf16"], "dtype": "BF16", "shape": [4, 8], "nbytes": 64}
    assert (h["b.fp8"]["dtype"], h["b.fp8"]["nbytes"]) == ("F8_E4M3", 16)
    assert (h["c.scalar"]["shape"], h["c.scalar"]["nbytes"]) == ([], 4)
    assert (h["d.mask"]["dtype"], h["e.pos"]["dtype"]) == ("BOOL", "I64")


def test_a_tensor_in_two_shards_is_an_error(tmp_path: Path) -> None:
    save_file({"x": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="'x' is in both"):
        read_headers(tmp_path)


def test_report_before_any_update(rx: ReceiverServer) -> None:
    doc = httpx.get(f"{rx.endpoint}/receiver/report", timeout=5).json()
    assert doc["expected_tensors"] == 5
    assert doc["expected_bytes"] == 64 + 16 + 4 + 15 + 80
    assert doc["updates"] == 0 and doc["ok"] is None and doc["history"] == []
    assert doc["workers"] == [] and doc["weight_version"] == "default"
    assert doc["config"] == json.loads(json.dumps(ReceiverConfig().__dict__))


def test_config_round_trip_and_rejects_unknown_keys(rx: ReceiverServer) -> None:
    r = httpx.post(f"{rx.endpoint}/receiver/config", json={"fail_bucket": -1}, timeout=5)
    assert r.status_code == 200 and r.json()["fail_bucket"] == -1
    assert httpx.get(f"{rx.endpoint}/receiver/config", timeout=5).json()["fail_bucket"] == -1
    bad = httpx.post(f"{rx.endpoint}/receiver/config", json={"fail_bukket": 1}, timeout=5)
    assert bad.status_code == 400 and "fail_bukket" in bad.json()["error"]
    assert httpx.post(f"{rx.endpoint}/receiver/config", json=[1], timeout=5).status_code == 400


def test_refuse_answers_400_like_sglang_and_records_nothing(rx: ReceiverServer) -> None:
    httpx.post(f"{rx.endpoint}/receiver/config", json={"refuse": "not today"}, timeout=5)
    r = _update(rx.endpoint)
    assert r.status_code == 400
    assert r.json() == {"success": False, "message": "not today"}
    assert httpx.get(f"{rx.endpoint}/ping", timeout=5).status_code == 503  # still no weights
    assert rx.report()["weight_version"] == "default"
    httpx.post(f"{rx.endpoint}/receiver/config", json={"refuse": None}, timeout=5)
    assert _update(rx.endpoint).json()["message"] != "not today"


def test_without_workers_an_update_fails_cleanly(rx: ReceiverServer) -> None:
    r = _update(rx.endpoint)
    assert r.status_code == 400
    assert r.json() == {
        "success": False,
        "message": "IPC weight update failed: this receiver has no GPU workers",
    }
    doc = rx.report()
    assert doc["updates"] == 1 and doc["ok"] is False
    assert doc["history"][0]["http_ok"] is False


def test_never_connect_answers_200_late_and_reset_clears(rx: ReceiverServer) -> None:
    rx.set_config(never_connect=True, never_connect_answer_after_s=0.3)
    t0 = time.monotonic()
    r = _update(rx.endpoint)
    assert time.monotonic() - t0 >= 0.3
    assert r.status_code == 200 and r.json()["success"] is True  # the lying server
    assert httpx.get(f"{rx.endpoint}/ping", timeout=5).status_code == 200
    doc = rx.report()
    assert doc["weight_version"] == "v1" and doc["history"][0]["http_ok"] is True
    assert httpx.post(f"{rx.endpoint}/receiver/reset", timeout=5).json() == {"success": True}
    assert rx.report()["history"] == []


def test_never_connect_forever_is_released_by_stop(ckpt: Path) -> None:
    server = ReceiverServer(ckpt, devices=[], config=ReceiverConfig(never_connect=True)).start()
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.endpoint}/update_weights_from_ipc",
                json={"zmq_handles": HANDLES},
                timeout=0.5,
            )
    finally:
        server.stop()
    # The update held by never_connect is let go (not left to hang in its thread).
    wait_until(
        lambda: [h["message"] for h in server.report()["history"]] == ["receiver is stopping"],
        what="the held update to end",
    )


def test_api_key_guards_the_update_not_the_control_routes(ckpt: Path) -> None:
    with ReceiverServer(ckpt, devices=[], api_key="s3cret") as server:
        assert _update(server.endpoint).status_code == 401
        assert httpx.get(f"{server.endpoint}/receiver/report", timeout=5).status_code == 200
        r = _update(server.endpoint, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 400  # authorised; fails only for want of GPU workers


def test_vllm_profile_refuses_with_its_own_shape(ckpt: Path) -> None:
    with ReceiverServer(ckpt, devices=[], profile="vllm") as server:
        server.set_config(refuse="dev mode is off")
        body = {"method": "update_weights_from_ipc", "args": [HANDLES]}
        r = httpx.post(f"{server.endpoint}/collective_rpc", json=body, timeout=5)
        assert r.status_code == 400 and r.json() == {"error": "dev mode is off"}
        server.set_config(refuse=None)
        r = httpx.post(f"{server.endpoint}/collective_rpc", json=body, timeout=5)
        assert r.status_code == 500 and "no GPU workers" in r.json()["error"]


def test_command_line_on_a_unix_socket_prints_ready_and_refuses(
    ckpt: Path, short_tmp: Path
) -> None:
    uds = str(short_tmp / "rx.sock")
    cmd = [sys.executable, str(HERE / "gpu_receiver.py"), "--checkpoint-path", str(ckpt)]
    cmd += ["--devices", "", "--uds", uds, "--refuse", "busy", "--fail-bucket", "-1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"READY unix:{uds}"
        with httpx.Client(transport=httpx.HTTPTransport(uds=uds), timeout=5) as c:
            r = c.post("http://localhost/update_weights_from_ipc", json={"zmq_handles": HANDLES})
            assert (r.status_code, r.json()["message"]) == (400, "busy")
            cfg = c.get("http://localhost/receiver/report").json()["config"]
            assert (cfg["refuse"], cfg["fail_bucket"]) == ("busy", -1)
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    assert not os.path.exists(uds)


def test_a_worker_that_cannot_start_fails_start_up_with_its_reason(ckpt: Path) -> None:
    # Device 999 exists nowhere (and there is no CUDA at all on CPU machines): the spawned
    # worker reports why, and start() raises and leaves nothing running.
    server = ReceiverServer(ckpt, devices=[999], startup_timeout_s=60)
    with pytest.raises(RuntimeError, match="worker for GPU 999 failed to start"):
        server.start()
    assert server._procs == []

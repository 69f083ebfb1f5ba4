"""p2p without a GPU: what the p2p GPU tests (tests/gpu/test_gpu_p2p.py) and ckptctl's handling of a
failed p2p read rely on.

- A failed read ends the transfer: the server's worker gets checkpoint-engine's own abort
  message over a real zmq REQ/REP pair, and the failure names the holder.
- The test job's TCP override (tests/support/p2p_rank.py) still works with the installed
  checkpoint-engine: its device name comes from PS_P2P_STORE_RDMA_DEVICES, its address from
  `get_ip` in the modules that use it, and ckptctl's `p2p_missing()` accepts it.
- Where mooncake loads (not in CI: see tests/gpu/README.md, "p2p"), checkpoint-engine's real
  P2PStore reads another process's host memory over mooncake's TCP transport, and a read from a
  holder that is gone is reported, not hung.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from p2p_rank import LOOPBACK, P2P_TCP_ENV, use_loopback

from ckptctl.ce.p2p import (
    p2p_missing,
    prefer_system_unwinder,
    watch_p2p_reads,
)
from ckptctl.ce.transfer_sockets import ReplyWatchingSocket
from ckptctl.errors import OperationFailed

PROBE = Path(__file__).resolve().parents[1] / "support" / "p2p_tcp_probe.py"


# -- a failed read ends the transfer -----------------------------------------------------------


class Worker:
    """The server's side of checkpoint-engine's IPC protocol (checkpoint_engine.worker), minus
    CUDA: take the handle, answer it, then take what comes next."""

    def __init__(self, endpoint: str, answer_handle: bool = True) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.answer_handle = answer_handle
        self.got: list[Any] = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            self.got.append(self.sock.recv_pyobj())  # the IPC handle
            if not self.answer_handle:
                return
            self.sock.send(b"")
            self.got.append(self.sock.recv_pyobj())  # a bucket, None, or an exception
        except zmq.ZMQError as exc:
            self.got.append(exc)
        finally:
            self.sock.close()
            self.ctx.term()


@pytest.fixture
def req() -> Any:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.bind(f"ipc://@ckptctl-test-{uuid.uuid4().hex}")
    watched = ReplyWatchingSocket(sock, timeout_ms=10_000)
    yield watched
    sock.close(linger=0)
    ctx.term()


def test_abort_hands_the_worker_an_exception_it_raises(req: ReplyWatchingSocket) -> None:
    worker = Worker(req.endpoint)
    req.send_pyobj(("rebuild_cuda_tensor", "stand-in handle"))  # what the PS sends first
    assert req.abort("p2p read of 5 bytes from the holder at 127.0.0.1:1 failed")
    worker.thread.join(timeout=20)
    assert not worker.thread.is_alive()
    assert worker.got[0] == ("rebuild_cuda_tensor", "stand-in handle")
    assert isinstance(worker.got[1], RuntimeError)
    assert (
        str(worker.got[1]) == "ckptctl: p2p read of 5 bytes from the holder at 127.0.0.1:1 failed"
    )
    assert req.errors == []  # the worker's answer to the handle was a plain b""


def test_abort_before_any_worker_took_part_sends_nothing(req: ReplyWatchingSocket) -> None:
    assert req.abort("nothing to end") is False


def test_abort_gives_up_on_a_worker_that_never_answers(req: ReplyWatchingSocket) -> None:
    worker = Worker(req.endpoint, answer_handle=False)
    req.send_pyobj("handle")
    assert req.abort("the holder is gone", timeout_s=0.5) is False
    worker.thread.join(timeout=20)


def test_a_failed_read_aborts_the_worker_then_fails_the_job(req: ReplyWatchingSocket) -> None:
    """ParameterServerSession's glue: the worker first (so that the server stays usable), then
    the watchdog (exit 1)."""
    from ckptctl.ce import ParameterServerSession

    session = object.__new__(ParameterServerSession)  # its constructor needs CUDA
    failures: list[tuple[int, str]] = []
    session.sockets = [req]
    session._on_failure = lambda code, message: failures.append((code, message))
    worker = Worker(req.endpoint)
    req.send_pyobj("handle")
    session._p2p_read_failed("p2p read of 1 bytes from the holder at 127.0.0.1:2 failed")
    worker.thread.join(timeout=20)
    assert isinstance(worker.got[1], RuntimeError)
    assert failures == [(1, "p2p read of 1 bytes from the holder at 127.0.0.1:2 failed")]


class FailingEngine:
    """Where mooncake's TransferEngine would be: its batch read returns its failure code."""

    def __init__(self, ret: int) -> None:
        self.ret = ret
        self.reads: list[tuple[Any, ...]] = []

    def batch_transfer_sync_read(self, *args: Any) -> int:
        self.reads.append(args)
        return self.ret


def _store_with(engine: Any) -> Any:
    """checkpoint-engine's own P2PStore, whose read we wrap, around `engine`."""
    from checkpoint_engine.p2p_store import P2PStore

    store = object.__new__(P2PStore)
    store.engine = engine
    return store


def test_a_failed_read_is_reported_with_the_holder_then_raised() -> None:
    store = _store_with(FailingEngine(-1))
    reported: list[str] = []
    watch_p2p_reads(store, reported.append)
    with pytest.raises(OperationFailed) as info:
        store.batch_transfer_sync_read("127.0.0.1:15001", [1, 2], [3, 4], [100, 28])
    assert reported == [str(info.value)]
    assert "p2p read of 128 bytes from the holder at 127.0.0.1:15001 failed" in reported[0]
    assert "the holder is gone" in reported[0]


def test_a_good_read_passes_through() -> None:
    engine = FailingEngine(0)
    store = _store_with(engine)
    reported: list[str] = []
    watch_p2p_reads(store, reported.append)
    store.batch_transfer_sync_read("127.0.0.1:15001", [1], [3], [100])
    assert reported == [] and engine.reads == [("127.0.0.1:15001", [1], [3], [100])]


# -- what the test job's TCP override relies on ---------------------------------------------------


def cudaless_device_manager(gpus: int) -> Any:
    """checkpoint-engine's own DeviceManager, its methods as they are, without CUDA detection."""
    from checkpoint_engine.device_utils import DeviceManager

    dm = object.__new__(DeviceManager)
    dm.device_type = "cuda"
    dm.device_module = SimpleNamespace(device_count=lambda: gpus)
    return dm


def test_the_device_name_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PS_P2P_STORE_RDMA_DEVICES", P2P_TCP_ENV["PS_P2P_STORE_RDMA_DEVICES"])
    monkeypatch.delenv("NCCL_IB_HCA", raising=False)
    dm = cudaless_device_manager(gpus=2)
    assert [dm.rdma_device(rank) for rank in (0, 1)] == ["tcp", "tcp"]
    if not Path("/sys/class/infiniband").exists():
        # What P2PStore hands mooncake as the protocol; mooncake 0.3.x ignores it.
        assert dm.transfer_engine_protocol == "rdma"


def test_the_address_lookup_can_be_pointed_at_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    import checkpoint_engine.device_utils as device_utils
    import checkpoint_engine.p2p_store as p2p_store
    import checkpoint_engine.ps as ps

    for module in (device_utils, p2p_store, ps):
        monkeypatch.setattr(module, "get_ip", module.get_ip)  # restored afterwards
    use_loopback()
    assert {m.get_ip() for m in (device_utils, p2p_store, ps)} == {LOOPBACK}
    # P2PStore and gather_metas look it up among their module's globals when they run.
    assert "get_ip" in p2p_store.P2PStore.__init__.__code__.co_names
    assert "get_ip" in ps.ParameterServer.gather_metas.__code__.co_names


def test_ckptctl_accepts_the_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))  # a findable mooncake (find_spec only)
    for name in ("mooncake", "mooncake.engine"):  # blocked by an in-process update, maybe
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("PS_P2P_STORE_RDMA_DEVICES", raising=False)
    monkeypatch.delenv("NCCL_IB_HCA", raising=False)
    if not list(Path("/sys/class/infiniband").glob("*")):
        assert "no RDMA device" in (p2p_missing() or "")
    monkeypatch.setenv("PS_P2P_STORE_RDMA_DEVICES", "tcp")
    assert p2p_missing() is None


# -- real mooncake, where it loads ---------------------------------------------------------------


def _mooncake_loads() -> bool:
    """In a child process: loading it here would change how this process unwinds."""
    if importlib.util.find_spec("mooncake") is None:
        return False
    child = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True)
    return child.returncode == 0


needs_mooncake = pytest.mark.skipif(
    not _mooncake_loads(),
    reason="mooncake-transfer-engine does not load here (tests/gpu/README.md)",
)


@needs_mooncake
def test_the_tcp_probe_moves_host_memory_between_processes() -> None:
    r = subprocess.run(
        [sys.executable, str(PROBE), "--mib", "16"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


@needs_mooncake
def test_p2p_store_reads_a_holder_over_tcp_then_reports_it_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """checkpoint-engine's P2PStore as the test job makes it: its device from the environment,
    its address on loopback, mooncake on TCP; a holder process serving random bytes."""
    import torch
    from checkpoint_engine.p2p_store import P2PStore

    prefer_system_unwinder()  # what ParameterServerSession does first (torch and zmq are loaded)
    for key, value in {**P2P_TCP_ENV, "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    import checkpoint_engine.p2p_store as p2p_store

    monkeypatch.setattr(p2p_store, "get_ip", lambda: LOOPBACK)
    holder = subprocess.Popen(
        [sys.executable, str(PROBE), "--holder", str(8 << 20)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout is not None
        _, target, rptr, n, digest = holder.stdout.readline().split()
        store = P2PStore(cudaless_device_manager(gpus=1))
        assert store.addr.startswith(f"{LOOPBACK}:") and store.device == "tcp"
        buf = torch.zeros(int(n), dtype=torch.uint8)
        store.register_named_tensors({"buf": buf})
        reported: list[str] = []
        watch_p2p_reads(store, reported.append)
        store.batch_transfer_sync_read(target, [buf.data_ptr()], [int(rptr)], [int(n)])
        got = ctypes.string_at(buf.data_ptr(), int(n))
        assert hashlib.sha256(got).hexdigest() == digest
        holder.kill()
        holder.wait(timeout=30)
        with pytest.raises(OperationFailed, match=f"from the holder at {target} failed"):
            store.batch_transfer_sync_read(target, [buf.data_ptr()], [int(rptr)], [int(n)])
        assert len(reported) == 1
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=30)

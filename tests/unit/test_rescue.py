"""Ending a transfer whose server never connected, with real zmq sockets as checkpoint-engine
uses them (a REQ bound to an abstract ipc address, pickled messages): the blocked sender gets
an error reply and goes on; nothing it sends is ever unpickled by us."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import zmq
from conftest import wait_until

from ckptctl.ce.transfer_sockets import (
    RESCUE_PREFIX,
    ReplyWatchingSocket,
    TransferSockets,
    rescue,
)


def _ps_side(ctx: zmq.Context, address: str, seen: dict, bound: Any = None) -> None:
    """What `_update_per_bucket` does: send the handle, read a reply, send the abort.
    `bound`: what the session's socket factory does with the socket it binds."""
    sock = ctx.socket(zmq.REQ)
    sock.bind(address)
    watched = ReplyWatchingSocket(sock, timeout_ms=20_000)
    if bound is not None:
        bound(watched)
    seen["socket"] = watched
    watched.send_pyobj(("an", "ipc", "handle"))  # blocks until a peer connects
    seen["reply"] = watched.recv()
    watched.send_pyobj(RuntimeError("Some workers failed to update weights"))
    sock.close()


def test_rescue_unblocks_a_sender_whose_peer_never_came() -> None:
    ctx = zmq.Context()
    address = f"ipc://@ckptctl-test-{os.getpid()}-{time.monotonic_ns()}.sock"
    seen: dict = {}
    ps = threading.Thread(target=_ps_side, args=(ctx, address, seen), daemon=True)
    ps.start()
    # The handle is on its way and nobody takes it: the sender is stuck, as in real life.
    wait_until(lambda: "socket" in seen and seen["socket"].handle is not None, what="the send")
    assert ps.is_alive() and not seen["socket"].handle_sent.is_set()
    assert seen["socket"].endpoint == address
    helper = rescue(address, "HTTP 400: dp_size must be 1", timeout_s=5)
    ps.join(timeout=10)
    helper.join(timeout=10)
    assert not ps.is_alive() and not helper.is_alive()
    assert seen["reply"].decode().startswith(RESCUE_PREFIX)
    assert "dp_size must be 1" in seen["socket"].errors[0]
    ctx.term()


def test_a_rescue_before_the_socket_is_bound_ends_the_transfer_as_it_binds() -> None:
    """Issue 37: the push failed on another rank before this rank's update began (a busy
    machine). Its rescue is not judged by the previous transfer, whose worker took the handle
    (that left it to a cancel that reached nothing, and the job ended 15 s later); the socket
    this rank binds afterwards is rescued at once."""
    transfers = TransferSockets()
    previous = ReplyWatchingSocket(zmq.Context.instance().socket(zmq.REQ), timeout_ms=1000)
    previous.handle_sent.set()  # its worker took the handle
    transfers.new_transfer()
    transfers._add_socket(previous)
    assert transfers.rescue("too late") is False  # (a cancel ends that one)
    transfers.new_transfer()
    assert transfers.rescue("HTTP 400: refused") is True  # nothing bound yet
    ctx = zmq.Context()
    address = f"ipc://@ckptctl-test-{os.getpid()}-{time.monotonic_ns()}.sock"
    seen: dict = {}
    ps = threading.Thread(
        target=_ps_side, args=(ctx, address, seen, transfers._add_socket), daemon=True
    )
    ps.start()
    ps.join(timeout=10)
    assert not ps.is_alive(), "the send of the handle is still blocked"
    assert seen["reply"].decode() == f"{RESCUE_PREFIX}: HTTP 400: refused"
    assert transfers.sockets == [seen["socket"]] and not transfers.workers_connected()
    ctx.term()


def test_rescue_gives_up_quietly_when_nobody_is_there() -> None:
    helper = rescue(f"ipc://@ckptctl-nobody-{os.getpid()}.sock", "x", timeout_s=0.5)
    helper.join(timeout=60)  # (a safety net: it gives up after its own 0.5 s)
    assert not helper.is_alive()


class _FakeCudaStorage:
    released: list[tuple] = []

    @classmethod
    def _release_ipc_counter(cls, handle: bytes, offset: int, device: str = "") -> None:
        cls.released.append((handle, offset, device))


def rebuild_cuda_tensor(*args: object) -> None:  # named like torch's: what the handle carries
    raise AssertionError("never called: the stand-in peer does not open the handle")


def _cuda_handle() -> tuple:
    """The shape of torch.multiprocessing.reductions.reduce_tensor(cuda_tensor)."""
    args = [None] * 15
    args[4], args[6], args[11], args[12] = _FakeCudaStorage, "cuda:0", b"/torch_123_refcount", 7
    return (rebuild_cuda_tensor, tuple(args))


def _send_handle_and_answer(peer_reply: bytes | None) -> list[tuple]:
    """The PS sends a CUDA-shaped handle; `peer_reply` from a worker of ours, or (None) the
    rescue stand-in answers. What was released?"""
    _FakeCudaStorage.released.clear()
    ctx = zmq.Context()
    address = f"ipc://@ckptctl-test-{os.getpid()}-{time.monotonic_ns()}.sock"
    sock = ctx.socket(zmq.REQ)
    sock.bind(address)
    watched = ReplyWatchingSocket(sock, timeout_ms=20_000)
    sender = threading.Thread(target=watched.send_pyobj, args=(_cuda_handle(),), daemon=True)
    sender.start()
    wait_until(lambda: watched.handle is not None, what="the send")
    assert not _FakeCudaStorage.released  # nothing before
    if peer_reply is None:
        helper = rescue(address, "refused", timeout_s=5)
    else:
        worker = ctx.socket(zmq.REP)
        worker.connect(address)
        worker.recv()
        worker.send(peer_reply)
    sender.join(timeout=10)
    watched.recv()
    watched.send_pyobj(RuntimeError("Some workers failed to update weights"))
    if peer_reply is None:
        helper.join(timeout=10)
    else:
        worker.recv()
        worker.close()
    sock.close()
    ctx.term()
    return list(_FakeCudaStorage.released)


def test_a_rescued_transfer_gives_the_ipc_reference_back() -> None:
    """A handle nobody opens keeps the PS's GPU buffer allocated (torch counts a reference the
    consumer never releases): seen on 2x H200 as +16 GiB per GPU after a refused serve push.
    When the reply to the handle is the stand-in's, the PS side releases it with torch's own
    call."""
    assert _send_handle_and_answer(None) == [(b"/torch_123_refcount", 7, "cuda:0")]


def test_a_handle_a_worker_took_is_left_to_the_worker() -> None:
    """A real worker that took the handle releases it itself, even when it then fails."""
    assert _send_handle_and_answer(b"RuntimeError: bucket 0 failed") == []
    assert _send_handle_and_answer(b"") == []


def test_only_a_cuda_handle_is_released() -> None:
    from ckptctl.ce.transfer_sockets import release_ipc_reference

    _FakeCudaStorage.released.clear()
    assert release_ipc_reference(("an", "ipc", "handle")) is False
    assert release_ipc_reference(None) is False
    assert release_ipc_reference((print, (1, 2))) is False
    assert not _FakeCudaStorage.released

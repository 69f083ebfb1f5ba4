"""Ending a transfer whose server never connected, with real zmq sockets as checkpoint-engine
uses them (a REQ bound to an abstract ipc address, pickled messages): the blocked sender gets
an error reply and goes on; nothing it sends is ever unpickled by us."""

from __future__ import annotations

import os
import threading
import time

import zmq

from ckptctl.pipeline.parameter_server import RESCUE_PREFIX, ReplyWatchingSocket, rescue


def _ps_side(ctx: zmq.Context, address: str, seen: dict) -> None:
    """What `_update_per_bucket` does: send the handle, read a reply, send the abort."""
    sock = ctx.socket(zmq.REQ)
    sock.bind(address)
    watched = ReplyWatchingSocket(sock, timeout_ms=20_000)
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
    time.sleep(0.3)
    assert ps.is_alive() and not seen["socket"].handle_sent.is_set()  # stuck, as in real life
    assert seen["socket"].endpoint == address
    helper = rescue(address, "HTTP 400: dp_size must be 1", timeout_s=5)
    ps.join(timeout=10)
    helper.join(timeout=10)
    assert not ps.is_alive() and not helper.is_alive()
    assert seen["reply"].decode().startswith(RESCUE_PREFIX)
    assert "dp_size must be 1" in seen["socket"].errors[0]
    ctx.term()


def test_rescue_gives_up_quietly_when_nobody_is_there() -> None:
    helper = rescue(f"ipc://@ckptctl-nobody-{os.getpid()}.sock", "x", timeout_s=0.5)
    helper.join(timeout=5)
    assert not helper.is_alive()

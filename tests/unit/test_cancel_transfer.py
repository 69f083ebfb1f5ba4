"""Ending a transfer whose server's worker took the handle (ReplyWatchingSocket.cancel), with real
zmq sockets as checkpoint-engine uses them: the PS's side runs the same calls as its
`_update_per_bucket` (the handle; per bucket a reply, then the next bucket or, after an error
reply, its RuntimeError), the worker's side those of `checkpoint_engine.worker`.

After a cancel every reply the PS reads is an error, so it leaves at that bucket on every rank;
a worker that is there is told to give up (it raises), whether it answers at once or later; the
IPC reference of one that died is given back (its process cannot)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest
import zmq
from conftest import wait_until

import ckptctl.ce.transfer_sockets as ps_module
from ckptctl.ce.transfer_sockets import ReplyWatchingSocket

RELEASED: list[tuple[Any, ...]] = []


class FakeStorage:
    """Stands in for the CUDA storage class a real handle names (release_ipc_reference)."""

    @staticmethod
    def _release_ipc_counter(handle: Any, offset: Any, device: Any = None) -> None:
        RELEASED.append((handle, offset, device))


def rebuild_cuda_tensor(*args: Any) -> None:  # (the name torch's handles carry)
    raise AssertionError("never rebuilt here")


HANDLE = (rebuild_cuda_tensor, (0, 0, 0, 0, FakeStorage, 0, 0, 0, 0, 0, 0, "counter", 8, 0, 0))


class Worker:
    """checkpoint_engine.worker's side: `answer` says what it does with each bucket: "ok" (answer
    at once), "slow" (answer after `slow_s`), "die" (close its socket, never answer)."""

    def __init__(self, endpoint: str, answer: str, slow_s: float = 0.0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 20_000)
        self.sock.connect(endpoint)
        self.answer, self.slow_s = answer, slow_s
        self.got: list[Any] = []
        self.bucket = threading.Event()  # it has a bucket in hand
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            self.got.append(self.sock.recv_pyobj())  # the handle
            self.sock.send(b"")
            while True:
                msg = self.sock.recv_pyobj()
                self.got.append(msg)
                if isinstance(msg, Exception):
                    return  # raised: the worker gives up
                self.bucket.set()
                if self.answer == "die":
                    return
                if self.answer == "slow":
                    time.sleep(self.slow_s)
                self.sock.send(b"")
        except zmq.ZMQError as exc:
            self.got.append(exc)
        finally:
            self.sock.close(linger=0)


@pytest.fixture
def ps() -> Any:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.bind(f"ipc://@ckptctl-test-{os.getpid()}-{time.monotonic_ns()}")
    RELEASED.clear()
    watched = ReplyWatchingSocket(sock, timeout_ms=20_000)
    yield watched
    sock.close(linger=0)


def _start(ps: ReplyWatchingSocket, worker: Worker) -> None:
    """The handle, its reply, then the first bucket, which the worker now holds."""
    ps.send_pyobj(HANDLE)
    assert ps.recv() == b""
    ps.send_pyobj([{"name": "w", "shape": [1], "dtype": None, "offset": 0}])
    wait_until(worker.bucket.is_set, timeout=20, what="the worker to take the bucket")


def _give_up(ps: ReplyWatchingSocket) -> bytes:
    """What checkpoint-engine does next: read the bucket's reply; after an error, send its
    RuntimeError (and raise)."""
    reply = ps.recv()
    if reply != b"":
        ps.send_pyobj(RuntimeError("Some workers failed to update weights"))
    return reply


def test_a_cancel_tells_a_worker_that_answers_to_give_up(ps: ReplyWatchingSocket) -> None:
    worker = Worker(ps.endpoint, "ok")
    _start(ps, worker)
    ps.cancel("stopped by a client (ckptctl stop)")
    assert _give_up(ps) == b"ckptctl: stopped by a client (ckptctl stop)"
    worker.thread.join(timeout=20)
    assert isinstance(worker.got[-1], RuntimeError)  # it raised, as checkpoint-engine's does
    ps.settle()
    assert RELEASED == []  # a worker that is there gives its reference back itself


def test_a_cancel_tells_a_slow_worker_once_it_has_loaded_its_bucket(
    ps: ReplyWatchingSocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ps_module, "CANCEL_GRACE_MS", 100)
    worker = Worker(ps.endpoint, "slow", slow_s=1.0)
    _start(ps, worker)
    ps.cancel("cancelled by its client")
    assert _give_up(ps).startswith(b"ckptctl: cancelled")  # without waiting for the worker
    worker.thread.join(timeout=20)
    assert isinstance(worker.got[-1], RuntimeError)  # not left waiting for a next bucket
    ps.settle()
    assert RELEASED == []


def test_the_reference_of_a_worker_that_died_is_given_back(
    ps: ReplyWatchingSocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ps_module, "CANCEL_GRACE_MS", 300)
    worker = Worker(ps.endpoint, "die")
    _start(ps, worker)
    worker.thread.join(timeout=20)  # its socket is closed: the process died
    ps.cancel("update request to http://127.0.0.1:1 failed: connection closed")
    assert _give_up(ps).startswith(b"ckptctl: update request")
    ps.settle()
    assert RELEASED == [("counter", 8, 0)]

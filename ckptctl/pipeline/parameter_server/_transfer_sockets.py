"""The zmq REQ socket checkpoint-engine talks to the server's worker through, watched.

The ParameterServer's socket is wrapped (`ReplyWatchingSocket`) so that every reply is seen -
checkpoint-engine throws away the reply to the LAST bucket, so an error while the server loads
it would pass as success - and so that sends and receives are bounded (a REQ socket with no
peer blocks forever). A failed push ends the transfer with `rescue` before a worker took the
IPC handle, and with `cancel` after.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptctl.errors import print_error

# How often a blocked exchange looks whether its transfer was cancelled, and how long a
# cancelled one still waits for a worker that may yet answer.
POLL_MS = 100
CANCEL_GRACE_MS = 2000
_POLLIN, _POLLOUT = 1, 2  # zmq.POLLIN, zmq.POLLOUT (zmq is imported lazily)


class ReplyWatchingSocket:
    """A stand-in for the PS's zmq REQ socket that keeps every non-empty (error) reply, and
    that a failed push can end (`cancel`) while checkpoint-engine blocks in it."""

    def __init__(
        self, socket: Any, timeout_ms: int, on_bucket: Callable[[int], None] | None = None
    ) -> None:
        import zmq

        self._socket = socket
        self.errors: list[str] = []
        # Progress: called with a bucket's bytes once the worker's reply says it has loaded it.
        self.on_bucket = on_bucket
        self._bucket_in_flight = 0
        self._nones_sent = 0
        self.handle: Any = None  # the first message: the CUDA IPC handle of the PS's buffer
        self._replies = 0
        # The PS ends every transfer with None, None; the reply to the second means the
        # server's worker has loaded everything and run its post-hook.
        self.finished = threading.Event()
        # Set once the first message (the IPC handle) has left: a peer (the server's worker)
        # has connected. Until then a stand-in peer can end the transfer (see `rescue`).
        self.handle_sent = threading.Event()
        self.rescued = False  # the handle went to our stand-in peer (`rescue`), not a worker
        # Set (from any thread) by `cancel`: the transfer must end although a worker took part.
        self.cancelled: str | None = None
        # Once a reply was made up or a send dropped, the real socket is out of step with the
        # PS: every later exchange is made up too.
        self._detached = False
        self._timeout_ms = timeout_ms
        self._peer_gone = False  # found after a cancel: the worker's process died (`settle`)
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        socket.setsockopt(zmq.LINGER, 0)
        # Lets a cancelled transfer still hand a slow worker the exception it raises, with its
        # reply still owed (`send_pyobj`); the PS itself never sends twice in a row.
        socket.setsockopt(zmq.REQ_RELAXED, 1)
        socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        socket.setsockopt(zmq.RCVTIMEO, timeout_ms)

    def send_pyobj(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        import zmq

        if obj is None:
            self._nones_sent += 1
        elif self.handle is None:
            self.handle = obj
        elif isinstance(obj, list):  # a bucket's metas: [{name, dtype, shape, offset}, ...]
            self._bucket_in_flight = bucket_bytes(obj)
        if not self._wait_for(_POLLOUT):
            # Cancelled, and the worker did not answer in time. A relaxed REQ socket can still
            # send while it has a peer: a worker that is only slow is there; one whose
            # process died is not.
            self._peer_gone = not self._socket.poll(0, zmq.POLLOUT)
            if isinstance(obj, Exception) and not self._peer_gone:
                # checkpoint-engine's "give up": the worker takes it once its bucket is loaded
                # and raises, instead of waiting forever for a bucket that never comes (and
                # its server's update with it).
                with contextlib.suppress(zmq.ZMQError):
                    self._socket.send_pyobj(obj, zmq.NOBLOCK)
            return None  # dropped
        sent = self._socket.send_pyobj(obj, *args, **kwargs)
        self.handle_sent.set()
        return sent

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        if not self._wait_for(_POLLIN):
            # Cancelled: a made-up error reply, which sends checkpoint-engine down its own
            # error path (the all-reduce of return codes, then its exception) on every rank.
            self._bucket_in_flight = 0
            return self._cancel_reply()
        reply = self._socket.recv(*args, **kwargs)
        self._replies += 1
        if self._bucket_in_flight and reply == b"" and self.on_bucket is not None:
            self.on_bucket(self._bucket_in_flight)
        self._bucket_in_flight = 0
        if reply != b"":
            self.errors.append(reply.decode("utf-8", errors="replace"))
            if self._replies == 1 and reply.startswith(RESCUE_PREFIX.encode()):
                # The handle went to our stand-in (a REQ socket's reply comes from the peer
                # that took the message), which never opens it: give its reference back.
                self._release_handle()
        if self._nones_sent >= 2:
            self.finished.set()
        if reply == b"" and self.cancelled is not None:
            # A worker that answers, after a cancel: the same made-up error, so that every rank
            # leaves at this bucket and the worker is told to give up (not sent the next one).
            return self._cancel_reply()
        return reply

    def cancel(self, message: str) -> None:
        """End this transfer although a worker took the handle (its server died, hangs, or the
        push was stopped). Only a flag: the PS's thread, blocked in `recv` or `send_pyobj`,
        acts on it within POLL_MS. From then on every reply the PS reads is a made-up error:
        a worker that answers its bucket (within CANCEL_GRACE_MS) is then told to give up
        (checkpoint-engine's own message, which it raises); one that is gone gets nothing
        more (see `settle`)."""
        if self.cancelled is None:
            self.cancelled = message

    def _cancel_reply(self) -> bytes:
        """The error reply every exchange after a cancel gets, whatever the worker answered."""
        return f"ckptctl: {self.cancelled}".encode()

    def settle(self) -> None:
        """Once the transfer is over: give back the IPC reference of a worker that took the
        handle and died during a cancelled transfer. A consumer releases its reference when it
        lets go of the buffer; one that died never does, and torch would keep the PS's transfer
        buffer (twice the bucket size) until the job ends. A worker that is only slow keeps
        it, and releases it itself."""
        if self._detached and self._peer_gone and self.handle_sent.is_set() and not self.rescued:
            self._release_handle()

    def _wait_for(self, event: int) -> bool:
        """Wait until the socket can `event` (True), or until the transfer is cancelled and no
        worker can take part any more (False). Past the socket's own timeout, zmq.Again, as a
        blocking call would raise."""
        import zmq

        if self._detached:
            return False
        deadline = time.monotonic() + self._timeout_ms / 1000
        while True:
            if self.cancelled is not None:
                if self._socket.poll(CANCEL_GRACE_MS, event):
                    return True
                self._detached = True
                return False
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                raise zmq.Again()
            if self._socket.poll(min(POLL_MS, max(int(left_ms), 1)), event):
                return True

    def _release_handle(self) -> None:
        try:
            release_ipc_reference(self.handle)
        except Exception as exc:  # noqa: BLE001 - a leak is worth a warning, not a crash
            print_error(
                "could not release the failed update's IPC buffer (it stays allocated until "
                f"the job ends): {exc}",
                label="warning",
            )

    def abort(self, message: str, timeout_s: float = 10.0) -> bool:
        """Tell the server's worker to give up this transfer, as checkpoint-engine does when a
        worker failed: take the reply the worker owes us, then send it an exception, which it
        raises. Its server then answers the update with an error and stays usable, instead of
        waiting forever for a bucket that will never come. Only while a message of ours is
        waiting for its reply - at every point of checkpoint-engine's bucket loop where it reads
        over p2p. False if the worker did not take part (or not in time)."""
        import zmq

        if not self.handle_sent.is_set():
            return False
        self._timeout_ms = int(timeout_s * 1000)
        self._socket.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        try:
            self.recv()
            self._socket.send_pyobj(RuntimeError(f"ckptctl: {message}"))
        except zmq.ZMQError:
            return False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def bucket_bytes(metas: list[Any]) -> int:
    """The bytes of the tensors a bucket's metas name (dtype × shape; 0 for what is not such a
    list): what the worker copies out of the IPC buffer for it."""
    total = 0
    for meta in metas:
        try:
            total += math.prod(meta["shape"]) * meta["dtype"].itemsize
        except (KeyError, TypeError, AttributeError):
            continue
    return total


def release_ipc_reference(handle: Any) -> bool:
    """Give back the reference a consumer of a CUDA IPC handle would have released.

    `handle` is what torch's `reduce_tensor` made of a CUDA tensor: `(rebuild_cuda_tensor,
    args)`. Sharing counts a reference in a file that the consumer decrements when it lets go;
    a buffer freed while the count is up stays allocated until the process ends. Our stand-in
    peer (`rescue`) takes the handle and never opens it, so it releases the count the way
    torch's own consumer does when it already holds the storage. False if `handle` is not
    such a tuple (nothing done).
    """
    try:
        rebuild, args = handle
    except (TypeError, ValueError):
        return False
    if getattr(rebuild, "__name__", "") != "rebuild_cuda_tensor" or len(args) != 15:
        return False
    storage_cls, device, counter_handle, counter_offset = args[4], args[6], args[11], args[12]
    storage_cls._release_ipc_counter(counter_handle, counter_offset, device=device)
    return True


RESCUE_PREFIX = "ckptctl: the push failed"


def rescue(endpoint: str, message: str, timeout_s: float = 30.0) -> threading.Thread:
    """End a transfer whose server never connected, without ending the process.

    checkpoint-engine's REQ socket blocks until a peer connects. When the server refused (and
    so never will), a REP socket of ours connects in its place, takes the IPC handle (as raw
    bytes: never unpickled), answers with an error, and takes the abort message that follows:
    checkpoint-engine then fails the update on every rank through its own error path, and the
    ParameterServer stays usable for the next push.
    """
    import zmq

    def run() -> None:
        ctx = zmq.Context()
        rep = ctx.socket(zmq.REP)
        rep.setsockopt(zmq.LINGER, 0)
        rep.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        rep.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        try:
            rep.connect(endpoint)
            rep.recv()  # the IPC handle (its reference is released on the PS's side)
            rep.send(f"{RESCUE_PREFIX}: {message}".encode())
            rep.recv()  # the PS's "workers failed" notice; nothing is answered after it
        except zmq.ZMQError:
            pass  # the PS gave up first: nothing left to end
        finally:
            rep.close()
            ctx.term()

    thread = threading.Thread(target=run, name="ckptctl-rescue", daemon=True)
    thread.start()
    return thread


class TransferSockets:
    """The zmq sockets of the current update (one per bind), and how a failed push ends them:
    `rescue` before a server's worker took the handle, `cancel` after."""

    sockets: list[ReplyWatchingSocket]

    def rescue(self, message: str) -> bool:
        """End the current transfer if its server never connected (see `rescue`); False when a
        worker is already attached (then `cancel` ends it)."""
        if not self.sockets or self.sockets[-1].handle_sent.is_set():
            return False
        self.sockets[-1].rescued = True
        rescue(self.sockets[-1].endpoint, message)
        return True

    def cancel(self, message: str) -> None:
        """End the current transfer although workers took the handle (see
        ReplyWatchingSocket.cancel); `update` then raises with `message`."""
        for s in self.sockets:
            s.cancel(message)

    def cancelled(self) -> str | None:
        return next((s.cancelled for s in self.sockets if s.cancelled is not None), None)

    def workers_connected(self) -> bool:
        """Whether a server's worker took the current update's IPC handle: from then on a
        failure may leave the server with a mix of old and new weights."""
        return any(s.handle_sent.is_set() and not s.rescued for s in self.sockets)

    def wait_transfer_finished(self, timeout: float) -> bool:
        """Wait until the current transfer's last reply came back (called from the req thread)."""
        return bool(self.sockets) and self.sockets[-1].finished.wait(timeout)

    def _worker_errors(self) -> list[str]:
        # (A rescued transfer's one reply is our stand-in's, not a worker's.)
        return [e for s in self.sockets if not s.rescued for e in s.errors]

"""The zmq REQ socket checkpoint-engine talks to the server's worker through, watched: every
reply seen (it throws away the reply to the LAST bucket, so an error there would pass as
success), every wait bounded (a REQ socket with no peer blocks forever), and a failed push
ended - by `rescue` before a worker took the IPC handle, by `cancel` after."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptctl.errors import print_error
from ckptctl.observe import timeline

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
        self.on_bucket = on_bucket  # called with a bucket's bytes once the worker loaded it
        self._bucket_in_flight = self._nones_sent = self._replies = 0
        self._bucket_sent_at = 0.0  # (--trace)
        self._created_at = self._none_sent_at = self._reply_at = time.perf_counter()
        self.buckets_sent = 0  # buckets the worker was told of (none: its weights are untouched)
        self.handle: Any = None  # the first message: the CUDA IPC handle of the PS's buffer
        # The reply to the second of the None, None that end a transfer: all loaded.
        self.finished = threading.Event()
        # The handle has left: a peer has connected (until then `rescue` can end the transfer).
        self.handle_sent = threading.Event()
        self.handle_sent_at: float | None = None  # (its perf_counter: the drain stage ends there)
        self.rescued = False  # the handle went to our stand-in peer (`rescue`), not a worker
        self.cancelled: str | None = None  # set by `cancel` (from any thread)
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
            if self._nones_sent == 2:  # (--trace) between the two: the PS freed its buffers
                what = "ParameterServer frees its transfer buffers"
                timeline.record(what, timeline.WORKER, self._reply_at)
            self._none_sent_at = time.perf_counter()
        elif self.handle is None:
            self.handle = obj
        elif isinstance(obj, list):  # a bucket's metas: [{name, dtype, shape, offset}, ...]
            self._bucket_in_flight = bucket_bytes(obj)
            self._bucket_sent_at = time.perf_counter()
        if not self._wait_for(_POLLOUT):
            # Cancelled, and the worker did not answer in time. A relaxed REQ socket can still
            # send while it has a peer: a slow worker is there, a dead one is not.
            self._peer_gone = not self._socket.poll(0, zmq.POLLOUT)
            if isinstance(obj, Exception) and not self._peer_gone:
                # checkpoint-engine's "give up": the worker raises it once its bucket is loaded,
                # instead of waiting forever for a bucket that never comes.
                with contextlib.suppress(zmq.ZMQError):
                    self._socket.send_pyobj(obj, zmq.NOBLOCK)
            return None  # dropped
        sent = self._socket.send_pyobj(obj, *args, **kwargs)
        if not self.handle_sent.is_set():  # (--trace) the send waits for a worker to connect
            what = "worker connects, takes the IPC handle"
            timeline.record(what, timeline.WORKER, self._created_at)
            self.handle_sent_at = time.perf_counter()
        self.handle_sent.set()
        self.buckets_sent += isinstance(obj, list)
        return sent

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        if not self._wait_for(_POLLIN):
            # Cancelled: a made-up error reply, which sends checkpoint-engine down its own
            # error path (the all-reduce of return codes, then its exception) on every rank.
            self._bucket_in_flight = 0
            return self._cancel_reply()
        reply = self._socket.recv(*args, **kwargs)
        self._replies += 1
        self._reply_at = time.perf_counter()
        if self._nones_sent and timeline.recording():
            what = "releases the IPC buffer" if self._nones_sent == 1 else "runs its post-hook"
            timeline.record(f"worker {what}", timeline.WORKER, self._none_sent_at, self._reply_at)
        if self._bucket_in_flight and reply == b"":
            timeline.bucket(self._bucket_sent_at, self._bucket_in_flight)
            if self.on_bucket is not None:
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
        """End this transfer although a worker took the handle (its server died or hangs, or
        the push was stopped): a flag the PS's blocked thread acts on within POLL_MS. Every
        reply it reads is then a made-up error; a worker that answers its bucket within
        CANCEL_GRACE_MS is told to give up, one that is gone gets nothing more (`settle`)."""
        if self.cancelled is None:
            self.cancelled = message

    def _cancel_reply(self) -> bytes:
        """The error reply every exchange after a cancel gets, whatever the worker answered."""
        return f"ckptctl: {self.cancelled}".encode()

    def settle(self) -> None:
        """Once the transfer is over: give back the IPC reference of a worker that took the
        handle and died during a cancelled transfer (it never will, and torch would keep the
        PS's transfer buffer until the job ends). A slow worker releases its own."""
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
        worker failed: take the reply it owes us, then send it an exception, which it raises;
        its server answers the update with an error and stays usable. Only while a message of
        ours waits for its reply (wherever the bucket loop reads over p2p). False if the
        worker did not take part (or not in time)."""
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
    """Give back the reference a consumer of a CUDA IPC `handle` (torch's `reduce_tensor`
    tuple) would have released - our stand-in (`rescue`) never opens it, and a buffer freed
    while counted stays allocated until the process ends. False for no such tuple."""
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
    """End a transfer whose server never connected (its REQ socket blocks until one does): a
    REP socket of ours takes the IPC handle (raw bytes, never unpickled), answers with an error
    and takes the abort; checkpoint-engine fails the update its own way, and stays usable."""
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
    """The zmq sockets of the current transfer (one per bind), and how a failed push ends them:
    `rescue` before a server's worker took the handle, `cancel` after."""

    sockets: list[ReplyWatchingSocket]
    # A rescue asked for before this rank bound its socket: the push failed elsewhere before
    # this rank's update began (a busy machine). The socket is rescued as it is bound.
    _rescue_message: str | None = None
    _rescue_lock = threading.Lock()  # (one session per process)

    def new_transfer(self) -> None:
        """Forget the previous transfer (its sockets, their errors and workers): called before
        a serve push's guard may end this one, which must never be judged by the last one."""
        with self._rescue_lock:
            self.sockets = []
            self._rescue_message = None

    def rescue(self, message: str) -> bool:
        """End the current transfer if its server never connected (see `rescue`): now, or as
        this rank binds its socket; False when a worker is already attached (then `cancel`
        ends it)."""
        with self._rescue_lock:
            if self.sockets and self.sockets[-1].handle_sent.is_set():
                return False
            self._rescue_message = message
            if self.sockets:
                self._rescue(self.sockets[-1])
        return True

    def _add_socket(self, socket: ReplyWatchingSocket) -> ReplyWatchingSocket:
        """A socket the PS just bound for this transfer (rescued at once if the push failed)."""
        with self._rescue_lock:
            self.sockets.append(socket)
            if self._rescue_message is not None:
                self._rescue(socket)
        return socket

    def _rescue(self, socket: ReplyWatchingSocket) -> None:
        if not socket.rescued:
            socket.rescued = True
            rescue(socket.endpoint, self._rescue_message or "")

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

    def workers_connected_at(self) -> float | None:
        """When (perf_counter) a server's worker took the current update's IPC handle; None
        while none has."""
        times = [s.handle_sent_at for s in self.sockets if not s.rescued]
        return min((t for t in times if t is not None), default=None)

    def buckets_announced(self) -> bool:
        """Whether a server's worker was told of a bucket in the current update: a failed one
        that told none (a read that failed before the first bucket was filled) left the
        server's weights untouched."""
        return any(s.buckets_sent for s in self.sockets)

    def wait_transfer_finished(self, timeout: float) -> bool:
        """Wait until the current transfer's last reply came back (called from the req thread)."""
        return bool(self.sockets) and self.sockets[-1].finished.wait(timeout)

    def worker_error(self) -> str | None:
        """The last line of the error this rank's own server's worker answered the current
        update with, if it did: the failure's origin (the other ranks' servers were only told
        to give up)."""
        errors = self._worker_errors()
        lines = [line.strip() for line in (errors[-1] if errors else "").splitlines()]
        return next((line for line in reversed(lines) if line), None) if errors else None

    def _worker_errors(self) -> list[str]:
        # (A rescued transfer's one reply is our stand-in's, not a worker's.)
        return [e for s in self.sockets if not s.rescued for e in s.errors]

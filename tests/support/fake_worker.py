"""The inference server's side of checkpoint-engine's IPC protocol, on CPU: what
`checkpoint_engine.worker.update_weights_from_ipc` does in every GPU worker of SGLang or vLLM,
minus CUDA. Plugged into fake_server.FakeServer as its `on_update`, one worker per handle in
the request, each connecting a REP socket to its PS's address:

    take the handle, answer b""; then for every message: a bucket (list) -> "load" it and
    answer b"" (or the traceback, if told to fail); None -> answer; None again -> answer, done;
    an Exception -> raise it (the PS gave up).

The request is answered once every worker is done, as SGLang does; a worker that raised makes
it a refusal (HTTP 400). What a test can make the server do while a transfer runs:
- `bucket_delay_s`: each bucket takes this long to load (a push slow enough to interrupt);
- `fail_at_bucket=n`: the n-th bucket (from 1) of the next update raises, and the worker
  answers its traceback (once: the update after it, a restore, goes through);
- `hold_at_bucket=n`: the n-th bucket of the next update (of every update, with
  `hold_every_update`) is not answered until `release()` (a load that takes longer than a
  cancel waits for: the worker is left behind);
- `die()`: every worker stops answering and closes its socket, and the HTTP request's
  connection is dropped without an answer: the server process died mid-push.
With a handle that names a file (cpu_ps_rank.py's CPU_PS_COPY) each tensor's bytes are read
from it at the offset its meta gives, and their SHA-256 kept (`digests`). `flags`: a folder
where the workers write `connected` once a handle arrived and `loaded` once a bucket was loaded
(what cpu_ps_rank.py's CPU_PS_READ_HOLD waits for).
Messages are unpickled here, as checkpoint-engine's worker does: they come from our own PS in
the same test, never from anything else.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from fake_server import ServerDied

POLL_MS = 50


@dataclass
class ZmqWorkers:
    bucket_delay_s: float = 0.0
    fail_at_bucket: int | None = None
    timeout_s: float = 60.0
    # What arrived, per handle key: every bucket's tensor names, in order.
    loaded: dict[str, list[list[str]]] = field(default_factory=dict)
    # How each worker ended: "done", "failed", "aborted" (the PS sent an exception), "died".
    endings: list[str] = field(default_factory=list)
    _dead: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    updates: int = 0
    failing: bool = False
    hold_at_bucket: int | None = None
    hold_every_update: bool = False
    holding: threading.Event = field(default_factory=threading.Event)  # a worker is held
    _released: threading.Event = field(default_factory=threading.Event)
    # What arrived with bytes: tensor name -> SHA-256 of the bytes the worker read for it.
    digests: dict[str, str] = field(default_factory=dict)
    flags: Path | None = None

    def release(self) -> None:
        self._released.set()

    def die(self) -> None:
        self._dead.set()
        self._released.set()

    def revive(self) -> None:
        self._dead.clear()

    def __call__(self, handles: dict[str, str], doc: dict[str, Any]) -> None:
        with self._lock:
            self.updates += 1
        outcomes: list[str] = []
        threads = [
            threading.Thread(target=self._work, args=(key, path, outcomes), daemon=True)
            for key, path in sorted(handles.items())
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout_s)
        with self._lock:
            self.endings.extend(outcomes)
            if self.failing:
                self.fail_at_bucket, self.failing = None, False
        if self._dead.is_set() or "died" in outcomes:
            raise ServerDied("the server died mid-transfer")
        failed = [o for o in outcomes if o != "done"]
        if failed:
            raise RuntimeError(f"worker {failed[0]}: injected failure")

    def _recv(self, sock: zmq.Socket) -> Any:
        """The next message, or None once the server is dead (then nothing is answered)."""
        deadline = time.monotonic() + self.timeout_s
        while not sock.poll(POLL_MS, zmq.POLLIN):
            if self._dead.is_set() or time.monotonic() > deadline:
                raise ServerDied
        return sock.recv_pyobj()

    def _work(self, key: str, path: str, outcomes: list[str]) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(path)
        buckets: list[list[str]] = []
        with self._lock:
            self.loaded[key] = buckets
        outcome = "done"
        view: Any = None
        try:
            handle = self._recv(sock)  # the IPC handle
            if isinstance(handle, tuple) and len(handle) == 3:  # a file holding the buffer
                with open(handle[2], "rb") as fh:
                    view = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
            if self.flags is not None:
                (self.flags / "connected").touch()
            sock.send(b"")
            nones = 0
            while True:
                msg = self._recv(sock)
                if isinstance(msg, Exception):  # the PS gave up: the worker raises it
                    outcome = "failed" if outcome == "failed" else "aborted"
                    return
                if msg is None:
                    nones += 1
                    sock.send(b"")
                    if nones == 2:
                        return
                    continue
                names = [m["name"] for m in msg]
                if self.fail_at_bucket is not None and len(buckets) + 1 == self.fail_at_bucket:
                    self.failing = True
                    outcome = "failed"
                    sock.send(b"Traceback ...\nRuntimeError: injected failure while loading")
                    buckets.append([])
                    continue
                if self.hold_at_bucket is not None and len(buckets) + 1 == self.hold_at_bucket:
                    if not self.hold_every_update:
                        self.hold_at_bucket = None  # once: the updates after it go through
                    self.holding.set()
                    while not self._released.wait(0.01):
                        if self._dead.is_set():
                            raise ServerDied
                deadline = time.monotonic() + self.bucket_delay_s
                while time.monotonic() < deadline:
                    if self._dead.is_set():
                        raise ServerDied
                    time.sleep(0.01)
                if view is not None:
                    self._take_bytes(view, msg)
                buckets.append(names)
                if self.flags is not None:
                    (self.flags / "loaded").touch()
                sock.send(b"")
        except ServerDied:
            outcome = "died"
        finally:
            sock.close(linger=0)
            if view is not None:
                view.close()
            outcomes.append(outcome)

    def _take_bytes(self, view: Any, metas: list[dict[str, Any]]) -> None:
        for m in metas:
            n = math.prod(m["shape"]) * m["dtype"].itemsize
            digest = hashlib.sha256(view[m["offset"] : m["offset"] + n]).hexdigest()
            with self._lock:
                self.digests[m["name"]] = digest

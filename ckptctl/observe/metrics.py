"""Prometheus metrics of a serve job (`serve --metrics-port N`), from global rank 0 only.

Rank 0 takes every push and merges every rank's result, so its figures are the job's; other
ranks (and other nodes) serve no metrics. The registry is a private one (nothing of the
process's default collectors): a scrape reads figures the push loop has already set, and never
takes a lock the push holds. Names follow Prometheus's conventions: a counter ends in _total,
a time that passes is a timestamp gauge (the dashboard computes `time() - ...`), and a label
is never named after its metric. prometheus_client is imported only here, and only when
metrics are asked for.

Whatever reaches the port can open connections, send its request a byte at a time, or open
hundreds that send nothing and reconnect the moment they are closed. So the HTTP server here
(MetricsServer) is one thread over non-blocking sockets that never waits on a client: it takes
every connection from the listen queue as it comes (a deep one), reads a request the moment
its bytes arrive, gives each connection SCRAPE_DEADLINE_S for its whole exchange (not for each
read), caps the request's head (small_http.MAX_HEADER_BYTES), and holds at most
MAX_CONNECTIONS: a new one takes the place of the oldest still sending its request. A scraper
sends its request at once and is answered before that can reach it; slow or idle clients only
ever cut each other off. (A flood of more connections than the room and the listen queue hold
together can still delay a scrape: the port is for a private network, SECURITY.md.)
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from ckptctl.small_http import MAX_HEADER_BYTES, HttpError, parse_head

INSTALL_HINT = "pip install 'ckptctl[metrics]'"
# How a push ended (a rollback counts as a push; the restore after a failed one does not).
OUTCOMES = ("ok", "rolled_back", "failed", "restored", "refused", "cancelled")
STATES = ("starting", "idle", "busy", "stopping")

MAX_CONNECTIONS = 128  # open at once (each holds at most a request's head: 2 MiB in all)
LISTEN_BACKLOG = 1024  # connections the kernel queues for us (it caps this at somaxconn)
ACCEPTS_PER_PASS = 32  # taken from the queue between two reads of the open ones
SCRAPE_DEADLINE_S = 10.0  # for a connection's whole exchange (Prometheus's default timeout)

_PUSH_S = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_STAGE_S = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)
_SIZE_B = (1e6, 1e7, 1e8, 1e9, 4e9, 1.6e10, 6.4e10, 2.56e11, 1e12)


def missing_package() -> str | None:
    """Why metrics cannot be served here (prometheus_client is not installed), or None. Looks
    the package up without importing it."""
    if importlib.util.find_spec("prometheus_client") is None:
        return f"--metrics-port needs prometheus-client: {INSTALL_HINT}"
    return None


# The push log's outcomes (results.outcome) as label values.
OUTCOME_LABELS = {"refused before sending": "refused", "rolled back": "rolled_back"}


def outcome_of(merged: dict[str, Any]) -> str:
    """The push's outcome as a label: ok, rolled_back, restored, cancelled, refused, failed."""
    from ckptctl.results import outcome

    word = outcome(merged)
    return OUTCOME_LABELS.get(word, word)


class ServeMetrics:
    """The job's metrics; the serve loop calls `busy`, `idle`, `ended` and `stopping`."""

    def __init__(self) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            Info,
            disable_created_metrics,
        )

        disable_created_metrics()  # (a _created gauge beside every counter: noise to a scrape)
        self.registry = r = CollectorRegistry()
        self._server_weights = "whole"  # a push that never reached the server changes nothing
        self.pushes = Counter(
            "ckptctl_pushes", "Pushes by how they ended.", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:  # every series from the start: rate() needs its zero
            self.pushes.labels(outcome)
        self.duration = Histogram(
            "ckptctl_push_duration_seconds",
            "Wall time of a push (its slowest rank); pushes refused before sending not counted.",
            buckets=_PUSH_S,
            registry=r,
        )
        self.stage_duration = Histogram(
            "ckptctl_push_stage_duration_seconds",
            "Wall time of each stage of a push on rank 0 (split, register, wait_server, "
            "gather_metas, update, verify...).",
            ["stage"],
            buckets=_STAGE_S,
            registry=r,
        )
        self.server_wait = Histogram(
            "ckptctl_server_wait_seconds",
            "Time a push waited for the inference server to answer.",
            buckets=_STAGE_S,
            registry=r,
        )
        self.pushed_bytes = Counter(
            "ckptctl_pushed_bytes", "Checkpoint bytes of the pushes that succeeded.", registry=r
        )
        self.push_size = Histogram(
            "ckptctl_push_size_bytes",
            "Checkpoint size of each push that succeeded.",
            buckets=_SIZE_B,
            registry=r,
        )
        self.served = Info(
            "ckptctl_served",
            "The checkpoint the server holds as a whole: its push number, weight version, "
            "name and path; server_weights says whether a later push left it partial.",
            registry=r,
        )
        self.served_push = Gauge(
            "ckptctl_served_push", "The push number of the checkpoint served.", registry=r
        )
        self.served_push.set(math.nan)
        self.last_good_push = Gauge(
            "ckptctl_last_good_push_timestamp_seconds",
            "Unix time at which the last push (or rollback) that succeeded ended (NaN before "
            "the first): its age is time() minus this.",
            registry=r,
        )
        self.last_good_push.set(math.nan)
        self.pinned = Gauge(
            "ckptctl_pinned_host_memory_bytes",
            "Host memory each rank holds pinned for pushes (serve --register-mode direct), as "
            "of the last push or stage it ran; sum() for the job's.",
            ["rank"],
            registry=r,
        )
        self._state = Gauge(
            "ckptctl_serve_state",
            f"What the serve job is doing: 1 for its state ({', '.join(STATES)}), 0 for the "
            "others.",
            ["state"],
            registry=r,
        )
        self.set_state("starting")
        self._server: MetricsServer | None = None

    def serve(self, host: str, port: int) -> None:
        """Listen on host:port (raises OSError when it cannot)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self._server = MetricsServer(
            host, port, lambda: generate_latest(self.registry), CONTENT_TYPE_LATEST
        )

    @property
    def address(self) -> tuple[str, int]:
        assert self._server is not None
        return self._server.address

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- the serve loop's hooks (rank 0's main thread) ---------------------------------------

    def set_state(self, state: str) -> None:
        for each in STATES:
            self._state.labels(each).set(1 if each == state else 0)

    def idle(self) -> None:
        self.set_state("idle")

    def busy(self) -> None:
        self.set_state("busy")

    def stopping(self) -> None:
        self.set_state("stopping")

    def ended(
        self, merged: dict[str, Any], stages: list[Any], served: dict[str, Any] | None
    ) -> None:
        """One command is over (a push, a rollback or a stage): `merged` is its answer with
        every rank's result, `stages` rank 0's StageFigures of it, `served` the whole
        checkpoint the server holds (the loop's history). Metrics must never end the job:
        whatever goes wrong here is dropped."""
        with contextlib.suppress(Exception):
            self._ended(merged, stages, served)
        self.set_state("idle")

    def _ended(
        self, merged: dict[str, Any], stages: list[Any], served: dict[str, Any] | None
    ) -> None:
        for result in merged.get("ranks") or []:  # (every rank's figure is in rank 0's answer)
            pinned = result.get("pinned_pool_bytes")
            if isinstance(pinned, int) and isinstance(result.get("rank"), int):
                self.pinned.labels(str(result["rank"])).set(pinned)
        if merged.get("action") == "stage":
            return  # a read ahead is no push
        outcome = outcome_of(merged)
        self.pushes.labels(outcome).inc()
        if outcome == "refused":
            return  # nothing was sent: no push to time, the server's weights unchanged
        self.duration.observe(float(merged.get("wall_s") or 0.0))
        for st in stages:
            self.stage_duration.labels(st.name).observe(st.seconds)
            if st.name == "wait_server":
                self.server_wait.observe(st.seconds)
        size = merged.get("total_bytes")
        if merged.get("ok"):  # a push or a rollback that the server took whole
            self.last_good_push.set(time.time())
            if isinstance(size, int):
                self.pushed_bytes.inc(size)
                self.push_size.observe(size)
        self._server_weights = merged.get("server_weights") or self._server_weights
        if served is not None:
            self.served_push.set(int(served.get("seq") or 0))
            self.served.info(
                {
                    "push": str(served.get("seq")),
                    "weight_version": str(served.get("weight_version") or ""),
                    "checkpoint_name": str(served.get("checkpoint_name") or ""),
                    "checkpoint_path": str(served.get("checkpoint_path") or ""),
                    "server_weights": self._server_weights,
                }
            )


class _Connection:
    """One client: when it connected, its request's bytes so far, then the answer left to send
    (None while the request is still coming)."""

    __slots__ = ("began", "received", "reply")

    def __init__(self, began: float) -> None:
        self.began = began
        self.received = b""
        self.reply: memoryview | None = None


class MetricsServer:
    """GET /metrics over HTTP/1.1, one request a connection, for clients we do not trust (see
    the module's docstring): `page()` is the answer's body. One thread, no blocking call on a
    client's socket."""

    def __init__(
        self,
        host: str,
        port: int,
        page: Callable[[], bytes],
        content_type: str,
        *,
        deadline_s: float = SCRAPE_DEADLINE_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._page = page
        self._content_type = content_type
        self._deadline_s = deadline_s
        self._max_connections = max_connections
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # (a job started again binds its port while the last one's connections linger)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(LISTEN_BACKLOG)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self.address = (str(self._sock.getsockname()[0]), int(self._sock.getsockname()[1]))
        self._open: dict[socket.socket, _Connection] = {}  # (oldest first)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ckptctl-metrics", daemon=True)
        self._thread.start()

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def close(self) -> None:
        self._closed.set()  # (the loop looks at least every 0.2 s)
        self._thread.join(timeout=2)
        if not self._thread.is_alive():
            for conn in list(self._open):
                self._drop(conn)
            self._selector.close()
        self._sock.close()

    def _loop(self) -> None:
        while not self._closed.is_set():
            for key, events in self._selector.select(timeout=0.2):
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                if conn is self._sock:
                    self._accept()
                elif conn in self._open:  # (not dropped earlier in this pass)
                    self._on_ready(conn, events)
            self._drop_expired()

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_PASS):
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return  # the queue is empty
            except OSError:  # out of file descriptors, say: free one, try again next pass
                if self._open:
                    self._drop(self._oldest())
                else:  # none of ours to free: the queue stays readable, so do not spin on it
                    self._closed.wait(0.1)
                return
            if len(self._open) >= self._max_connections:
                self._drop(self._oldest())
            conn.setblocking(False)
            self._open[conn] = _Connection(time.monotonic())
            self._selector.register(conn, selectors.EVENT_READ)
            self._on_ready(conn, selectors.EVENT_READ)  # (a scraper's request is often there)

    def _oldest(self) -> socket.socket:
        """The connection to cut off for room: the oldest still sending its request (a slow
        client's), or the oldest of all when every one is being answered."""
        reading = (c for c, state in self._open.items() if state.reply is None)
        return next(reading, None) or next(iter(self._open))

    def _on_ready(self, conn: socket.socket, events: int) -> None:
        state = self._open[conn]
        try:
            if state.reply is None and events & selectors.EVENT_READ:
                chunk = conn.recv(8192)  # (a slow client's head holds at most this past the cap)
                if not chunk:
                    self._drop(conn)  # the client hung up
                    return
                state.received += chunk
                head, blank, _ = state.received.partition(b"\r\n\r\n")
                if blank:
                    self._reply(conn, state, *parse_head(head)[:2])
                elif len(state.received) > MAX_HEADER_BYTES:
                    raise HttpError(431, f"the request's headers exceed {MAX_HEADER_BYTES} bytes")
            if state.reply is not None:
                sent = conn.send(state.reply)
                state.reply = state.reply[sent:]
                if not state.reply:
                    self._drop(conn)  # answered
        except HttpError as exc:  # a malformed or oversized request
            self._answer(conn, state, HTTPStatus(exc.status), f"{exc}\n".encode())
        except BlockingIOError:
            pass  # nothing more to read, or no room to send: the next pass
        except OSError:
            self._drop(conn)  # the client went away, or reset

    def _reply(self, conn: socket.socket, state: _Connection, method: str, path: str) -> None:
        if path != "/metrics":
            self._answer(conn, state, HTTPStatus.NOT_FOUND, b"see /metrics\n")
        elif method != "GET":
            self._answer(conn, state, HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n")
        else:
            try:
                page = self._page()
            except Exception as exc:  # noqa: BLE001 - a scrape must never end the server's thread
                error = f"the metrics page failed: {type(exc).__name__}\n".encode()
                self._answer(conn, state, HTTPStatus.INTERNAL_SERVER_ERROR, error)
                return
            self._answer(conn, state, HTTPStatus.OK, page, self._content_type)

    def _answer(
        self,
        conn: socket.socket,
        state: _Connection,
        status: HTTPStatus,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        """Queue the answer: sent as the client takes it, within the connection's deadline."""
        head = (
            f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        state.reply = memoryview(head.encode() + body)
        self._selector.modify(conn, selectors.EVENT_WRITE)

    def _drop_expired(self) -> None:
        """Close every connection past its deadline, unanswered (oldest first: stop at the
        first one still in time)."""
        now = time.monotonic()
        while self._open:  # (no copy of the whole room on every pass: only the expired go)
            conn, state = next(iter(self._open.items()))
            if state.began + self._deadline_s > now:
                return
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        del self._open[conn]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        conn.close()


def start(host: str, port: int) -> ServeMetrics:
    """The job's metrics, served on host:port; a port that cannot be bound is a usage error."""
    from ckptctl.errors import UsageError

    metrics = ServeMetrics()
    try:
        metrics.serve(host, port)
    except OSError as exc:
        why = exc.strerror or exc
        raise UsageError(f"--metrics-port {port}: cannot listen on {host}: {why}") from None
    return metrics

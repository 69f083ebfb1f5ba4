"""Prometheus metrics of a serve job (`serve --metrics-port N`), from global rank 0 only.

Rank 0 takes every push and merges every rank's result, so its figures are the job's; other
ranks (and other nodes) serve no metrics. The registry is a private one (nothing of the
process's default collectors): a scrape reads figures the push loop has already set, and never
takes a lock the push holds. Names follow Prometheus's conventions: a counter ends in _total,
a time that passes is a timestamp gauge (the dashboard computes `time() - ...`), and a label
is never named after its metric. prometheus_client is imported only here, and only when
metrics are asked for.

Whatever reaches the port can open connections and send its request a byte at a time, so the
HTTP server here (MetricsServer, one thread a connection, the control socket's bounded request
reader) holds at most MAX_SCRAPERS connections, gives each SCRAPE_DEADLINE_S for its whole
exchange (not for each read), and caps the request's head (small_http.MAX_HEADER_BYTES). A new
connection to a full server is not refused: it takes the place of the oldest one still
sending its request once that one has had EVICT_AFTER_S (a scraper sends its request at once,
so only a slow client is ever cut off), and waits in the listen queue meanwhile. Slow clients
that reconnect at once cost a few threads and never keep a scraper from its answer.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

INSTALL_HINT = "pip install 'ckptctl[metrics]'"
# How a push ended (a rollback counts as a push; the restore after a failed one does not).
OUTCOMES = ("ok", "rolled_back", "failed", "restored", "refused", "cancelled")
STATES = ("starting", "idle", "busy", "stopping")

MAX_SCRAPERS = 8  # connections served at once
SCRAPE_DEADLINE_S = 10.0  # for a connection's whole exchange (Prometheus's default timeout)
EVICT_AFTER_S = 1.0  # a request still unread this long may make room for a new connection
CONNECTION_THREAD = "ckptctl-metrics-conn"  # (the name of each connection's thread)

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


class MetricsServer:
    """GET /metrics over HTTP/1.1, one request a connection, for clients we do not trust (see
    the module's docstring): `page()` is the answer's body."""

    def __init__(
        self,
        host: str,
        port: int,
        page: Callable[[], bytes],
        content_type: str,
        *,
        deadline_s: float = SCRAPE_DEADLINE_S,
    ) -> None:
        self._page = page
        self._content_type = content_type
        self._deadline_s = deadline_s
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            # (a job started again binds its port while the last one's connections linger)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self.address = (str(self._sock.getsockname()[0]), int(self._sock.getsockname()[1]))
        # Every open connection: when it began, while its request is still being read (None
        # once it is read, or it was cut off: it is not cut off again).
        self._open: dict[socket.socket, float | None] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name="ckptctl-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            self._changed.notify_all()
        self._thread.join(timeout=2)
        self._sock.close()

    def _accept_loop(self) -> None:
        self._sock.settimeout(0.2)
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed:
                    return
                time.sleep(0.1)  # out of file descriptors, say: do not spin
                continue
            began = self._make_room(conn)
            if began is None:
                conn.close()
                return
            try:
                threading.Thread(
                    target=self._serve, args=(conn, began), name=CONNECTION_THREAD, daemon=True
                ).start()
            except RuntimeError:  # no thread to be had: this one goes unanswered
                self._done(conn)

    def _make_room(self, conn: socket.socket) -> float | None:
        """Wait for a free place among MAX_SCRAPERS, cutting off the oldest connection still
        sending its request once it has had EVICT_AFTER_S; then give it to `conn`, from now
        (returned; None: the server closed meanwhile)."""
        with self._changed:
            while len(self._open) >= MAX_SCRAPERS and not self._closed:
                reading = [(began, c) for c, began in self._open.items() if began is not None]
                wait = 0.2  # (until a connection ends and says so)
                if reading:
                    began, oldest = min(reading, key=lambda item: item[0])
                    wait = began + EVICT_AFTER_S - time.monotonic()
                    if wait <= 0:
                        self._open[oldest] = None
                        with contextlib.suppress(OSError):
                            oldest.shutdown(socket.SHUT_RDWR)  # its thread ends at once
                        wait = 0.2
                self._changed.wait(wait)
            if self._closed:
                return None
            began = self._open[conn] = time.monotonic()
            return began

    def _serve(self, conn: socket.socket, began: float) -> None:
        from ckptctl.small_http import HttpError, read_request

        deadline = began + self._deadline_s
        try:
            try:
                request = read_request(conn, deadline)
            finally:
                with self._changed:
                    self._open[conn] = None  # read (or cut off): not cut off any more
            if request is None:
                return  # a client that hung up, or one cut off to make room
            method, path, _ = request
            if path != "/metrics":
                self._answer(conn, HTTPStatus.NOT_FOUND, b"see /metrics\n", deadline)
            elif method != "GET":
                self._answer(conn, HTTPStatus.METHOD_NOT_ALLOWED, b"GET only\n", deadline)
            else:
                self._answer(conn, HTTPStatus.OK, self._page(), deadline, self._content_type)
        except HttpError as exc:  # a malformed or oversized request, or past its deadline
            with contextlib.suppress(OSError):
                self._answer(conn, HTTPStatus(exc.status), f"{exc}\n".encode(), deadline)
        except OSError:
            pass  # the client went away, or stopped reading: nothing to say
        finally:
            self._done(conn)

    def _done(self, conn: socket.socket) -> None:
        conn.close()
        with self._changed:
            del self._open[conn]
            self._changed.notify_all()

    @staticmethod
    def _answer(
        conn: socket.socket,
        status: HTTPStatus,
        body: bytes,
        deadline: float,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            return  # (a request that ran out of time gets no answer)
        head = (
            f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        conn.settimeout(left)  # (sendall's timeout bounds the whole of it)
        conn.sendall(head.encode() + body)


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

"""Prometheus metrics of a serve job (`serve --metrics-port N`), from global rank 0 only.

Rank 0 takes every push and merges every rank's result, so its figures are the job's; other
ranks (and other nodes) serve no metrics. The registry is a private one (nothing of the
process's default collectors), served over HTTP (prometheus_client's WSGI app) in a daemon
thread: a scrape reads figures the push loop has already set, or computes a gauge from a
number the loop keeps (time since the last good push, pinned memory), and never takes a lock
the push holds. prometheus_client is imported only here, and only when metrics are asked for.

Whatever reaches the port can open connections: at most MAX_SCRAPERS are served at once (one
thread each; more are closed at once), and one that sends nothing for SCRAPE_TIMEOUT_S is
closed, so a flood of idle connections costs a few threads for a few seconds, never the job.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import threading
import time
from collections.abc import Callable
from typing import Any

INSTALL_HINT = "pip install 'ckptctl[metrics]'"
# How a push ended (a rollback counts as a push; the restore after a failed one does not).
OUTCOMES = ("ok", "rolled_back", "failed", "restored", "refused", "cancelled")
STATES = ("starting", "idle", "busy", "stopping")

MAX_SCRAPERS = 8
SCRAPE_TIMEOUT_S = 5.0

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
    """The job's metrics; the serve loop calls `busy`, `pushed` and `stopping`."""

    def __init__(self, pinned_bytes: Callable[[], Any]) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Enum,
            Gauge,
            Histogram,
            Info,
            disable_created_metrics,
        )

        disable_created_metrics()  # (a _created gauge beside every counter: noise to a scrape)
        self.registry = r = CollectorRegistry()
        self._last_ok: float | None = None  # time.monotonic() of the last good push
        self._server_weights = "whole"  # a push that never reached the server changes nothing
        self.pushes = Counter(
            "ckptctl_pushes", "Pushes by how they ended.", ["outcome"], registry=r
        )
        for outcome in OUTCOMES:  # every series from the start: rate() needs its zero
            self.pushes.labels(outcome)
        self.duration = Histogram(
            "ckptctl_push_duration_seconds",
            "Wall time of a push (its slowest rank).",
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
        since = Gauge(
            "ckptctl_seconds_since_last_good_push",
            "Seconds since the last push that succeeded (NaN before the first).",
            registry=r,
        )
        since.set_function(self._since_last_ok)
        pinned = Gauge(
            "ckptctl_pinned_host_memory_bytes",
            "Host memory this rank holds pinned for pushes (serve --register-mode direct).",
            registry=r,
        )
        pinned.set_function(lambda: float(pinned_bytes() or 0))
        self.state = Enum(
            "ckptctl_serve_state", "What the serve job is doing.", states=list(STATES), registry=r
        )
        self._server: Any = None
        self._thread: Any = None

    def _since_last_ok(self) -> float:
        last = self._last_ok
        return math.nan if last is None else time.monotonic() - last

    def serve(self, host: str, port: int) -> None:
        """Listen on host:port (raises OSError when it cannot)."""
        self._server = bounded_server(host, port, self.registry)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="ckptctl-metrics", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # -- the serve loop's hooks (rank 0's main thread) ---------------------------------------

    def idle(self) -> None:
        self.state.state("idle")

    def busy(self) -> None:
        self.state.state("busy")

    def stopping(self) -> None:
        self.state.state("stopping")

    def pushed(
        self, merged: dict[str, Any], stages: list[Any], served: dict[str, Any] | None
    ) -> None:
        """One push is over: `merged` is its answer, `stages` rank 0's StageFigures of it,
        `served` the whole checkpoint the server holds (the loop's history). Metrics must
        never end the job: whatever goes wrong here is dropped."""
        with contextlib.suppress(Exception):
            self._pushed(merged, stages, served)
        self.state.state("idle")

    def _pushed(
        self, merged: dict[str, Any], stages: list[Any], served: dict[str, Any] | None
    ) -> None:
        outcome = outcome_of(merged)
        self.pushes.labels(outcome).inc()
        self.duration.observe(float(merged.get("wall_s") or 0.0))
        for st in stages:
            self.stage_duration.labels(st.name).observe(st.seconds)
            if st.name == "wait_server":
                self.server_wait.observe(st.seconds)
        size = merged.get("total_bytes")
        if merged.get("ok"):  # a push or a rollback that the server took whole
            self._last_ok = time.monotonic()
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


def bounded_server(host: str, port: int, registry: Any) -> Any:
    """A WSGI server of `registry`'s metrics on host:port that serves MAX_SCRAPERS connections
    at once, each for at most SCRAPE_TIMEOUT_S of silence (see the module's docstring)."""
    import socket
    import socketserver
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

    class Handler(WSGIRequestHandler):
        timeout = SCRAPE_TIMEOUT_S  # (socketserver applies it to each connection's reads)

        def log_message(self, *args: Any) -> None:
            pass  # a scrape is not worth a line on the job's stderr

    class Server(socketserver.ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = family
        slots = threading.BoundedSemaphore(MAX_SCRAPERS)

        def process_request(self, request: Any, client_address: Any) -> None:
            if not self.slots.acquire(blocking=False):
                self.shutdown_request(request)  # full: this one is closed unanswered
                return
            try:
                super().process_request(request, client_address)
            except BaseException:
                self.slots.release()
                raise

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                self.slots.release()

        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # a client that hung up or timed out: nothing the job should print

    return make_server(host, port, make_wsgi_app(registry), Server, handler_class=Handler)


def start(host: str, port: int, pinned_bytes: Callable[[], Any]) -> ServeMetrics:
    """The job's metrics, served on host:port; a port that cannot be bound is a usage error."""
    from ckptctl.errors import UsageError

    metrics = ServeMetrics(pinned_bytes)
    metrics.state.state("starting")
    try:
        metrics.serve(host, port)
    except OSError as exc:
        why = exc.strerror or exc
        raise UsageError(f"--metrics-port {port}: cannot listen on {host}: {why}") from None
    return metrics

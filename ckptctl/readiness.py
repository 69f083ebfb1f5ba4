"""Poll an inference server until it is listening, healthy, or serving a given weight version.

Every wait is bounded: each attempt has a deadline of its own for all its requests together
(bounded_http.py), clipped to what is left of the overall deadline, so a server that accepts
and never answers, or trickles its answer, cannot hold us past it.

A server that answers 404 where SGLang or vLLM answer (`/ping`, `/health`) is not one of them:
`wait_ready` says so at once (`ForeignServer`, exit 1) rather than calling it ready, or waiting
out --timeout for a server that will never change its answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from ckptctl.bounded_http import deadline
from ckptctl.errors import OperationFailed
from ckptctl.inference_server import (
    CONTRACTS,
    ServerAddress,
    ServerContract,
    auth_headers,
    describe_failure,
    make_client,
    one_line,
    parse_json_object,
)
from ckptctl.settings import ReadyCondition, ServerKind


@dataclass(frozen=True)
class Probe:
    """The outcome of one attempt."""

    ready: bool
    status: str  # short, for humans: "HTTP 503", "connection refused", "weight version 'v1'"
    http_status: int | None = None
    weight_version: str | None = None
    foreign: bool = False  # it answered, and not like SGLang or vLLM would


class ForeignServer(OperationFailed):
    """The server answers HTTP, but not like SGLang or vLLM: waiting longer will not help."""


@dataclass(frozen=True)
class WaitResult:
    ready: bool
    elapsed_s: float
    attempts: int
    last_status: str
    weight_version: str | None = None

    def as_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "ready": self.ready,
            "elapsed_s": round(self.elapsed_s, 3),
            "attempts": self.attempts,
            "last_status": self.last_status,
        }
        if self.weight_version is not None:
            doc["weight_version"] = self.weight_version
        return doc


def read_weight_version(
    client: httpx.Client, contract: ServerContract, headers: dict[str, str] | None = None
) -> tuple[str | None, str]:
    """(version, status) from the first endpoint this server version has; version None if unread.
    headers: added to each request (the API key, for a client that does not send it)."""
    last = "no weight-version endpoint answered"
    for path in contract.weight_version_paths:
        response = client.get(path, headers=headers)
        if response.status_code == 404:
            continue  # an older or newer SGLang: try the next endpoint
        if response.status_code != 200:
            return None, f"{path} answered HTTP {response.status_code}"
        doc = parse_json_object(response)
        if doc is None or "weight_version" not in doc:
            last = f"{path} answered without a weight_version"
            continue
        version = str(doc["weight_version"])
        return version, f"weight version {one_line(repr(version), 100)}"
    return None, last


class Prober:
    """One client, reused across attempts; each attempt is bounded by `attempt_timeout`."""

    def __init__(
        self,
        address: ServerAddress,
        engine: ServerKind = ServerKind.sglang,
        condition: ReadyCondition = ReadyCondition.listening,
        weight_version: str | None = None,
    ) -> None:
        self.address = address
        self.contract = CONTRACTS[engine]
        self.condition = condition
        self.weight_version = weight_version
        # The key goes only where the server asks for it: to the weight version reads, not
        # with every probe for as long as a server (or whoever took its port) starts.
        self._client = make_client(address, timeout=5.0, send_key=False)

    def close(self) -> None:
        self._client.close()

    @property
    def path(self) -> str:
        """Where this condition is asked."""
        if self.condition == "listening":
            return self.contract.listening_path
        return self.contract.health_path

    def probe(self, attempt_timeout: float) -> Probe:
        """One attempt: every request it makes ends within `attempt_timeout` seconds in all."""
        self._client.timeout = httpx.Timeout(attempt_timeout)
        try:
            with deadline(attempt_timeout):
                response = self._client.get(self.path)
                code = response.status_code
                if code == 404:  # both engines have this path in every version
                    return Probe(False, f"HTTP 404 on {self.path}", code, foreign=True)
                up = True if self.condition == "listening" else code == 200
                if not up or self.weight_version is None:
                    return Probe(up, f"HTTP {code}", code)
                version, status = read_weight_version(
                    self._client, self.contract, auth_headers(self.address)
                )
                return Probe(version == self.weight_version, status, code, version)
        except httpx.HTTPError as exc:  # every transport failure is "not ready yet"
            return Probe(False, describe_failure(exc, self.address, attempt_timeout))

    def foreign_server(self, probe: Probe) -> ForeignServer:
        return ForeignServer(
            f"{self.address.describe()} answered {probe.status}: this does not answer like "
            "SGLang or vLLM (check --endpoint)"
        )


def wait_ready(
    prober: Prober,
    *,
    timeout: float,
    interval: float,
    attempt_timeout: float = 5.0,
    on_attempt: Callable[[Probe, int, float], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> WaitResult:
    """Probe until ready or until `timeout` seconds have passed (never much longer).

    Raises ForeignServer as soon as the server answers in a way neither engine does.
    """
    start = clock()
    deadline = start + timeout
    attempts = 0
    probe = Probe(False, "not tried")
    answered: Probe | None = None  # the last attempt the server answered
    cut_short = False
    while True:
        remaining = deadline - clock()
        if remaining <= 0 and attempts > 0:
            break
        attempts += 1
        cut_short = remaining < attempt_timeout  # the deadline's slice, not a whole attempt
        probe = prober.probe(max(min(attempt_timeout, remaining), 0.05))
        if probe.http_status is not None:
            answered = probe
        elapsed = clock() - start
        if on_attempt is not None:
            on_attempt(probe, attempts, elapsed)
        if probe.foreign:
            raise prober.foreign_server(probe)
        if probe.ready:
            return WaitResult(True, elapsed, attempts, probe.status, probe.weight_version)
        remaining = deadline - clock()
        if remaining <= 0:
            break
        time.sleep(min(interval, remaining))
    if probe.http_status is None and cut_short and answered is not None:
        # An attempt the deadline cut short says nothing of a server that answered before:
        # report that answer (the advice differs: the server runs).
        probe = answered
    return WaitResult(False, clock() - start, attempts, probe.status, probe.weight_version)

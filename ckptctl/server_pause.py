"""Pausing an inference server's generation around a push, and resuming it: the HTTP half of
`--pause` (the job's half is transfer/pausing.py). What each engine and version answers, and
why ckptctl sends what it sends, is in docs/pause-contract.md; in short:

- the version first (VERSION_PATHS): a mode the version cannot honour (TOO_OLD) is refused
  before anything is sent, since the server would not say so itself;
- pause (PAUSE_PATHS; vLLM reads the mode from a query string only, `pause_request`), answered
  once paused (abort, and vLLM's wait, once the generations in flight have ended: the drain);
- resume (RESUME_PATHS): idempotent on both, so retried on a 5xx, a timeout or a broken
  connection, within a bound.

Every exchange is bounded (bounded_http.py) and carries the API key as the update does (SGLang's
pause routes are ADMIN_OPTIONAL: the admin key, else the API key). Only httpx is imported.
"""

from __future__ import annotations

import re
import time
from typing import Any

import httpx

from ckptctl.bounded_http import deadline
from ckptctl.defaults import API_KEY_ENV
from ckptctl.errors import DeadlineExceeded, OperationFailed
from ckptctl.inference_server import (
    VLLM_DEV_MODE_HINT,
    ServerAddress,
    describe_failure,
    make_client,
    one_line,
    parse_json_object,
    server_message,
)
from ckptctl.settings import PauseMode, ServerKind

Release = tuple[int, ...]

VERSION_PATHS = {"sglang": ("/get_server_info", "/server_info"), "vllm": ("/version",)}
PAUSE_PATHS = {"sglang": "/pause_generation", "vllm": "/pause"}
RESUME_PATHS = {"sglang": "/continue_generation", "vllm": "/resume"}

# What a version older than the release named does with a mode, for each mode that needs one,
# oldest first (docs/pause-contract.md, "What the client must do").
_SGLANG_HOLDS = (
    ((0, 4, 9), "has no /pause_generation (SGLang 0.4.9 and later have it)"),
    ((0, 5, 6), "takes any mode and aborts every request (modes from SGLang 0.5.6)"),
    (
        (0, 5, 11),
        "deadlocks an IPC update while it holds requests (SGLang #22290, fixed in 0.5.11)",
    ),
)
_VLLM_MODES = (
    ((0, 12), "has no /pause (vLLM 0.12 and later have it, in dev mode)"),
    ((0, 16), "ignores mode= and aborts every request (modes from vLLM 0.16)"),
)
TOO_OLD: dict[tuple[str, PauseMode], tuple[tuple[Release, str], ...]] = {
    ("sglang", PauseMode.abort): _SGLANG_HOLDS[:1],
    ("sglang", PauseMode.retract): _SGLANG_HOLDS,
    ("sglang", PauseMode.in_place): _SGLANG_HOLDS,
    ("vllm", PauseMode.abort): _VLLM_MODES[:1],
    ("vllm", PauseMode.wait): _VLLM_MODES,
    ("vllm", PauseMode.keep): _VLLM_MODES,
}

# How long one version read may take, and the resume's bounds: a few attempts, a pause between
# them doubling from RESUME_BACKOFF_S, each attempt bounded by RESUME_ATTEMPT_S and all of them
# by the caller's budget.
VERSION_TIMEOUT_S = 10.0
RESUME_ATTEMPTS = 4
RESUME_ATTEMPT_S = 10.0
RESUME_BACKOFF_S = 0.25

_RELEASE = re.compile(r"v?(\d+(?:\.\d+)*)")


def release(version: str | None) -> Release | None:
    """The release numbers a version string starts with ("0.5.5.post3" -> (0, 5, 5, 5)...):
    only its leading numbers, so a dev build or a local tag counts as its release."""
    found = _RELEASE.match(version.strip()) if version else None
    return tuple(int(n) for n in found.group(1).split(".")) if found else None


def version_problem(engine: ServerKind, mode: PauseMode, version: str | None) -> str | None:
    """Why a server of `engine` at `version` cannot honour `mode` (None: it can). A version that
    cannot be read passes for abort (every server with the route aborts; one without answers
    404), and fails for the modes a server might silently turn into an abort."""
    rules = TOO_OLD.get((engine, mode), ())
    if not rules:
        return None
    numbers = release(version)
    if numbers is None:
        if mode is PauseMode.abort:
            return None
        said = f"{version!r}" if version else "nothing"
        return f"reports no version ckptctl can read ({said}), so it may not honour it"
    return next((why for below, why in rules if numbers < below), None)


def flush_cache(engine: ServerKind, mode: PauseMode, version: str | None) -> bool:
    """Whether SGLang's update is asked to flush the radix cache. The flush needs an idle server:
    requests held in place always refuse it, retracted ones (queued) on 0.5.10-0.5.20; a
    refused flush ends the server up to 0.5.21 and answers 400 (weights applied, the version
    not) from 0.5.22. Without it the old weights' prefix cache stays (docs/pause-contract.md)."""
    if engine != "sglang":
        return True  # (vLLM's update has no such flag)
    if mode is PauseMode.in_place:
        return False
    if mode is PauseMode.retract:
        numbers = release(version)
        return numbers is not None and not ((0, 5, 10) <= numbers < (0, 5, 21))
    return True


def read_version(
    address: ServerAddress, engine: ServerKind, timeout: float = VERSION_TIMEOUT_S
) -> str | None:
    """The version the server reports (None where it reports none). Raises OperationFailed when
    it refuses the API key, httpx.HTTPError when it does not answer."""
    with deadline(timeout), make_client(address, timeout=timeout) as client:
        for path in VERSION_PATHS[engine]:
            response = client.get(path)
            if response.status_code == 404:
                continue  # (SGLang's newer route, or none at all)
            _refused_key(response, address, path)
            doc = parse_json_object(response) if response.status_code == 200 else None
            version = doc.get("version") if doc is not None else None
            return one_line(version, 100) if isinstance(version, str) and version else None
    return None


def _refused_key(response: httpx.Response, address: ServerAddress, path: str) -> None:
    if response.status_code in (401, 403):
        raise OperationFailed(
            f"{address.describe()} refused the API key on {path} (HTTP "
            f"{response.status_code}): pass --api-key or set {API_KEY_ENV} (SGLang's pause "
            "routes take its --admin-api-key where one is set)"
        )


def pause_request(engine: ServerKind, mode: PauseMode) -> tuple[str, dict[str, str] | None, Any]:
    """(path, query parameters, JSON body) of the pause: vLLM reads a query string only."""
    if engine == "vllm":
        return PAUSE_PATHS[engine], {"mode": mode.value}, None
    return PAUSE_PATHS[engine], None, {"mode": mode.value}


def pause(
    address: ServerAddress,
    engine: ServerKind,
    mode: PauseMode,
    timeout: float,
    flag: str | None = None,
) -> None:
    """Pause the server's generation in `mode`; returns once the server says it is paused
    (abort and vLLM's wait: once its generations in flight have ended). Raises OperationFailed
    when it refuses, DeadlineExceeded when it does not answer within `timeout` (`flag`: what
    set it, named in that error)."""
    path, params, body = pause_request(engine, mode)
    where = address.describe()
    try:
        with deadline(timeout), make_client(address, timeout=timeout) as client:
            response = client.post(path, params=params, json=body)
    except httpx.TimeoutException:
        raise DeadlineExceeded(
            f"{where} did not answer the pause ({path}, --pause {mode}) within {timeout:.1f}s"
            + (f"; raise {flag} if its generations in flight just take long" if flag else "")
        ) from None
    except httpx.HTTPError as exc:
        raise OperationFailed(
            f"the pause of {where} failed: {describe_failure(exc, address, timeout)}"
        ) from None
    if response.status_code == 200:
        return
    _refused_key(response, address, path)
    if response.status_code == 404:
        hint = VLLM_DEV_MODE_HINT if engine == "vllm" else "SGLang 0.4.9 and later have it"
        why = f"HTTP 404 on {path}: {hint}"
    else:
        why = f"HTTP {response.status_code}: {server_message(response)}"
    raise OperationFailed(f"{where} refused the pause (--pause {mode}): {why}")


class ResumeFailed(OperationFailed):
    """The server's generation could not be resumed: it stays paused."""


def resume(
    address: ServerAddress,
    engine: ServerKind,
    *,
    budget_s: float,
    sleep: Any = time.sleep,
) -> int:
    """Resume the server's generation; returns the attempts it took. Retried on a 5xx, a timeout
    or a broken connection (resuming is idempotent), at most RESUME_ATTEMPTS times within
    `budget_s`; raises ResumeFailed with the last reason otherwise."""
    path = RESUME_PATHS[engine]
    body: dict[str, Any] | None = None if engine == "vllm" else {}  # (SGLang 0.5.6+: an object)
    end = time.monotonic() + budget_s
    wait = RESUME_BACKOFF_S
    for attempt in range(1, RESUME_ATTEMPTS + 1):
        left = max(min(end - time.monotonic(), RESUME_ATTEMPT_S), 0.1)
        try:
            with deadline(left), make_client(address, timeout=left) as client:
                response = client.post(path, json=body)
        except httpx.HTTPError as exc:
            why = describe_failure(exc, address, left)
        else:
            if response.status_code == 200:
                return attempt
            why = f"HTTP {response.status_code} on {path}: {server_message(response)}"
            if response.status_code < 500:  # (a refusal: asking again changes nothing)
                _refused_key(response, address, path)
                break
        if attempt == RESUME_ATTEMPTS or time.monotonic() + wait >= end:
            break
        sleep(wait)
        wait *= 2
    tries = f"{attempt} attempt{'s' if attempt > 1 else ''}"
    raise ResumeFailed(f"{address.describe()} did not resume its generation ({tries}): {why}")


def left_paused(why: str, address: ServerAddress, engine: ServerKind) -> str:
    """Why a server could not be resumed, and what an operator runs to resume it."""
    return f"{why}; it stays paused: resume it by hand (POST {address.describe()}{RESUME_PATHS[engine]})"


def probe_routes(
    address: ServerAddress, engine: ServerKind, mode: PauseMode, timeout: float
) -> str:
    """Whether the server offers what `mode` needs, asked without side effects: its version (the
    gate), then a GET on each route - SGLang answers 405 on a POST-only route it has and 404 on
    one it lacks; vLLM answers GET /is_paused. Returns what it found; raises OperationFailed
    (with the reason) where the mode cannot be used, httpx.HTTPError where it does not answer."""
    where = address.describe()
    with deadline(timeout):
        version = read_version(address, engine, timeout)
        problem = version_problem(engine, mode, version)
        if problem is not None:
            raise OperationFailed(f"{where}: {engine} {version or '(version unknown)'} {problem}")
        probes = (
            (("/is_paused", 200), (RESUME_PATHS[engine], 405))
            if engine == "vllm"
            else ((PAUSE_PATHS[engine], 405), (RESUME_PATHS[engine], 405))
        )
        with make_client(address, timeout=timeout) as client:
            for path, offered in probes:
                response = client.get(path)
                _refused_key(response, address, path)
                if response.status_code != offered:
                    hint = f"; {VLLM_DEV_MODE_HINT}" if engine == "vllm" else ""
                    raise OperationFailed(
                        f"{where}: {engine} {version or '(version unknown)'} answers HTTP "
                        f"{response.status_code} on {path} (not the route --pause needs){hint}"
                    )
    routes = " and ".join(path for path, _ in probes)
    return f"{where}: {engine} {version or '(version unknown)'}, {routes}: --pause {mode} works"

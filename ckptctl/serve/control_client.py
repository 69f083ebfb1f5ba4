"""The client half of a serve job's control socket: which socket to talk to, the checks
before and after connecting, and one bounded HTTP request over it (`push`, `status`, `stop`
and ckptctl.client).

The server half and where sockets live are ckptctl.serve.control; a client trusts a
socket only if its file and the process listening on it are this user's. No torch here.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptctl.errors import DeadlineExceeded, OperationFailed, UsageError
from ckptctl.serve.control import SOCKET_GLOB, check_private_dir, socket_dirs, targets_key
from ckptctl.unix_peers import peer_uid

MAX_RESPONSE_BYTES = 16 * 1024 * 1024  # a push's answer carries every rank's figures


class NotAnswering(OperationFailed):
    """No serve job of this user answers there (no socket, nobody listening)."""


@dataclass(frozen=True)
class Names:
    """How a client's messages name its knobs: Python arguments (ckptctl.client), or the
    CLI's flags."""

    wait: str = "wait=SECONDS"  # "": the command has no wait for a job to offer
    timeout: str = "timeout="
    endpoint: str = "endpoint=URL"
    control_socket: str = "control_socket=PATH"
    trace: str = "trace="

    def without_wait(self) -> Names:
        """For a command with no wait for a job to start (rollback, stop), or one whose wait
        ran out: its errors offer none."""
        return replace(self, wait="")


ARGUMENTS = Names()
FLAGS = Names(
    wait="--wait SECONDS",
    timeout="--timeout",
    endpoint="--endpoint URL",
    control_socket="--control-socket PATH",
    trace="--trace",
)


def check_client_socket(path: str, names: Names = ARGUMENTS) -> None:
    """Before connecting: `path` must be a socket owned by this user."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise NotAnswering(f"no serve job answers on {path}: {_start_one(names)}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise OperationFailed(f"{path} is not a socket: not a serve job's control socket")
    if st.st_uid != os.getuid():
        raise OperationFailed(
            f"{path} belongs to uid {st.st_uid}, not to you: refusing to talk to it "
            "(another user's socket, or one planted there)"
        )


def _connect(path: str, timeout: float, names: Names = ARGUMENTS) -> socket.socket:
    check_client_socket(path, names)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(max(min(timeout, 10.0), 0.1))
    try:
        sock.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        raise NotAnswering(
            f"no serve job answers on {path} (a socket left by a job that ended?): start one "
            "with `torchrun ... ckptctl serve`"
        ) from None
    except OSError as exc:
        sock.close()
        raise OperationFailed(f"cannot connect to {path}: {exc.strerror or exc}") from None
    uid = peer_uid(sock)
    if uid != os.getuid():
        sock.close()
        raise OperationFailed(
            f"the process listening on {path} runs as uid {uid}, not as you: refusing to talk to it"
        )
    return sock


def answers(path: str) -> bool:
    """Whether a serve job of this user listens on `path` (connects, checks, hangs up)."""
    try:
        _connect(path, 2.0).close()
    except (OperationFailed, OSError):
        return False
    return True


def call(
    path: str,
    method: str,
    route: str,
    body: dict[str, Any] | None,
    timeout: float,
    *,
    flag: str | None = None,
) -> tuple[int, dict[str, Any]]:
    """One request to the serve job on `path`: (HTTP status, JSON answer), within `timeout` s
    (`flag`: the argument or flag that set it, named when it runs out)."""
    deadline = time.monotonic() + timeout
    sock = _connect(path, timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else b""
        head = (
            f"{method} {route} HTTP/1.1\r\nHost: serve\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        )
        sock.sendall(head.encode() + payload)
        raw = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(
                    f"the serve job on {path} did not answer within {timeout:g}s"
                    + (f" (raise {flag})" if flag else "")
                )
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                break
            raw += chunk
            if len(raw) > MAX_RESPONSE_BYTES:
                raise OperationFailed(f"the answer on {path} exceeds {MAX_RESPONSE_BYTES} bytes")
    except OSError as exc:
        raise OperationFailed(f"the serve job on {path} broke off: {exc.strerror or exc}") from None
    finally:
        sock.close()
    head_bytes, sep, data = raw.partition(b"\r\n\r\n")
    status_line = head_bytes.split(b"\r\n", 1)[0].split(b" ")
    try:
        status = int(status_line[1]) if sep else 0
        doc = json.loads(data)
    except (IndexError, ValueError):
        status, doc = 0, None
    if not status or not isinstance(doc, dict):
        raise OperationFailed(
            f"the serve job on {path} ended the connection without an answer (it may have stopped)"
        )
    return status, doc


# -- which socket a client talks to --------------------------------------------------------------


def live_sockets(tmp_root: str = "/tmp") -> list[str]:
    """The control sockets of this user's serve jobs on this node that answer."""
    found = []
    for d in socket_dirs(tmp_root):
        try:
            check_private_dir(d)
        except UsageError:
            continue  # missing, or not private: no serve job of ours put a socket there
        for p in sorted(d.glob(SOCKET_GLOB)):
            if answers(str(p)):
                found.append(str(p))
    return found


def _serves(path: str, wanted: Sequence[str]) -> bool:
    try:
        status, doc = call(path, "GET", "/status", None, 5.0)
    except OperationFailed:
        return False
    have = {str(t).rstrip("/") for t in doc.get("targets") or []}
    return status == 200 and all(w.rstrip("/") in have for w in wanted)


def choose_socket(wanted: Sequence[str], tmp_root: str = "/tmp", names: Names = ARGUMENTS) -> str:
    """The socket of the one serve job that feeds `wanted` (every job when empty); refuse to
    guess among several."""
    live = live_sockets(tmp_root)
    if wanted:
        named = [p for p in live if Path(p).name == f"serve-{targets_key(wanted)}.sock"]
        live = named or [p for p in live if _serves(p, wanted)]
    if len(live) == 1:
        return live[0]
    which = f" for {', '.join(wanted)}" if wanted else ""
    if not live:
        raise NotAnswering(
            f"no serve job of yours answers on this node{which} (looked in "
            f"{', '.join(str(d) for d in socket_dirs(tmp_root))}): {_start_one(names)}"
        )
    raise UsageError(
        f"{len(live)} serve jobs answer on this node{which}: pick one with {names.endpoint} or "
        f"{names.control_socket} ({'; '.join(live)})"
    )


def _start_one(names: Names) -> str:
    """What to do when no job answers: the wait only where the command has one to give."""
    start = "start one with `torchrun ... ckptctl serve`"
    return f"{start}, or wait for it with {names.wait}" if names.wait else start


def resolve_socket(
    explicit: str | None,
    wanted: Sequence[str],
    wait_s: float,
    tmp_root: str = "/tmp",
    names: Names = ARGUMENTS,
) -> str:
    """The control socket to talk to, waiting up to `wait_s` for a serve job to answer on it
    (`serve &` then `push --wait 600`: the socket appears once every rank is up)."""
    deadline = time.monotonic() + max(wait_s, 0.0)
    if wait_s > 0:  # (it was given: the error says how long it waited instead)
        names = names.without_wait()
    while True:
        try:
            if explicit:
                _connect(explicit, 2.0, names).close()  # raises why not
                return explicit
            return choose_socket(wanted, tmp_root, names)
        except NotAnswering as exc:
            if time.monotonic() >= deadline:
                if wait_s > 0:
                    raise DeadlineExceeded(f"waited {wait_s:g}s: {exc}") from None
                raise
        time.sleep(0.2)

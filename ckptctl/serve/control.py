"""The serve job's control socket, server side: the one part of `serve` that other users can
reach. Its client half is ckptctl.serve.control_client.

What it trusts: a process of the job owner's uid, and nothing else. Four checks make it so:

- the socket lives in a directory only its owner can enter: `$XDG_RUNTIME_DIR/ckptctl/` when
  XDG_RUNTIME_DIR is set, else `/tmp/ckptctl-<uid>/`, or `$CKPTCTL_SOCKET_DIR` alone when that
  is set (the test suite sets it: it never sees a job of the user's). Each is checked with
  lstat (a directory, not a symlink, owned by the user, mode 0700) and refused otherwise, never
  "fixed";
- the socket itself is 0600, whatever the umask;
- the server reads every connection's peer credentials (SO_PEERCRED) and answers another uid
  403 without parsing a byte of its request;
- a client checks, before connecting, that the path is a socket owned by the user and, once
  connected, that the process listening runs as the user (SO_PEERCRED again; control_client.py).

`--control-socket PATH` may put it elsewhere: then an existing file at PATH that is not a
socket is refused (never deleted), a socket of another user is refused, a socket of the user
that nobody listens on (a job that died) is replaced, and one that answers is in use.

Default names are `serve-<digest>.sock`, the digest taken from the servers the job feeds
(its --uds paths, else its --endpoint URLs): two serve jobs on one node (two inference
servers) never share a socket, and `push --endpoint URL` finds the job that feeds URL.
Without a name a client takes the only job that answers, and refuses to guess among several.

The HTTP spoken here is ckptctl.small_http's, parsed with bounds (one request per connection,
headers up to 16 KiB, a JSON body up to 64 KiB, the whole request within 10 s), with at most
32 connections at once. Answers are JSON. No torch here: the client half imports this module
for where sockets live, and `push` and `status` start fast.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ckptctl.defaults import SOCKET_DIR_ENV
from ckptctl.errors import UsageError, print_error
from ckptctl.small_http import (
    REQUEST_DEADLINE_S,
    HttpError,
    discard_rest,
    parse_body,
    read_request,
    send_json,
)
from ckptctl.unix_peers import peer_uid

MAX_CONNECTIONS = 32
# How long a closing job waits for the answers its handlers have returned to reach their clients:
# the answer to `stop` is written after the handler returns, while the job is already ending,
# and the process must not end first (the client would see no answer and exit 1).
ANSWER_GRACE_S = 2.0
SOCKET_GLOB = "serve-*.sock"

# (parsed JSON body, or None without one) -> (HTTP status, JSON answer)
Handler = Callable[[Any], tuple[int, dict[str, Any]]]


# -- where sockets live ----------------------------------------------------------------------------


def check_private_dir(path: str | os.PathLike[str]) -> None:
    """Refuse unless `path` is a real directory (not a symlink) of this user that nobody else
    can enter (mode 0700 or stricter)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UsageError(f"{path} does not exist") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UsageError(
            f"{path} is not a directory (a symlink or a file): it cannot hold a private control "
            "socket; remove it, or pass --control-socket"
        )
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UsageError(
            f"{path} is not a private directory of yours (owner uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}; needed: uid {os.getuid()}, 0700): remove it, "
            "set XDG_RUNTIME_DIR, or pass --control-socket"
        )


def socket_dirs(tmp_root: str = "/tmp") -> list[Path]:
    """Where serve jobs of this user put their sockets, in order of preference."""
    chosen = os.environ.get(SOCKET_DIR_ENV)
    if chosen:  # in place of both defaults: a job or a client looks nowhere else
        if not os.path.isabs(chosen):
            raise UsageError(f"{SOCKET_DIR_ENV}={chosen} is not an absolute path")
        return [Path(chosen)]
    dirs = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        dirs.append(Path(runtime) / "ckptctl")
    dirs.append(Path(tmp_root) / f"ckptctl-{os.getuid()}")
    return dirs


def private_socket_dir(tmp_root: str = "/tmp") -> Path:
    """The directory a serve job puts its socket in, created 0700 if missing, always checked."""
    path = socket_dirs(tmp_root)[0]
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and not os.environ.get(SOCKET_DIR_ENV):
        st = os.lstat(runtime) if os.path.lexists(runtime) else None
        if (
            st is None
            or not stat.S_ISDIR(st.st_mode)
            or st.st_uid != os.getuid()
            or (st.st_mode & 0o022)
        ):
            raise UsageError(
                f"XDG_RUNTIME_DIR={runtime} is not a directory of yours that only you can write "
                "to: fix or unset it, or pass --control-socket"
            )
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # mkdir's mode passes through the umask
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(
            f"cannot create {path} for the control socket ({exc.strerror or exc}): set "
            "XDG_RUNTIME_DIR, or pass --control-socket"
        ) from None
    check_private_dir(path)
    return path


def targets_key(targets: Sequence[str]) -> str:
    """The servers a job feeds, as they name its default socket."""
    return hashlib.sha256("\n".join(t.rstrip("/") for t in targets).encode()).hexdigest()[:12]


def default_socket_path(targets: Sequence[str], tmp_root: str = "/tmp") -> str:
    return str(private_socket_dir(tmp_root) / f"serve-{targets_key(targets)}.sock")


def job_targets(endpoints: Sequence[str], uds: Sequence[str]) -> list[str]:
    """What identifies the servers a job feeds: their Unix sockets when given, else the URLs."""
    return [str(u) for u in uds] if uds else [e.rstrip("/") for e in endpoints]


# -- the server ------------------------------------------------------------------------------------


class ControlServer:
    """A bounded JSON-over-HTTP endpoint on a Unix socket, for the job owner's uid only.

    `handlers` maps (method, path) to a function of the parsed body; a handler may block (a
    push waits for its result) and is called on the connection's own thread.
    """

    def __init__(
        self,
        path: str,
        handlers: dict[tuple[str, str], Handler],
        *,
        request_deadline_s: float = REQUEST_DEADLINE_S,
    ) -> None:
        self.path = path
        self.handlers = handlers
        self.request_deadline_s = request_deadline_s
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._refusals = threading.BoundedSemaphore(8)
        self._closed = threading.Event()
        self._answering: set[threading.Thread] = set()  # requests read, being answered
        self._answering_lock = threading.Lock()
        self._sock = _bind_private(path)
        st = os.lstat(path)
        self._identity = (st.st_dev, st.st_ino)
        self._thread = threading.Thread(
            target=self._accept_loop, name="ckptctl-control", daemon=True
        )

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def close(self) -> None:
        """Remove the socket - only if it is still the one we made - and stop accepting (in
        that order: a client refused by the job finds no socket file left behind)."""
        self._closed.set()
        with contextlib.suppress(OSError):
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
        self._thread.join(timeout=2)
        with contextlib.suppress(OSError):
            self._sock.close()
        deadline = time.monotonic() + ANSWER_GRACE_S
        with self._answering_lock:
            answering = list(self._answering)
        for thread in answering:  # (one whose handler still blocks is left to die with us)
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _accept_loop(self) -> None:
        self._sock.settimeout(0.2)
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.1)  # out of file descriptors, say: do not spin
                continue
            try:
                uid = peer_uid(conn)
            except OSError:
                conn.close()
                continue
            if uid != os.getuid():
                error = f"this serve job takes commands from uid {os.getuid()} only, not {uid}"
                self._refuse(conn, 403, error)
                continue
            if not self._slots.acquire(blocking=False):
                self._refuse(conn, 503, f"more than {MAX_CONNECTIONS} connections at once")
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="ckptctl-control-conn", daemon=True
            ).start()

    def _refuse(self, conn: socket.socket, status: int, error: str) -> None:
        """Another uid (403), or too many connections (503): answered in a thread of its own,
        the request never parsed but let in (closed unread, the answer would be lost to a
        reset); past 8 refusals at once, closed unanswered."""
        if not self._refusals.acquire(blocking=False):
            conn.close()
            return

        def run() -> None:
            try:
                send_json(conn, status, {"ok": False, "error": error})
                discard_rest(conn)
            except OSError:
                pass
            finally:
                conn.close()
                self._refusals.release()

        threading.Thread(target=run, name="ckptctl-control-refuse", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                request = read_request(conn, time.monotonic() + self.request_deadline_s)
                if request is None:
                    return  # a probe (`push --wait`) or a client that gave up
                method, path, body = request
                doc = parse_body(body)
                if not any(p == path for _, p in self.handlers):
                    raise HttpError(404, f"no such path: {path[:100]}")
                handler = self.handlers.get((method, path))
                if handler is None:
                    raise HttpError(405, f"{method[:10]} is not allowed on {path}")
            except HttpError as exc:
                send_json(conn, exc.status, {"ok": False, "error": str(exc)})
                discard_rest(conn)
                return
            with self._answering_lock:  # (a client still sending its request is not waited for)
                self._answering.add(threading.current_thread())
            try:
                status, answer = handler(doc)
            except Exception as exc:  # noqa: BLE001 - one line on the job's stderr, never a traceback
                print_error(f"control socket: {type(exc).__name__}: {exc}", label="warning")
                status, answer = 500, {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            send_json(conn, status, answer)
        except OSError:
            pass  # the client went away: nothing to answer
        finally:
            conn.close()
            self._slots.release()
            with self._answering_lock:
                self._answering.discard(threading.current_thread())


def _bind_private(path: str) -> socket.socket:
    if check_socket_path(path):
        os.unlink(path)  # a job of ours that is gone left it
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The socket is made 0600 as it is bound: never a moment in which it is open to others,
    # and no chmod after, which would follow a symlink swapped in at `path` meanwhile.
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(
                f"{path} is in use by another serve job: pick --control-socket"
            ) from None
        raise UsageError(
            f"cannot create the control socket {path}: {exc.strerror or exc}"
        ) from None
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


def check_socket_path(path: str) -> bool:
    """Whether a serve job may put its socket at `path`; True when a stale socket of ours (a
    job that died) is in the way and may be replaced. Refuses anything else there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UsageError(
                f"cannot create the control socket {path}: no such directory"
            ) from None
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise UsageError(
            f"{path} exists and is not a socket: refusing to replace it (pick another "
            "--control-socket)"
        )
    if st.st_uid != os.getuid():
        raise UsageError(
            f"{path} is a socket of uid {st.st_uid}, not yours: refusing to use or remove it "
            "(pick another --control-socket)"
        )
    if _listening(path):
        raise UsageError(f"{path} is in use by another serve job: pick --control-socket")
    return True


def _listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True

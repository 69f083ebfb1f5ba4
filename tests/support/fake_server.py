"""Real HTTP servers on loopback or a Unix socket that answer the way SGLang and vLLM answer.

`FakeServer` speaks the contract of one engine version (see the project's sglang-contract notes):

- SGLang <= 0.5.22: `/ping` 200 at once; 0.5.23: `/ping` 503 until the first weights arrive.
- `/health` 503 while waiting for weights, 200 after.
- `/model_info` (0.5.9+), `/get_weight_version` (up to 0.5.20), `/get_model_info`.
- `POST /update_weights_from_ipc`: 200 `{"success": true, ...}` or 400 `{"success": false, ...}`.
- `/weights_checker` (0.5.6+): SGLang's weights checker, version by version, over the tensors
  in `Behaviour.held` (tests/support/fake_checker.py; what each version answers: WEIGHTS-CHECKER.md).
- vLLM: `/health` 200 from the start, `POST /collective_rpc` → `{"results": [...]}`.
- Generations in flight, the model-update locks and the pause modes of both engines
  (`/generate`, `/pause_generation`, `/continue_generation`; vLLM's `/v1/completions`, `/pause`,
  `/resume`, `/is_paused`), version by version: tests/support/fake_generation.py.

It can also misbehave: hang (accept, never answer), reset the connection, answer garbage, 5xx,
require an API key, trickle its headers or body a byte at a time, stream an endless body or
announce a huge one, echo the request's headers in its error message. The `/update_weights_from_ipc` and `/collective_rpc` handlers call a
pluggable `on_update(zmq_handles, body)` so the GPU receiver can do the real IPC load.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# Arrival and answer order of every request of every FakeServer in this process (`requests`):
# what one server saw before another did, without a clock.
ORDER = itertools.count()

# Which read-back endpoints each SGLang version has; `weights_checker`: the checker's
# generation (fake_checker.CHECKER_VERSIONS), None where the route does not exist.
SGLANG_PROFILES: dict[str, dict[str, Any]] = {
    "sglang-0.5.4": {
        "ping_503_before_weights": False,
        "model_info": False,
        "get_weight_version": True,
        "weights_checker": None,
    },
    "sglang-0.5.9": {
        "ping_503_before_weights": False,
        "model_info": True,
        "get_weight_version": True,
        "weights_checker": "0.5.6",
    },
    "sglang-0.5.12": {
        "ping_503_before_weights": False,
        "model_info": True,
        "get_weight_version": True,
        "weights_checker": "0.5.12",
    },
    "sglang-0.5.14": {
        "ping_503_before_weights": False,
        "model_info": True,
        "get_weight_version": True,
        "weights_checker": "0.5.13",
    },
    "sglang-0.5.22": {
        "ping_503_before_weights": False,
        "model_info": True,
        "get_weight_version": False,
        "weights_checker": "0.5.13",
    },
    "sglang-0.5.23": {
        "ping_503_before_weights": True,
        "model_info": True,
        "get_weight_version": False,
        "weights_checker": "0.5.23",
    },
    # Not a release: 0.5.23 plus the compare_checksum of SGLang PR #17009 (closed unmerged).
    "sglang-pr17009": {
        "ping_503_before_weights": True,
        "model_info": True,
        "get_weight_version": False,
        "weights_checker": "pr17009",
    },
}
PROFILES = (*SGLANG_PROFILES, "vllm")


class ServerDied(Exception):
    """Raised by an update handler: the server drops the request's connection unanswered (its
    process died mid-transfer)."""


# (zmq_handles, request body) -> None on success, or raise to fail the update with that message.
UpdateHandler = Callable[[dict[str, str], dict[str, Any]], None]
# (parsed JSON body or None) -> (HTTP status, JSON document or raw bytes): a test-control route.
RouteHandler = Callable[[Any], tuple[int, Any]]


@dataclass
class Behaviour:
    """What the server does; tests change fields while it runs."""

    profile: str = "sglang-0.5.23"
    weights_loaded: bool = False
    weight_version: str = "default"
    # misbehaviour for every request: None | "hang" | "reset" | "garbage" | "http500" | "bad_json"
    # | "trickle_headers" | "trickle_body" | "endless_body" | "huge_length" | "echo_headers"
    mode: str | None = None
    mode_paths: tuple[str, ...] = ()  # when set, the misbehaviour is only on these paths
    mode_times: int | None = None  # when set, the misbehaviour only this many more times
    trickle_interval_s: float = 0.05  # between two bytes of a trickle: far below any timeout
    bytes_sent: int = 0  # by the misbehaviours that stream (trickles, endless bodies)
    disconnects: int = 0  # times a streaming misbehaviour found the client gone
    api_key: str | None = None
    update_status: int = 200  # 400 → refuse with update_message
    update_message: str = "IPC weight update completed successfully"
    update_delay_s: float = 0.0
    on_update: UpdateHandler | None = None
    # ("GET" | "POST", path) -> handler. Served before misbehaviour and the API key, in every
    # profile, so a test can always inspect and steer the server (see gpu_receiver.py).
    routes: dict[tuple[str, str], RouteHandler] = field(default_factory=dict)
    # Every request, in arrival order: method, path, headers, body, and the HTTP status it
    # was answered with ("status", set as the answer goes out; absent while it is pending or
    # when the server misbehaved instead). Tests assert on what the server saw, not on time.
    requests: list[dict[str, Any]] = field(default_factory=list)
    # What /weights_checker sees (a fake_checker.HeldWeights); an empty one when None.
    held: Any = None
    # The engine's version (fake_generation.py): the profile's by default, vLLM 0.34.0.
    version: str | None = None
    token_delay_s: float = 0.01  # one token of a generation (its max_new_tokens / max_tokens)
    abort_poll_s: float = 1.0  # SGLang's abort pause looks again this often for the drain
    _generations: Any = None

    def generations(self) -> Any:
        """The server's generations and pause state (fake_generation.Generations)."""
        if self._generations is None:
            from fake_generation import Generations

            kind = "vllm" if self.profile == "vllm" else "sglang"
            number = self.profile.rsplit("-", 1)[-1]
            default = "0.34.0" if kind == "vllm" else (number if number[:1].isdigit() else "0.5.23")
            self._generations = Generations(kind, self.version or default, self)
        return self._generations

    def statuses(self, path: str) -> list[int]:
        """The statuses answered so far to requests for `path` (query string ignored)."""
        return [
            r["status"]
            for r in list(self.requests)
            if r["path"].split("?")[0] == path and "status" in r
        ]


class _Handler(BaseHTTPRequestHandler):
    server: Any  # _TCPServer | _UnixServer, both carry .behaviour and .stopping
    protocol_version = "HTTP/1.1"
    _entry: dict[str, Any] | None = None  # this request's record in behaviour.requests

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep tests quiet
        pass

    # -- plumbing ---------------------------------------------------------------------------
    def _send_json(self, status: int, doc: Any) -> None:
        body = json.dumps(doc).encode()
        self._answering(status)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _send_empty(self, status: int) -> None:
        self._answering(status)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _answering(self, status: int) -> None:
        """Record the status before any byte of the answer leaves: once the client has an
        answer, the test sees its status; a change the test makes after seeing it can no
        longer reach that answer."""
        if self._entry is not None:
            self._entry["status"] = status
            self._entry["answered"] = next(ORDER)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _misbehave(self) -> bool:
        """Apply the server-wide misbehaviour; True when the request has been dealt with."""
        b: Behaviour = self.server.behaviour
        if b.mode_paths and self.path.split("?")[0] not in b.mode_paths:
            return False
        if b.mode is not None and b.mode_times is not None:
            if b.mode_times <= 0:
                return False
            b.mode_times -= 1
        if b.mode == "hang":
            while not self.server.stopping.wait(0.05):
                pass
            self.close_connection = True
            return True
        if b.mode == "reset":
            # SO_LINGER 0 turns close() into a TCP RST.
            with contextlib.suppress(OSError):
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
            self.close_connection = True
            self.connection.close()
            return True
        if b.mode == "garbage":
            self.wfile.write(b"\x00\xffNOT HTTP AT ALL\r\n\r\n")
            self.close_connection = True
            return True
        if b.mode == "http500":
            self._send_json(500, {"detail": "Internal Server Error"})
            return True
        if b.mode == "echo_headers":
            # A proxy or framework that quotes the whole request back in its error.
            seen = "; ".join(f"{k}: {v}" for k, v in self.headers.items())
            self._send_json(400, {"success": False, "message": f"bad request ({seen})"})
            return True
        if b.mode in _STREAMING:
            self.close_connection = True
            _STREAMING[b.mode](self)
            return True
        return False

    # -- streaming misbehaviours: count what they send, notice when the client is gone -----
    def _stream(self, data: bytes, *, trickle: bool) -> bool:
        """Send `data` (a byte at a time when trickling); False once the client is gone."""
        b: Behaviour = self.server.behaviour
        pieces = [data[i : i + 1] for i in range(len(data))] if trickle else [data]
        for piece in pieces:
            if self.server.stopping.is_set():
                return False
            try:
                self.wfile.write(piece)
            except OSError:  # BrokenPipe, ConnectionReset: the client hung up
                b.disconnects += 1
                return False
            b.bytes_sent += len(piece)
            if trickle:
                time.sleep(b.trickle_interval_s)
        return True

    def _trickle_headers(self) -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Slow: " + b"a" * 50_000
        self._stream(head + b"\r\n\r\n{}", trickle=True)

    def _trickle_body(self) -> None:
        length = 100_000
        head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {length}"
        if self._stream(head.encode() + b"\r\n\r\n", trickle=False):
            self._stream(b" " * length, trickle=True)

    def _endless_body(self, length: int | None = None) -> None:
        head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        # Without a length, an HTTP/1.1 body runs until the server closes: here, never.
        head += f"Content-Length: {length}\r\n\r\n" if length else "Connection: close\r\n\r\n"
        chunk = b"[" * 65536
        if self._stream(head.encode(), trickle=False):
            while self._stream(chunk, trickle=False):
                pass

    def _huge_length(self) -> None:
        self._endless_body(length=10**12)

    def _authorised(self) -> bool:
        """SGLang's API key check: every route but /health* and /metrics."""
        b: Behaviour = self.server.behaviour
        if b.api_key is None or self.headers.get("Authorization") == f"Bearer {b.api_key}":
            return True
        if self.path.startswith(("/health", "/metrics")):
            return True
        self._send_json(401, {"error": "Unauthorized"})
        return False

    def _control_route(self, method: str, body: bytes) -> bool:
        """Serve a test-control route if one is registered for this path; True if served."""
        route = self.server.behaviour.routes.get((method, self.path.split("?")[0]))
        if route is None:
            return False
        try:
            doc = json.loads(body) if body else None
        except ValueError:
            self._send_json(400, {"error": "body is not JSON"})
            return True
        status, answer = route(doc)
        if isinstance(answer, bytes):  # a body as it is (a hostile one, say)
            self._send_raw(status, answer)
        else:
            self._send_json(status, answer)
        return True

    def _record(self, method: str, body: bytes) -> None:
        self._entry = {
            "method": method,
            "path": self.path,
            "headers": dict(self.headers),
            "body": body,
            "arrived": next(ORDER),
        }
        self.server.behaviour.requests.append(self._entry)

    # -- routes -----------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._record("GET", b"")
        if (
            self._control_route("GET", b"")
            or self.path == "/stand-in/generations"
            and (self._generation_route("GET", b""))
        ):
            return
        if self._misbehave() or not self._authorised():
            return
        b: Behaviour = self.server.behaviour
        path = self.path.split("?")[0]
        if self._generation_route("GET", b""):
            return None
        if b.profile == "vllm":
            if path == "/health":
                return self._send_empty(200)
            return self._send_json(404, {"detail": "Not Found"})
        prof = SGLANG_PROFILES[b.profile]
        ready = b.weights_loaded
        if path == "/ping":
            return self._send_empty(503 if (prof["ping_503_before_weights"] and not ready) else 200)
        if path in ("/health", "/health_generate"):
            return self._send_empty(200 if ready else 503)
        if path == "/model_info" and prof["model_info"] or path == "/get_model_info":
            if b.mode == "bad_json":
                return self._send_raw(200, b"<html>not json</html>")
            return self._send_json(
                200,
                {
                    "model_path": "Qwen/Qwen3-8B",
                    "tokenizer_path": "Qwen/Qwen3-8B",
                    "is_generation": True,
                    "weight_version": b.weight_version,
                },
            )
        if path == "/get_weight_version" and prof["get_weight_version"]:
            return self._send_json(200, {"weight_version": b.weight_version})
        if path == "/weights_checker":
            return self._weights_checker(prof, None, method="GET")
        return self._send_json(404, {"detail": "Not Found"})

    def _weights_checker(self, prof: dict[str, Any], doc: Any, *, method: str) -> None:
        from fake_checker import CHECKER_VERSIONS, HeldWeights, checker_answer

        version = prof["weights_checker"]
        if version is None:
            return self._send_json(404, {"detail": "Not Found"})
        if method == "GET" and not CHECKER_VERSIONS[version]["get"]:
            return self._send_json(405, {"detail": "Method Not Allowed"})
        b: Behaviour = self.server.behaviour
        if b.held is None:
            b.held = HeldWeights()
        try:
            status, body = checker_answer(version, b.held, doc)
        except Exception as exc:  # noqa: BLE001 - SGLang's scheduler reports it the same way
            status, body = 400, {"success": False, "message": f"{exc}"}
        return self._send_json(status, body)

    def _generation_route(self, method: str, body: bytes) -> bool:
        """Serve a route of fake_generation.py (generations, pauses, versions); True if served."""
        answer = self.server.behaviour.generations().route(method, self.path, body)
        if answer is None:
            return False
        self._send_json(*answer)
        return True

    def _send_raw(self, status: int, body: bytes) -> None:
        self._answering(status)
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        body = self._read_body()
        self._record("POST", body)
        if (
            self._control_route("POST", body)
            or self.path == "/stand-in/finish"
            and (self._generation_route("POST", body))
        ):
            return
        if self._misbehave() or not self._authorised():
            return
        b: Behaviour = self.server.behaviour
        path = self.path.split("?")[0]
        if self._generation_route("POST", body):
            return None
        try:
            doc = json.loads(body or b"null")
        except ValueError:
            doc = None
        if b.profile == "vllm" and path == "/collective_rpc":
            if not isinstance(doc, dict) or "method" not in doc:
                return self._send_json(400, {"error": "Missing 'method' in request body"})
            if doc["method"] != "update_weights_from_ipc":
                return self._send_json(500, {"error": f"unknown method {doc['method']}"})
            handles = (doc.get("args") or [{}])[0]
            with b.generations().updating():
                return self._apply_update(handles, doc, vllm=True)
        if b.profile != "vllm" and path == "/update_weights_from_ipc":
            if not isinstance(doc, dict) or not isinstance(doc.get("zmq_handles"), dict):
                return self._send_json(
                    400,
                    {
                        "object": "error",
                        "message": "zmq_handles: Field required",
                        "type": "BadRequestError",
                        "code": 400,
                    },
                )
            with b.generations().updating():  # (SGLang's writer lock: after every generation)
                return self._apply_update(doc["zmq_handles"], doc, vllm=False)
        if b.profile != "vllm" and path == "/weights_checker":
            return self._weights_checker(SGLANG_PROFILES[b.profile], doc, method="POST")
        return self._send_json(404, {"detail": "Not Found"})

    def _apply_update(self, handles: dict[str, str], doc: dict[str, Any], *, vllm: bool) -> None:
        b: Behaviour = self.server.behaviour
        if b.update_delay_s:
            time.sleep(b.update_delay_s)
        if b.update_status != 200:
            if vllm:
                return self._send_json(b.update_status, {"error": b.update_message})
            return self._send_json(b.update_status, {"success": False, "message": b.update_message})
        try:
            if b.on_update is not None:
                b.on_update(handles, doc)
        except ServerDied:  # the process died mid-transfer: the connection drops, unanswered
            self.close_connection = True
            self.connection.close()
            return None
        except Exception as exc:  # noqa: BLE001 - the server reports it like SGLang does
            if vllm:
                return self._send_json(500, {"error": f"{type(exc).__name__}: {exc}"})
            return self._send_json(
                400, {"success": False, "message": f"IPC weight update failed: {exc}"}
            )
        b.weights_loaded = True
        if vllm:
            return self._send_json(200, {"results": [None]})
        refused = b.generations().flush_refusal(doc.get("flush_cache", True))
        if refused == "crash":  # (SGLang before 0.5.22 asserts: the server is gone)
            b.mode, b.mode_paths, b.mode_times = "reset", (), None
            self.close_connection = True
            self.connection.close()
            return None
        if refused is not None:  # (0.5.22+: the weights are in, the version is not)
            return self._send_json(400, {"success": False, "message": refused})
        message = "IPC weight update completed successfully"
        if doc.get("weight_version") is not None:
            b.weight_version = str(doc["weight_version"])
            message += f" Weight version updated to {b.weight_version}."
        return self._send_json(200, {"success": True, "message": message})


_STREAMING: dict[str, Callable[[_Handler], None]] = {
    "trickle_headers": _Handler._trickle_headers,
    "trickle_body": _Handler._trickle_body,
    "endless_body": _Handler._endless_body,
    "huge_length": _Handler._huge_length,
}


class _TCPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _UnixServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True


class FakeServer:
    """Start with `FakeServer(...).start()`, stop with `.stop()`; also a context manager."""

    def __init__(
        self,
        behaviour: Behaviour | None = None,
        *,
        uds: str | None = None,
        port: int = 0,
        listen_on: socket.socket | None = None,
    ) -> None:
        self.behaviour = behaviour or Behaviour()
        self.uds = uds
        self.port = port
        # A TCP socket already bound (see `reserved_port`): the server listens on it, so a
        # port a client has been refused on opens late without another process taking it.
        self.listen_on = listen_on
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return "http://localhost" if self.uds else f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeServer:
        if self.uds:
            if os.path.exists(self.uds):
                os.unlink(self.uds)
            server: Any = _UnixServer(self.uds, _Handler)
        elif self.listen_on is not None:
            server = _TCPServer(("127.0.0.1", 0), _Handler, bind_and_activate=False)
            server.socket.close()
            server.socket = self.listen_on
            server.server_address = self.listen_on.getsockname()
            server.server_activate()  # listen(): connections are accepted from now on
            self.port = server.server_address[1]
        else:
            server = _TCPServer(("127.0.0.1", self.port), _Handler)
            self.port = server.server_address[1]
        server.behaviour = self.behaviour
        server.stopping = threading.Event()
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        if self.uds and os.path.exists(self.uds):
            os.unlink(self.uds)

    def __enter__(self) -> FakeServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def reserved_port() -> Iterator[socket.socket]:
    """A loopback TCP socket bound to a port of its own, not listening: a client's connection
    to that port is refused, and no other process can bind it meanwhile (a port that was merely
    free could be taken by a parallel test and answer). `FakeServer(listen_on=...)` opens it."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 0))
        yield sock
    finally:
        sock.close()


def __getattr__(name: str) -> object:
    """`from fake_server import torchrun_cmd` (and free_port, free_master_port) as before:
    they live in bench/_support/torchrun_launch.py, which the benchmarks use too. Looked up on
    first use, so that scripts that only need the server (gpu_receiver.py) do not need it."""
    if name in ("free_port", "free_master_port", "torchrun_cmd"):
        import torchrun_launch

        return getattr(torchrun_launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def torchrun_job(
    *program: str, env: dict[str, str] | None = None, **torchrun: Any
) -> Iterator[subprocess.Popen[str]]:
    """`torchrun_cmd(*program, **torchrun)` running while the block talks to it (a serve job,
    one node of several), its output piped as text, `env` added to this environment. A test
    that fails in the block fails with the job's own stderr (`showing_stderr`); a job still
    running when the block ends is killed."""
    from warm_launch import torchrun_cmd

    with running_job(torchrun_cmd(*program, **torchrun), env) as proc:
        yield proc


@contextlib.contextmanager
def one_process_job(
    *program: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`python *program` as one process, not under torchrun (a job of one rank: its store in
    memory, no process group), otherwise as `torchrun_job`. For the tests whose subject is the
    job's clients, its log or its history, not its ranks: it costs a third of a 2-rank job's
    CPU (every process imports torch), and the suite is CPU-bound."""
    with running_job([sys.executable, *program], env) as proc:
        yield proc


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's ranks)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def rank_pid(job: subprocess.Popen[str], rank: int) -> int:
    """The pid of rank `rank` of the torchrun job `job`: the child of its launcher whose
    environment says RANK=`rank`."""
    from warm_launch import launcher_pid

    ranks = children(launcher_pid(job))
    for pid in ranks:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            if f"RANK={rank}".encode() in fh.read().split(b"\0"):
                return pid
    raise AssertionError(f"no rank {rank} among {ranks}")


def job_of_ranks(
    ranks: int, *program: str, env: dict[str, str] | None = None, **torchrun: Any
) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """`program` as a job of `ranks` ranks: one process (`one_process_job`) for one, else under
    torchrun (`torchrun_job`, with `torchrun`'s options: a port, nodes)."""
    if ranks == 1:
        assert all(v is None for v in torchrun.values()), torchrun  # (one process: no store)
        return one_process_job(*program, env=env)
    return torchrun_job(*program, env=env, nproc=ranks, **torchrun)


@contextlib.contextmanager
def running_job(
    cmd: list[str], env: dict[str, str] | None, **popen: Any
) -> Iterator[subprocess.Popen[str]]:
    """`cmd` running while the block talks to it, its output piped as text, `env` added to this
    environment (`popen`: more of Popen's arguments); a failure in the block shows its stderr
    (`showing_stderr`), and a job still running when the block ends is killed and reaped."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        **popen,
    )
    try:
        with showing_stderr(proc, "the job"):
            yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


# The end of a job's stderr that a failure shows: its last words (why a rank ended) are there.
SHOWN_STDERR_CHARS = 12_000


@contextlib.contextmanager
def showing_stderr(proc: subprocess.Popen[str], what: str) -> Iterator[None]:
    """When the block fails, end `proc` (SIGTERM first: torchrun passes it to its ranks) and
    add what it wrote on stderr (all of it but what the test read with `read_until`) to the
    failure: a failure that only shows on a busy machine says why at once, without a rerun."""
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # (pytest's failures are BaseExceptions)
        code = proc.poll()
        state = "still running when the test failed" if code is None else f"ended with {code}"
        err = _end_and_read_stderr(proc)[-SHOWN_STDERR_CHARS:] or "(nothing)"
        exc.add_note(f"--- {what}'s stderr ({state}) ---\n{err}")
        raise


def _end_and_read_stderr(proc: subprocess.Popen[str]) -> str:
    proc.terminate()  # (nothing happens to one that ended)
    try:
        return proc.communicate(timeout=30)[1] or ""
    except subprocess.TimeoutExpired:
        proc.kill()  # torchrun alone: its ranks end once its store is gone
    except ValueError:  # (the test closed the pipe)
        return ""
    try:
        return proc.communicate(timeout=10)[1] or ""
    except subprocess.TimeoutExpired as exc:
        return (exc.stderr or b"").decode(errors="replace") + "\n(still running: killed)"


def run_torchrun(
    *program: str, nproc: int = 2, timeout: float = 100, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run `torchrun_cmd(*program)` to the end (output captured as text), once more on a new
    port if another process took the chosen one before torchrun could bind it. A run that
    outlasts `timeout` (or the test's own timeout) gets SIGTERM first, which torchrun passes
    on to its ranks: killed outright, it would leave them running."""
    from warm_launch import torchrun_cmd

    for attempt in range(3):
        cmd = torchrun_cmd(*program, nproc=nproc)
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw
        ) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except BaseException:
                proc.terminate()
                try:
                    proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                raise
        if "EADDRINUSE" not in err or attempt == 2:
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    raise AssertionError("unreachable")


def main() -> None:
    """`python tests/support/fake_server.py --port N --profile P` for manual runs and subprocess tests."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--uds")
    parser.add_argument("--profile", default="sglang-0.5.23", choices=PROFILES)
    parser.add_argument("--mode")
    parser.add_argument("--delay", type=float, default=0.0, help="open the port after N seconds")
    args = parser.parse_args()
    time.sleep(args.delay)
    server = FakeServer(
        Behaviour(profile=args.profile, mode=args.mode), uds=args.uds, port=args.port
    )
    try:
        server.start()
    except OSError as exc:  # (the README's walkthrough: say what to do, not a traceback)
        where = args.uds or f"port {args.port}"
        raise SystemExit(
            f"fake_server: cannot listen on {where}: {exc.strerror}; pick another --port"
        ) from None
    print(f"listening on {server.endpoint}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()

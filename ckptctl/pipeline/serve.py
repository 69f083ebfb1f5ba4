"""`serve`: a long-lived parameter-server job that takes one checkpoint after another.

Every rank keeps its ParameterServer alive and runs the same commands in the same order. The
commands travel through torchrun's own store (no networking of ours between nodes):

    serve/next            a counter: the next command's sequence number
    serve/cmd/<seq>       the command (JSON)
    serve/res/<seq>/<r>   rank r's result (JSON)
    serve/last            the last command's merged result (rank 0 writes it)

A control endpoint on each node (local rank 0), an HTTP server on a Unix socket, takes
`POST /push`, `GET /status` and `POST /stop` from `ckptctl push|status` (or any HTTP client),
submits commands to the store and answers with the merged result of every rank.

A push's stages are those of `update`, in a store scope of their own (`push<seq>/`), so that a
push's keys never answer the next one's waits; a failure found before the transfer (a bad
checkpoint, a server that is not up) ends that push on every rank and the job goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from ckptctl.errors import CkptctlError, ExitCode, OperationFailed, UsageError
from ckptctl.pipeline.coordination import Coordinator
from ckptctl.pipeline.job import Job
from ckptctl.progress import StageLog

Executor = Callable[[Job, dict[str, Any]], dict[str, Any]]

DEFAULT_CONTROL_SOCKET = f"/tmp/ckptctl-serve-{os.getuid()}.sock"


# -- the command queue in the store --------------------------------------------------------------


class CommandQueue:
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.store = coordinator.store
        self.world = coordinator.launch.world_size

    def submit(self, command: dict[str, Any]) -> int:
        seq = int(self.store.add("serve/next", 1))
        self.store.set(f"serve/cmd/{seq}", json.dumps({**command, "seq": seq}))
        return seq

    def next_command(self, seq: int) -> dict[str, Any] | None:
        key = f"serve/cmd/{seq}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def report(self, seq: int, result: dict[str, Any]) -> None:
        self.store.set(f"serve/res/{seq}/{self.coordinator.launch.rank}", json.dumps(result))

    def wait_result(self, seq: int, timeout_s: float) -> dict[str, Any]:
        """Every rank's result, merged: ok only if every rank's is."""
        keys = [f"serve/res/{seq}/{r}" for r in range(self.world)]
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return {
                    "ok": False,
                    "exit_code": int(ExitCode.TIMEOUT),
                    "seq": seq,
                    "error": f"the job did not finish command {seq} within {timeout_s:g}s",
                }
            if self.coordinator.stopped() is not None:
                return {
                    "ok": False,
                    "exit_code": int(ExitCode.FAILED),
                    "seq": seq,
                    "error": "the serve job is stopping",
                }
            time.sleep(0.05)
        ranks = [json.loads(self.store.get(k)) for k in keys]
        failed = [r for r in ranks if not r.get("ok")]
        merged: dict[str, Any] = {
            "ok": not failed,
            "exit_code": int(failed[0]["exit_code"]) if failed else 0,
            "error": failed[0]["error"] if failed else None,
            "seq": seq,
            "ranks": ranks,
        }
        return merged

    def last(self) -> dict[str, Any] | None:
        return (
            json.loads(self.store.get("serve/last")) if self.store.check(["serve/last"]) else None
        )

    def submitted(self) -> int:
        return int(self.store.add("serve/next", 0))


# -- the control endpoint ------------------------------------------------------------------------


class _ControlServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    queue: CommandQueue
    push_timeout: float
    state: dict[str, Any]


class _ControlHandler(BaseHTTPRequestHandler):
    server: _ControlServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass

    def _send(self, status: int, doc: dict[str, Any]) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path != "/status":
            return self._send(404, {"error": "not found"})
        queue = self.server.queue
        last = queue.last()
        done = last["seq"] if last else 0
        self._send(
            200,
            {
                "state": "busy" if queue.submitted() > done else "idle",
                "world_size": queue.world,
                "commands": queue.submitted(),
                "registered": self.server.state.get("registered"),
                "pinned_pool_bytes": self.server.state.get("pinned_pool_bytes"),
                "last": last,
            },
        )

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        try:
            doc = json.loads(self.rfile.read(length) or b"{}")
        except ValueError:
            return self._send(400, {"error": "the body is not JSON"})
        queue = self.server.queue
        if self.path == "/stop":
            queue.coordinator.publish_stop("stopped by a client (POST /stop)")
            return self._send(200, {"ok": True})
        if self.path != "/push":
            return self._send(404, {"error": "not found"})
        if not isinstance(doc, dict) or not isinstance(doc.get("checkpoint_path"), str):
            return self._send(400, {"error": 'push needs {"checkpoint_path": DIR}'})
        command = {
            "action": "push",
            "checkpoint_path": doc["checkpoint_path"],
            "checkpoint_name": doc.get("checkpoint_name"),
            "weight_version": doc.get("weight_version"),
            "consume_shm_files": bool(doc.get("consume_shm_files")),
        }
        seq = queue.submit(command)
        self._send(200, queue.wait_result(seq, self.server.push_timeout + 30.0))


def start_control_server(
    path: str, queue: CommandQueue, push_timeout: float, state: dict[str, Any]
) -> _ControlServer:
    if os.path.exists(path):
        import socket

        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # a socket left by a job that is gone
        else:
            raise UsageError(f"{path} is in use by another serve job: pick --control-socket")
        finally:
            probe.close()
    server = _ControlServer(path, _ControlHandler)
    server.queue, server.push_timeout, server.state = queue, push_timeout, state
    threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.1},
        name="ckptctl-control",
        daemon=True,
    ).start()
    return server


# -- the loop every rank runs --------------------------------------------------------------------


def failed_push(job: Job, exc: Exception) -> dict[str, Any]:
    """A push's failure as its result, told to every rank, which all give up on it.

    checkpoint-engine raises plain exceptions too (an assert, a pin failure): the push fails
    with them like with ours. Only the text is kept: the exception's traceback holds the
    frames of the failed push, and a loop that kept it would keep what they hold (GPU
    transfer buffers, pinned host buffers) until the next failure (issue 13).
    """
    code = exc.exit_code if isinstance(exc, CkptctlError) else ExitCode.FAILED
    message = str(exc) if isinstance(exc, CkptctlError) else f"{type(exc).__name__}: {exc}"
    assert job.coordinator is not None
    job.coordinator.publish_abort(code, message)
    return {"ok": False, "exit_code": int(code), "error": message}


def serve_loop(
    job: Job,
    execute: Executor,
    *,
    control_socket: str | None,
    push_timeout: float,
    state: dict[str, Any],
) -> str:
    """Run every submitted command, in order, until a stop (a signal, or POST /stop)."""
    assert job.coordinator is not None
    queue = CommandQueue(job.coordinator)
    reason: list[str] = []

    def on_signal(sig: Any) -> None:
        reason.append(f"stopped by {sig.name}")
        job.coordinator.publish_stop(reason[0])  # type: ignore[union-attr]

    job.watchdog.on_signal = on_signal
    job.watchdog.deadline = float("inf")
    server = None
    if control_socket and job.launch.local_rank == 0:
        server = start_control_server(control_socket, queue, push_timeout, state)
        job.reporter.log(f"serving: control socket {control_socket}")
    seq = 1
    try:
        while not reason:
            stopped = job.coordinator.stopped()
            if stopped is not None:
                reason.append(stopped["reason"])
                break
            command = queue.next_command(seq)
            if command is None:
                time.sleep(0.05)
                continue
            job.watchdog.deadline = time.monotonic() + push_timeout
            job.reporter.figures = StageLog()  # this push's stages only
            push_job = Job(
                job.launch, job.coordinator.scoped(f"push{seq}"), job.watchdog, job.reporter
            )
            try:
                result = {"ok": True, "exit_code": 0, "error": None, **execute(push_job, command)}
            except Exception as exc:  # noqa: BLE001 - one failed push must not end the job
                result = failed_push(push_job, exc)
            job.watchdog.deadline = float("inf")
            result["rank"] = job.launch.rank
            queue.report(seq, result)
            if job.launch.rank == 0:
                merged = queue.wait_result(seq, push_timeout + 30.0)
                job.coordinator.store.set("serve/last", json.dumps(merged))
            seq += 1
    finally:
        job.watchdog.on_signal = None
        if server is not None:
            server.shutdown()
            server.server_close()
            if control_socket and os.path.exists(control_socket):
                os.unlink(control_socket)
    return reason[0] if reason else "stopped"


# -- the real job: a ParameterServer per rank, pushes through the update stages -----------------


@dataclass
class ServeOptions:
    servers: Any  # ServerTargets
    control_socket: str = DEFAULT_CONTROL_SOCKET
    split: str = "auto"
    register_mode: str = "direct"
    read_threads: int | None = None
    push_timeout: float = 600.0
    verbose: bool = False


class PushFailure:
    """A push that fails during the transfer, without ending the job.

    The leader's request thread calls it with the server's refusal; every rank's watcher sees
    it in the push's store scope. Each rank then ends its own blocked transfer with a stand-in
    peer (parameter_server.rescue); where a worker had already connected that cannot work, and
    the watchdog ends the job as `update` would.
    """

    def __init__(self, job: Job, session: Any) -> None:
        self.job = job
        self.session = session
        self.code: int | None = None
        self.message = ""
        self._handled = threading.Event()

    def __call__(self, code: int, message: str) -> None:
        assert self.job.coordinator is not None
        self.job.coordinator.publish_abort(code, message)
        self._end_transfer(code, message)

    def _end_transfer(self, code: int, message: str) -> None:
        if self._handled.is_set():
            return
        self._handled.set()
        self.code, self.message = code, message
        if not self.session.rescue(message):
            self.job.watchdog.fail(code, f"{message} (the transfer had started: the job ends)")

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """While the update runs, end it here too when another rank's push failed."""
        done = threading.Event()

        def watch() -> None:
            assert self.job.coordinator is not None
            while not done.wait(0.1):
                abort = self.job.coordinator.aborted()
                if abort is not None:
                    self._end_transfer(int(abort["code"]), str(abort["message"]))
                    return

        thread = threading.Thread(target=watch, name="ckptctl-push-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=5)

    def raise_if_failed(self) -> None:
        if self.code is None:
            return
        from ckptctl.errors import DeadlineExceeded

        raise (DeadlineExceeded if self.code == ExitCode.TIMEOUT else OperationFailed)(self.message)


def gpu_executor(
    opts: ServeOptions, session: Any, assignment: Any, state: dict[str, Any]
) -> Executor:
    """One push: the stages of `update`, then the previous checkpoint is unregistered."""
    from ckptctl.pipeline import stages

    def execute(job: Job, command: dict[str, Any]) -> dict[str, Any]:
        name = command.get("checkpoint_name") or f"push-{command['seq']}"
        if name == state.get("registered"):
            name = f"{name}-{command['seq']}"  # the one being served is still registered
        from ckptctl.pipeline.update import check_consumable_together, check_consume

        mode = "consume" if command.get("consume_shm_files") else opts.register_mode
        split = check_consume(command["checkpoint_path"], mode, opts.split)
        checkpoint, plan, share = stages.plan_share(job, command["checkpoint_path"], split)
        if mode == "consume":
            check_consumable_together(job, plan)  # before any rank consumes a file
        pool = state.get("pool")  # serve --register-mode direct: buffers kept between pushes
        if pool is not None and mode == "direct" and state.get("registered") is not None:
            # Its buffers are refilled with this checkpoint: the server already holds it, and
            # without p2p nobody reads it from here any more.
            session.unregister(state["registered"], pool)
            state["registered"] = None
        reader = stages.prefetch_share(
            checkpoint,
            share,
            mode,
            pool if mode == "direct" else None,
            plan=plan,
            read_threads=opts.read_threads,
        )
        stages.register_share(job, session, name, checkpoint, share, mode, reader)
        try:
            stages.wait_for_server(job, assignment, opts.servers.engine)
            stages.gather_metas(job, session, name, reader)
            servers = opts.servers
            if command.get("weight_version") is not None:
                from dataclasses import replace

                servers = replace(servers, weight_version=command["weight_version"])
            failure = PushFailure(job, session)
            request = stages.ServerRequest(
                assignment,
                servers,
                job.watchdog,
                timeout=opts.push_timeout,
                transfer_finished=session.wait_transfer_finished,
                on_failure=failure,
            )
            with failure.watching():
                try:
                    stages.push(
                        job,
                        session,
                        name,
                        request,
                        broadcast=True,
                        p2p_ranks=None,
                        nbytes=checkpoint.total_bytes,
                    )
                except CkptctlError:
                    failure.raise_if_failed()  # the server's words, not the rescue's echo
                    raise
            if servers.weight_version is not None:
                stages.verify_weight_version(
                    job, assignment, servers.engine, servers.weight_version
                )
        except BaseException:
            # This push failed: drop it. The previous one stays registered, except in direct
            # mode, which released it above to refill its buffers; either way the server
            # keeps the weights it had (a push refused before the transfer).
            session.unregister(name, pool)
            raise
        previous, state["registered"] = state.get("registered"), name
        if previous is not None:
            session.unregister(previous, pool)
        if pool is not None and mode == "consume":
            pool.trim()  # the consumed files hold this push: unpin what the pool kept idle
        if pool is not None:
            state["pinned_pool_bytes"] = pool.pinned_bytes  # (read by GET /status)
        return {
            "checkpoint_name": name,
            "split": plan.split,
            "total_bytes": checkpoint.total_bytes,
            "pinned_pool_bytes": None if pool is None else pool.pinned_bytes,
            "figures": job.figures(),
        }

    return execute


def run_serve(opts: ServeOptions, reporter: Any, *, debug: bool = False) -> dict[str, Any]:
    from ckptctl.pipeline import stages
    from ckptctl.pipeline.job import prepare_environment, run_job

    launch = prepare_environment()
    assignment = opts.servers.assign(launch)
    state: dict[str, Any] = {"registered": None, "pool": None}

    def body(job: Job) -> dict[str, Any]:
        if job.coordinator is None:  # one process: a store of our own for the queue
            job.coordinator = Coordinator.local(job.launch)
            job.watchdog.coordinator = job.coordinator
        session = stages.start_parameter_server(job, p2p="off")
        # The NCCL group now, not at the first push: a job that cannot build it fails at
        # start-up instead of failing every push.
        stages.build_group(job, session)
        if opts.register_mode == "direct":
            from ckptctl.pipeline.pinning import PinnedPool

            state["pool"] = PinnedPool()  # pinned once, refilled by every push
        ended = serve_loop(
            job,
            gpu_executor(opts, session, assignment, state),
            control_socket=opts.control_socket,
            push_timeout=opts.push_timeout,
            state=state,
        )
        if state["registered"] is not None:
            session.unregister(state["registered"], state["pool"])
        if state["pool"] is not None:
            state["pool"].close()
        return {"ok": True, "ended": ended, "world_size": launch.world_size}

    return run_job(
        launch, reporter, body, timeout=opts.push_timeout, verbose=opts.verbose, debug=debug
    )

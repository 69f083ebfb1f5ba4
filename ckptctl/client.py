"""Drive a running `ckptctl serve` job from Python: what `ckptctl push`, `status` and `stop` do,
without starting a process for each.

A training loop is a Python process already; calling these saves each push the CLI's own
start-up (its imports and argument parsing) and gives it the result as a dict:

    from ckptctl.client import push

    result = push("/ckpt/step-1200", weight_version="step-1200", wait=600)
    print(result["wall_s"], result["server_weights"])

Each function returns the document the matching `ckptctl ... --json` prints (`ok`, `exit_code`,
`error` and the command's fields), and its messages name these functions' arguments
(`wait=SECONDS`), where the CLI's name its flags. Two arguments mean the same in every function,
as their flags do in every command: `wait`, how long to wait first for a serve job to answer at
all (one still starting after `serve &`); `timeout`, the longest the whole call may take, that
wait included (DeadlineExceeded past it).

The job is found as the CLI finds it: `control_socket`, else the job that feeds `endpoint` /
`uds`, else this user's only serve job on the node (ckptctl.serve.control_client, which also
checks who owns the socket and who listens on it). Failures raise ckptctl.errors.CkptctlError
subclasses whose `exit_code` is what the CLI would exit with: InvalidInput (3: the checkpoint,
or `verify` where the server cannot), DeadlineExceeded (4), OperationFailed (1: the push
failed; the job goes on serving; NotAnswering, one of them: no serve job answers), UsageError
(2: several jobs and none named). This module imports neither torch nor typer.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ckptctl.errors import (
    CkptctlError,
    DeadlineExceeded,
    ExitCode,
    OperationFailed,
    UsageError,
    error_for,
    redact_doc,
)
from ckptctl.serve.control_client import ARGUMENTS, Names, NotAnswering

__all__ = [
    "NotAnswering",
    "cancel",
    "find_job",
    "push",
    "raise_if_failed",
    "rollback",
    "stage",
    "status",
    "stop",
]


def find_job(
    control_socket: str | None = None,
    endpoint: str | Sequence[str] = (),
    uds: str | Sequence[str] = (),
    wait: float = 0.0,
    *,
    names: Names = ARGUMENTS,
) -> str:
    """The control socket of the serve job to talk to, waiting up to `wait` seconds for one to
    answer (`serve &` and then the first push). `names`: how messages name the arguments
    (the CLI passes its flags)."""
    from ckptctl.serve.control import job_targets
    from ckptctl.serve.control_client import resolve_socket

    targets = job_targets(_as_list(endpoint), _as_list(uds))
    return resolve_socket(control_socket, targets, wait, names=names)


class _Budget:
    """A call's `timeout`, spent from its start: the wait for a job, then each request."""

    def __init__(self, timeout: float, names: Names) -> None:
        _check_seconds(timeout, "timeout")
        self.timeout = timeout
        self.names = names
        self.deadline = time.monotonic() + timeout

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"gave up after {self.timeout:g}s (raise {self.names.timeout})")
        return left

    def find_job(
        self,
        control_socket: str | None,
        endpoint: str | Sequence[str],
        uds: str | Sequence[str],
        wait: float,
    ) -> str:
        _check_seconds(wait, "wait")
        # (called first: what is left of the budget is all of it)
        return find_job(control_socket, endpoint, uds, min(wait, self.timeout), names=self.names)


def _check_seconds(value: float, name: str) -> None:
    """A number of seconds that bounds a wait: finite and not negative (NaN passes every
    comparison, so it would wait for ever), else a usage error. Named as the Python argument:
    the CLI refuses such values itself, as it parses its flags."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise UsageError(f"{name} takes a finite number of seconds, not {value!r}")


def _as_list(values: str | Sequence[str]) -> list[str]:
    """One URL or path, or several (a lone string is one, never its characters)."""
    return [values] if isinstance(values, str) else list(values)


def request(
    path: str,
    method: str,
    route: str,
    body: dict[str, Any] | None,
    timeout: float,
    *,
    flag: str | None = None,
) -> dict[str, Any]:
    """One request to the job on `path`; a refusal raises. `flag`: the argument that set
    `timeout`, named when it runs out. The answer comes as the CLI's --json prints it:
    secrets redacted (a password in one of the job's `targets` URLs)."""
    from ckptctl.serve.control_client import call

    code, doc = call(path, method, route, body, timeout, flag=flag)
    doc = redact_doc(doc)
    if code in (400, 409):  # a request that should not have been sent, or the wrong node
        raise UsageError(f"the serve job on {path} refused: {doc.get('error')}")
    if code != 200:
        raise OperationFailed(f"the serve job on {path} refused (HTTP {code}): {doc.get('error')}")
    return doc


def push(
    checkpoint_path: str | os.PathLike[str],
    *,
    weight_version: str | None = None,
    checkpoint_name: str | None = None,
    consume_shm_files: bool = False,
    verify: bool = False,
    allow_layout_change: bool = False,
    control_socket: str | None = None,
    endpoint: str | Sequence[str] = (),
    uds: str | Sequence[str] = (),
    wait: float = 0.0,
    timeout: float = 900.0,
    check: bool = True,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    push_id: str | None = None,
    names: Names = ARGUMENTS,
    trace: str | os.PathLike[str] | None = None,
    pause: str | None = None,
) -> dict[str, Any]:
    """Push a checkpoint through the serve job and wait for it: the job's answer (`ok`,
    `wall_s`, `server_weights`, `verified`, every rank's figures...), which is also
    `ckptctl push --json`'s. A push that ran and failed raises, with the job's own error line;
    with check=False its answer is returned instead (ok false, exit_code, error). A checkpoint
    whose tensor names, dtypes or shapes differ from those the job served last is refused
    (InvalidInput) unless `allow_layout_change`.

    on_progress: called about once a second, while the push waits or runs, with what `status`
    says of it (`running`: stage, detail, bytes_done...). push_id: a name of the caller's for
    this push, which `cancel(push_id)` gives up. trace: a file for the push's timeline on
    every rank (Chrome trace-event JSON, written by the job: ckptctl.observe.timeline); the
    answer's `trace` says where, or why not. pause: what the servers do with their generations
    in flight meanwhile ("none", or a mode of theirs: "abort", "retract", "in_place" for SGLang,
    "abort", "wait", "keep" for vLLM); None: the serve job's --pause. A mode the servers do not
    have is refused (UsageError) before anything is sent."""
    budget = _Budget(timeout, names)
    path = budget.find_job(control_socket, endpoint, uds, wait)
    body: dict[str, Any] = {
        "checkpoint_path": os.path.realpath(os.fspath(checkpoint_path)),
        "weight_version": weight_version,
        "checkpoint_name": checkpoint_name,
        "consume_shm_files": consume_shm_files,
        "verify": verify,
        "allow_layout_change": allow_layout_change,
        "push_id": push_id,
    }
    if pause is not None:
        body["pause"] = str(pause)
    if trace is not None:  # (checked here too: a bad path fails before the push runs)
        from ckptctl.observe.timeline import check_path

        body["trace"] = check_path(trace, names.trace)
    return _run(path, "/push", body, budget, check=check, on_progress=on_progress, names=names)


def stage(
    checkpoint_path: str | os.PathLike[str],
    *,
    allow_layout_change: bool = False,
    control_socket: str | None = None,
    endpoint: str | Sequence[str] = (),
    uds: str | Sequence[str] = (),
    wait: float = 0.0,
    timeout: float = 900.0,
    check: bool = True,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    push_id: str | None = None,
    names: Names = ARGUMENTS,
) -> dict[str, Any]:
    """Read a checkpoint ahead for the next push (`ckptctl stage`): the job plans it and starts
    reading it into a second set of pinned buffers (one more share of host memory a rank),
    while the server keeps its weights, and answers (`staged`, `total_bytes`...); the push of
    the same path that follows, if its files have not changed, sends it without reading it.
    `status()["staged"]` says how far the read got. Refused (InvalidInput) as its push would be
    (another layout, a checkpoint that is none)."""
    budget = _Budget(timeout, names)
    path = budget.find_job(control_socket, endpoint, uds, wait)
    body = {
        "checkpoint_path": os.path.realpath(os.fspath(checkpoint_path)),
        "allow_layout_change": allow_layout_change,
        "push_id": push_id,
    }
    return _run(path, "/stage", body, budget, check=check, on_progress=on_progress, names=names)


def rollback(
    *,
    control_socket: str | None = None,
    endpoint: str | Sequence[str] = (),
    uds: str | Sequence[str] = (),
    wait: float = 0.0,
    timeout: float = 900.0,
    check: bool = True,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
    push_id: str | None = None,
    names: Names = ARGUMENTS,
) -> dict[str, Any]:
    """Push the whole checkpoint before the last whole one again, with its weight version
    (`ckptctl rollback`). InvalidInput (3) when there is none, or when its files changed."""
    budget = _Budget(timeout, names)
    path = budget.find_job(control_socket, endpoint, uds, wait)
    body = {"push_id": push_id}
    return _run(path, "/rollback", body, budget, check=check, on_progress=on_progress, names=names)


def cancel(push_id: str, *, control_socket: str) -> dict[str, Any]:
    """Give up the push named `push_id` on the job at `control_socket`: `{"cancel":
    "cancelled"}` (it had not started), `"cancelling"` (its transfer is being ended, then the
    server restored; its own answer says how it ended) or `"not found"` (it is over)."""
    return request(control_socket, "POST", "/cancel", {"push_id": push_id}, 10.0)


def _run(
    path: str,
    route: str,
    body: dict[str, Any],
    budget: _Budget,
    *,
    check: bool,
    on_progress: Callable[[dict[str, Any]], None] | None,
    names: Names,
) -> dict[str, Any]:
    """One command the job runs (a push, stage or rollback): sent, watched while it runs, and
    its answer, raised as the command's exception with `check` when it failed."""
    with _watching(path, on_progress):
        answer = request(path, "POST", route, body, budget.left(), flag=names.timeout)
    return raise_if_failed(answer) if check else answer


@contextlib.contextmanager
def _watching(path: str, on_progress: Callable[[dict[str, Any]], None] | None) -> Iterator[None]:
    """While the block waits for the job's answer, pass what `status` says of the command
    under way to `on_progress`, about once a second (a connection of its own)."""
    if on_progress is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(1.0):
            try:
                running = request(path, "GET", "/status", None, 5.0).get("running")
            except CkptctlError:
                continue  # the push's own answer says what went wrong
            if running and not done.is_set():
                on_progress(running)

    thread = threading.Thread(target=watch, name="ckptctl-push-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=6)


def raise_if_failed(answer: dict[str, Any]) -> dict[str, Any]:
    """A push's answer when it succeeded; else its error, as the exception of its exit code."""
    if answer.get("ok"):
        return answer
    code = int(answer.get("exit_code") or ExitCode.FAILED)
    error = str(answer.get("error") or "the push failed")
    raise error_for(code, error)


def status(
    *,
    control_socket: str | None = None,
    endpoint: str | Sequence[str] = (),
    uds: str | Sequence[str] = (),
    wait: float = 0.0,
    timeout: float = 30.0,
    history: bool = False,
    names: Names = ARGUMENTS,
) -> dict[str, Any]:
    """What the serve job holds and did last: `ckptctl status --json`'s document (`ok`,
    `exit_code`, `error`, `state`, `commands` = `succeeded` + `failed`, `running`, `last`,
    `last_refused`: the last push refused before it sent anything, kept out of `last`...).

    history: also the job's push log, `status --history --json`'s fields: `pushes` (the last
    `history_limit`, oldest first: seq, checkpoint_path, weight_version, outcome, wall_s,
    total_bytes, finished_at, server_weights...) and `pushes_run` (every push logged)."""
    budget = _Budget(timeout, names)
    path = budget.find_job(control_socket, endpoint, uds, wait)
    doc = request(path, "GET", "/status", None, budget.left(), flag=names.timeout)
    if history:
        log = request(path, "GET", "/history", None, budget.left(), flag=names.timeout)
        doc.update({k: log.get(k) for k in ("pushes", "pushes_run", "history_limit")})
    done, failed = int(doc.get("commands") or 0), int(doc.get("failed") or 0)
    return {
        **doc,
        "ok": True,
        "exit_code": 0,
        "error": None,
        "succeeded": done - failed,
        "control_socket": path,
    }


def stop(
    *,
    control_socket: str | None = None,
    endpoint: str | Sequence[str] = (),
    uds: str | Sequence[str] = (),
    wait: float = 0.0,
    timeout: float = 30.0,
    names: Names = ARGUMENTS,
) -> dict[str, Any]:
    """Stop the serve job (a push under way is cancelled) and wait until it no longer
    answers: every rank has ended (DeadlineExceeded if it still answers at `timeout`).
    `ckptctl stop --json`'s document: `control_socket`, `stopped` (true)."""
    from ckptctl.serve.control_client import answers

    budget = _Budget(timeout, names)
    path = budget.find_job(control_socket, endpoint, uds, wait)
    request(path, "POST", "/stop", None, min(budget.left(), 10.0), flag=names.timeout)
    while answers(path):
        if time.monotonic() >= budget.deadline:
            raise DeadlineExceeded(
                f"the serve job on {path} still answers {timeout:g}s after it was asked to "
                f"stop (raise {names.timeout})"
            )
        time.sleep(0.2)
    return {"ok": True, "exit_code": 0, "error": None, "control_socket": path, "stopped": True}

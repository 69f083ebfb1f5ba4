"""The loop every rank of a serve job runs: take the next command, run it, share the results.

Commands come from the control socket of global rank 0's node (control.py) and reach every
rank over the job's own gloo group (commands.py); the ranks tick together - rank 0 sets the
pace, about ten ticks a second and at once when a push comes in, the others wait in each
tick - and run the same commands in the same order. Other nodes' control sockets answer
`status` (this node's view, which every rank keeps: results go to every rank) and `stop`,
and refuse `push` with the host to push on. A stop - `ckptctl stop` on any node, SIGTERM or
SIGINT to any rank - travels in the next tick and ends every rank together. What `status`
shows is JobStatus, with the push log that `status --history` lists (state.PushLog).

A push runs the stages of `update` (push.py) in a store scope of its own (`push<seq>/`), so
that one push's keys never answer the next one's waits. Its deadline is the job's
`--push-timeout` (push.PushClock). Any failure of a push fails that push on every rank, and
the job goes on serving.
"""

from __future__ import annotations

import collections
import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from ckptctl.errors import (
    PARTIAL_WEIGHTS_NOTE,
    CkptctlError,
    ExitCode,
    OperationFailed,
)
from ckptctl.job.runner import Job
from ckptctl.observe import timeline
from ckptctl.progress import StageFigures, StageLog
from ckptctl.results import REFUSED, outcome, utc
from ckptctl.serve.commands import (
    TICK_TIMEOUT_S,
    BadCommand,
    CommandChannel,
    Exchanges,
    GroupLost,
    ServeCommand,
    push_id_of,
)
from ckptctl.serve.control import ControlServer, Handler, default_socket_path
from ckptctl.serve.push import (
    HARD_GRACE_S,
    KEPT_WHOLE,
    PushClock,
    exchanges_of,
    resume_after_command,
)
from ckptctl.serve.state import PushLog, ServeState
from ckptctl.settings import PauseMode
from ckptctl.transfer.pausing import pause_refusal

Executor = Callable[[Job, ServeCommand], dict[str, Any]]

TICK_S = 0.1
MAX_QUEUED = 16
# After a stop, a push under way must end within this many seconds, or the job ends anyway.
STOP_GRACE_S = 8.0


@dataclass
class _Pending:
    """A push waiting on rank 0 for its turn and then for its result."""

    command: ServeCommand
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None

    def finish(self, result: dict[str, Any]) -> None:
        self.result = result
        self.done.set()


def failure_result(exc: BaseException) -> dict[str, Any]:
    """A failed push as a plain result. Only text is kept: the exception's traceback holds
    the push's frames and, through them, its buffers (checkpoint-engine's GPU buffers too)."""
    error = (
        exc if isinstance(exc, CkptctlError) else OperationFailed(f"{type(exc).__name__}: {exc}")
    )
    return {
        "ok": False,
        "exit_code": int(error.exit_code),
        "error": str(error),
        # Set by the executor on a failure after the server's workers connected (push.py).
        "server_weights": getattr(exc, "server_weights", None),
        # The server the failure came from (Transfer.naming_failed_server), where one did.
        "failed_server": getattr(exc, "failed_server", None),
    }


def merge_results(command: ServeCommand, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's result of one push as one: ok only if every rank's is."""
    failed = [r for r in ranks if not r.get("ok")]
    # Another rank's "rank N failed: ..." echoes the failure; the rank that failed says it best.
    # A server's own failure first (with several servers, every rank fails alike).
    first = next((r for r in failed if r.get("failed_server")), None)
    first = first or next((r for r in failed if not str(r.get("error")).startswith("rank ")), None)
    first = first or (failed[0] if failed else None)
    partial = any(r.get("server_weights") == "partial" for r in ranks)
    error = None if first is None else str(first.get("error"))
    if error is not None and partial:  # the loop says what became of them (ServeLoop._restore)
        error = error.replace(f" ({PARTIAL_WEIGHTS_NOTE})", "")
    sizes = [r["total_bytes"] for r in ranks if isinstance(r.get("total_bytes"), int)]
    wall_s = max((float(r.get("wall_s") or 0) for r in ranks), default=0.0)
    # whole: the server holds every tensor of this push; partial: a mix of old and new;
    # None: this push never reached the server's weights (a stage never does: it reads ahead).
    weights = None
    if command.action != "stage":
        weights = "whole" if first is None else ("partial" if partial else None)
    return {
        "ok": first is None,
        "exit_code": 0 if first is None else int(first.get("exit_code") or ExitCode.FAILED),
        "error": error,
        "action": command.action,
        "seq": command.seq,
        "restores": command.restores,  # a rollback's: the push it pushes again
        "push_id": command.push_id,
        "checkpoint_path": command.checkpoint_path,
        "checkpoint_name": ranks[0].get("checkpoint_name") or command.checkpoint_name,
        "weight_version": command.weight_version,
        "server_weights": weights,
        "failed_server": None if first is None else first.get("failed_server"),
        "started_at": command.started_at,
        "finished_at": utc(),
        "wall_s": wall_s,
        "seconds": wall_s,  # (the name before wall_s; programs read it)
        "total_bytes": max(sizes) if sizes else None,
        # push --verify: what was proven and how (rank 0 holds the whole answer).
        "verified": ranks[0].get("verified") if first is None else None,
        "verification": ranks[0].get("verification") if first is None else None,
        "ranks": ranks,
    }


class JobStatus:
    """What `status` shows, kept on every rank (read from the control socket's threads)."""

    def __init__(self, *, rank: int, world_size: int, targets: list[str]) -> None:
        self._lock = threading.Lock()
        self.rank = rank
        self.world_size = world_size
        self.targets = targets
        self.hosts: list[str] = []
        self.commands = 0
        self.failed = 0
        self.running: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None  # the last command that was not refused
        # The last one refused before it sent anything (a typo'd path): kept apart, so that
        # `last` still says what the last push that ran did.
        self.last_refused: dict[str, Any] | None = None
        self.server_weights: str | None = None  # None until a push reaches the server
        # The last KEPT_WHOLE whole sets pushed, the one the server holds last: what a restore
        # or a rollback may push again (not the push log: that is `pushes`).
        self.whole_pushes: list[dict[str, Any]] = []
        self.pushes = PushLog()  # every push, for `status --history`
        self.stopping = False

    @property
    def weights(self) -> dict[str, Any] | None:
        """The last whole set pushed."""
        return self.whole_pushes[-1] if self.whole_pushes else None

    def previous(self) -> dict[str, Any] | None:
        """The whole set before the last one: what a rollback pushes."""
        return self.whole_pushes[-2] if len(self.whole_pushes) > 1 else None

    def begin(self, command: ServeCommand) -> None:
        with self._lock:
            self.running = {
                k: getattr(command, k) for k in ("action", "seq", "checkpoint_path", "started_at")
            }

    def record(self, merged: dict[str, Any]) -> None:
        with self._lock:
            self.commands += 1
            self.failed += not merged["ok"]
            self.running = None
            if outcome(merged) == REFUSED:
                self.last_refused = merged
            else:
                self.last = merged
            self.pushes.add(merged)
            if merged["action"] == "stage":
                return  # read ahead: the server's weights are what they were
            if merged["ok"] or merged.get("whole_but_paused"):  # (push.resume_after_command)
                self.server_weights = "whole"
                seq = merged.get("restores") or merged["seq"]
                entry = {
                    k: merged[k] for k in ("checkpoint_path", "checkpoint_name", "weight_version")
                }
                entry.update(seq=seq, pushed_at=merged["finished_at"])
                # A rollback (or restore) makes push `seq` the latest again.
                self.whole_pushes = [h for h in self.whole_pushes if h["seq"] < seq] + [entry]
                del self.whole_pushes[:-KEPT_WHOLE]
            elif merged["server_weights"] is not None:  # partial, or whole again (restored)
                self.server_weights = merged["server_weights"]

    def snapshot(
        self, queued: int, extra: dict[str, Any], stages: list[StageFigures]
    ) -> dict[str, Any]:
        with self._lock:
            state = "stopping" if self.stopping else ("busy" if self.running or queued else "idle")
            running = self.running
            if running is not None and stages:
                running = {**running, **describe_stage(stages[-1])}
            return {
                "ok": True,
                "state": state,
                "rank": self.rank,
                "world_size": self.world_size,
                "takes_push": self.rank == 0,
                "push_host": self.hosts[0] if self.hosts else None,
                "targets": self.targets,
                "commands": self.commands,
                "failed": self.failed,
                "queued": queued,
                "running": running,
                "server_weights": self.server_weights,
                "weights": self.weights,
                "whole_pushes": self.whole_pushes,
                "last": self.last,
                "last_refused": self.last_refused,
                **extra,
            }


def push_again(
    whole: dict[str, Any],
    action: str,
    *,
    seq: int = 0,
    push_id: str | None = None,
    pause: PauseMode | None = None,
) -> ServeCommand:
    """A command that pushes a whole set (JobStatus.whole_pushes) again: a restore
    or a rollback, with that push's checkpoint, name and weight version (a restore: with the
    failed push's --pause, whose resume follows it)."""
    return ServeCommand(
        action=action,
        seq=seq,
        restores=whole["seq"],
        push_id=push_id,
        pause=pause,
        **{k: whole[k] for k in ("checkpoint_path", "checkpoint_name", "weight_version")},
    )


def describe_stage(st: StageFigures) -> dict[str, Any]:
    """A running stage as `status` shows it: its name, what it waits on, how far it got."""
    elapsed = time.perf_counter() - st.started_at
    # elapsed_s and eta_s; stage_seconds and eta_seconds are their names before them.
    doc: dict[str, Any] = {"stage": st.name, "label": st.label}
    doc["elapsed_s"] = doc["stage_seconds"] = round(elapsed, 2)
    if st.detail:
        doc["detail"] = st.detail
    if st.bytes:
        done = st.done_bytes()
        doc.update(bytes=st.bytes, bytes_done=done)
        if done and elapsed > 0 and st.done.live:
            rate = done / elapsed
            eta = round((st.bytes - done) / rate, 1)
            doc.update(bytes_per_s=round(rate), eta_s=eta, eta_seconds=eta)
    return doc


class ServeLoop:
    """One rank's loop: the control socket's handlers (rank 0 queues pushes) and the ticks
    that run every command on every rank in the same order."""

    def __init__(
        self,
        job: Job,
        execute: Executor,
        channel: CommandChannel,
        *,
        push_timeout: float,
        state: ServeState,
        targets: list[str],
        restore: bool = True,
        metrics: Any = None,
    ) -> None:
        self.job = job
        self.metrics = metrics  # observe.metrics.ServeMetrics (serve --metrics-port), rank 0
        self.execute = execute
        self.channel = channel
        self.push_timeout = push_timeout
        self.serve_state = state  # the executor's own (registered, pinned pool)
        self.rank = job.launch.rank
        self.status = JobStatus(rank=self.rank, world_size=job.launch.world_size, targets=targets)
        self._lock = threading.Lock()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._next_seq = 1
        self._stop_reason: str | None = None
        self._signals = 0
        self._wake = threading.Event()
        # The command under way (rank 0's `/cancel` and a stop give it up through its scope).
        self._running: tuple[ServeCommand, Any] | None = None
        self.restore = restore  # push the last whole checkpoint again after a partial failure

    # -- the control socket's handlers (its threads) ------------------------------------------------
    def handlers(self) -> dict[tuple[str, str], Handler]:
        return {
            ("GET", "/status"): self.handle_status,
            ("GET", "/history"): self.handle_history,
            ("POST", "/push"): self.handle_push,
            ("POST", "/rollback"): self.handle_rollback,
            ("POST", "/stage"): self.handle_stage,
            ("POST", "/cancel"): self.handle_cancel,
            ("POST", "/stop"): self.handle_stop,
        }

    def handle_status(self, _doc: Any) -> tuple[int, dict[str, Any]]:
        with self._lock:
            queued = len(self._queue)
            stopping = self._stop_reason is not None
        served = self.serve_state
        staged = served.staged
        extra = {
            "staged": None if staged is None else staged.describe(),
            "registered": served.registered,
            "pinned_pool_bytes": served.pinned_pool_bytes,
            "served_tensors": served.served_tensors,
            "paused": served.pauses.describe() if served.pauses is not None else None,
        }
        doc = self.status.snapshot(queued, extra, self.job.reporter.running_stages())
        if stopping:  # asked to stop, still ending the command under way
            doc["state"] = "stopping"
        return 200, doc

    def handle_history(self, _doc: Any) -> tuple[int, dict[str, Any]]:
        """The push log (`status --history`): apart from /status, which a push polls."""
        return 200, {"ok": True, **self.status.pushes.snapshot()}

    def handle_stop(self, _doc: Any) -> tuple[int, dict[str, Any]]:
        self.request_stop("stopped by a client (ckptctl stop)")
        return 200, {"ok": True, "stopping": True}

    def _not_here(self) -> tuple[int, dict[str, Any]] | None:
        if self.rank == 0:
            return None
        where = self.status.hosts[0] if self.status.hosts else "rank 0's node"
        return 409, {
            "ok": False,
            "error": f"this node's serve job takes status and stop only: push on {where} "
            "(the node of global rank 0)",
        }

    def handle_push(self, doc: Any) -> tuple[int, dict[str, Any]]:
        return self._take("push", doc)

    def handle_stage(self, doc: Any) -> tuple[int, dict[str, Any]]:
        """Read a checkpoint ahead for the next push (`ckptctl stage`): answered once every
        rank has planned it and started reading; `status` shows how far the read got."""
        return self._take("stage", doc)

    def _take(self, action: str, doc: Any) -> tuple[int, dict[str, Any]]:
        """A client's push or stage: checked and bounded here, once, then queued."""
        refusal = self._not_here()
        if refusal:
            return refusal
        try:
            command = ServeCommand.from_request(action, doc)
        except BadCommand as exc:
            return 400, {"ok": False, "error": str(exc)}
        refused = pause_refusal(self.serve_state.pauses, command.pause)  # (a mode of the other
        if refused:  # kind of server: exit 2, before anything is sent)
            return 400, {"ok": False, "error": refused}
        return self._enqueue(command)

    def handle_rollback(self, doc: Any) -> tuple[int, dict[str, Any]]:
        """Push the whole checkpoint before the last whole one again, with its weight version
        (refused, exit 3, if there is none or its files changed)."""
        refusal = self._not_here()
        if refusal:
            return refusal
        try:
            push_id = push_id_of(doc, "rollback")
        except BadCommand as exc:
            return 400, {"ok": False, "error": str(exc)}
        with self._lock:
            earlier = self.status.previous()
        if earlier is None:
            return 200, {
                "ok": False,
                "exit_code": int(ExitCode.INVALID_INPUT),
                "error": "nothing to roll back to: the job has not pushed two whole checkpoints",
            }
        return self._enqueue(push_again(earlier, "rollback", push_id=push_id))

    def handle_cancel(self, doc: Any) -> tuple[int, dict[str, Any]]:
        """Give up the push a client named (its `push_id`): taken off the queue if it waits, its
        transfer ended (and the server restored) if it runs."""
        try:
            push_id = push_id_of(doc, "cancel")
        except BadCommand:
            push_id = None
        if not push_id:
            return 400, {"ok": False, "error": 'cancel needs {"push_id": ID}'}
        with self._lock:
            waiting = next((p for p in self._queue if p.command.push_id == push_id), None)
            if waiting is not None:
                self._queue.remove(waiting)
            running = self._running
        if waiting is not None:
            seq = waiting.command.seq
            result = {"ok": False, "exit_code": int(ExitCode.INTERRUPTED),
                      "error": "cancelled before it ran", "seq": seq,
                      "server_weights": None}  # fmt: skip
            waiting.finish(result)
            # (logged on rank 0 alone: the other ranks never saw this push)
            logged = dataclasses.asdict(waiting.command)
            self.status.pushes.add({**logged, **result, "finished_at": utc()})
            return 200, {"ok": True, "cancel": "cancelled", "seq": seq}
        if running is not None and running[0].push_id == push_id:
            running[1].publish_abort(ExitCode.INTERRUPTED, "cancelled by its client", request=True)
            return 200, {"ok": True, "cancel": "cancelling", "seq": running[0].seq}
        return 200, {"ok": True, "cancel": "not found"}  # already over (its answer says how)

    def _enqueue(self, command: ServeCommand) -> tuple[int, dict[str, Any]]:
        with self._lock:
            if self._stop_reason is not None or self.status.stopping:
                return 503, {"ok": False, "error": "the serve job is stopping"}
            if len(self._queue) >= MAX_QUEUED:
                return 503, {"ok": False, "error": f"{MAX_QUEUED} pushes are already waiting"}
            seq = self._next_seq
            self._next_seq += 1
            pending = _Pending(dataclasses.replace(command, seq=seq))
            self._queue.append(pending)
        self._wake.set()
        # Every push before it, then its own, each bounded by the job's watchdogs.
        per_push = self.push_timeout + HARD_GRACE_S + TICK_TIMEOUT_S
        if not pending.done.wait(per_push * (seq - self.status.commands)):
            return 200, {
                "ok": False,
                "exit_code": int(ExitCode.TIMEOUT),
                "error": f"the serve job did not finish push {seq} in time",
                "seq": seq,
            }
        assert pending.result is not None
        return 200, pending.result

    def request_stop(self, reason: str) -> None:
        """End the job: at the next tick when idle; a command under way is given up first
        (its transfer ended), and if it has not ended within STOP_GRACE_S, the watchdog ends
        this rank (and torchrun the others)."""
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = reason
            running = self._running
        if running is not None:
            if running[0].action != "restore":  # (a restore leaves the server whole: it runs)
                running[1].publish_abort(ExitCode.FAILED, f"stopped ({reason})", request=True)
            self.job.watchdog.end_at(
                time.monotonic() + STOP_GRACE_S,
                ExitCode.FAILED,
                f"{reason}, but push {running[0].seq} did not end within {STOP_GRACE_S:g}s: "
                "ending the job",
            )
        self._wake.set()

    def _on_signal(self, sig: Any) -> None:
        """The first SIGTERM/SIGINT stops the job cleanly; a second one ends it at once."""
        self._signals += 1
        if self._signals > 1:
            self.job.watchdog.exit_on_signal(sig)
        self.request_stop(f"stopped by {sig.name}")

    # -- the loop (main thread) ------------------------------------------------------------------------
    def run(self) -> str:
        """Run every command, in order, until a stop; returns why it stopped."""
        job = self.job
        job.watchdog.deadline = float("inf")  # serving is not bounded; each push is
        if self.metrics is not None:
            self.metrics.idle()
        try:
            while True:
                if self.rank == 0:
                    # The others wait in the tick's all-reduce already: a push starts the
                    # moment rank 0 takes it, not at the next of everyone's ticks.
                    self._wake.wait(TICK_S)
                    self._wake.clear()
                with self._lock:
                    pending = self._queue[0] if self._queue else None
                    stop_reason = self._stop_reason
                data = b"" if pending is None else self._sendable(pending)
                data, stop = self.channel.tick(data, stop_reason)
                if stop is not None:
                    return f"{stop[1]} (on rank {stop[0]})"
                if not data:
                    continue
                if pending is not None:
                    with self._lock:  # (it, not the next one: a cancel may have taken it off)
                        if pending in self._queue:
                            self._queue.remove(pending)
                # Rank 0 sent only what this very parser read back (_sendable).
                command = ServeCommand.from_json(data)
                try:
                    merged = self._run(command)
                except GroupLost:
                    raise
                except Exception as exc:  # noqa: BLE001 - one command's failure never ends the job
                    merged = self._failed(command, exc)
                if pending is not None:
                    pending.finish(merged)
        finally:
            if self.metrics is not None:
                self.metrics.stopping()
            with self._lock:
                self.status.stopping = True
                left, self._queue = list(self._queue), collections.deque()
            for p in left:
                p.finish({"ok": False, "exit_code": int(ExitCode.FAILED),
                          "error": "the serve job stopped before this push ran",
                          "seq": p.command.seq})  # fmt: skip

    def _sendable(self, pending: _Pending) -> bytes:
        """Rank 0: the JSON of the next command, stamped now, that every rank will read; b""
        (and the command answered with why) in the case its own parser could not read it."""
        try:
            pending.command = dataclasses.replace(pending.command, started_at=utc())
            data = pending.command.to_json()
            ServeCommand.from_json(data)  # what the other ranks will do with it
            return data
        except Exception as exc:  # noqa: BLE001 - never sent: no rank runs it
            with self._lock:
                if pending in self._queue:
                    self._queue.remove(pending)
            pending.finish(failure_result(exc) | {"seq": pending.command.seq})
            return b""

    def _failed(self, command: ServeCommand, exc: Exception) -> dict[str, Any]:
        """The result of a command that failed outside its push, where every rank handles the
        results alike (merge_results on): logged as failed, and the job serves on."""
        what = {k: getattr(command, k) for k in ("action", "seq", "restores", "push_id")}
        merged = {**failure_result(exc), **what, "checkpoint_path": command.checkpoint_path}
        merged.update(finished_at=utc(), ranks=[])
        self.status.record(merged)
        return merged

    def _run(self, command: ServeCommand) -> dict[str, Any]:
        self.status.begin(command)
        if self.metrics is not None:
            self.metrics.busy()
        merged = self._run_everywhere(command)
        stages = self.job.reporter.figures.stages  # (this push's: a restore starts its own)
        if merged["server_weights"] == "partial":
            self._restore(merged, command)
        # --pause: every server resumed, now that every one is whole (or restored)
        pauses = self.serve_state.pauses
        resume_after_command(
            pauses, self.job, self.channel, command, merged, stages, TICK_TIMEOUT_S
        )
        if command.trace:
            merged["trace"] = timeline.push_trace(
                command.trace, merged["ranks"], write_it=self.rank == 0
            )
        self.status.record(merged)
        if self.metrics is not None:
            self.metrics.ended(merged, stages, self.status.weights)
        if self.rank == 0:
            what = f"{merged['action']} {merged['seq']} ({merged['checkpoint_path']})"
            if merged["ok"]:
                self.job.reporter.log(f"{what}: done in {merged['seconds']:.2f}s")
            else:  # (at level error in --log-format json: the job goes on, the push failed)
                self.job.reporter.error(f"{what} failed: {merged['error']}")
        return merged

    def _run_everywhere(self, command: ServeCommand) -> dict[str, Any]:
        mine = self._execute(command)
        ranks = self.channel.gather(mine, self.push_timeout + HARD_GRACE_S + TICK_TIMEOUT_S)
        # Every rank is past the command (it sent its result): nobody reads its store keys now.
        assert self.job.coordinator is not None
        self.job.coordinator.drop_scope(_scope(command))
        return merge_results(command, ranks)

    def _restore(self, merged: dict[str, Any], command: ServeCommand) -> None:
        """A push failed after the server began taking its weights: push the last whole
        checkpoint again, so that the server ends whole on the previous version. Every rank
        decides alike (`merged` and the state are the same on every rank)."""
        whole = self.status.weights
        if not self.restore or whole is None:
            why = "serve --no-restore" if not self.restore else "no whole push before it"
            merged["error"] += f" ({PARTIAL_WEIGHTS_NOTE}; not restored: {why})"
            return
        # With the push's own --pause: resume_after_command resumes by the push's mode, so a
        # restore that paused by the job's (push --pause none) would leave the servers paused.
        restore = push_again(whole, "restore", seq=merged["seq"], pause=command.pause)
        self.status.begin(restore)
        again = self._run_everywhere(restore)
        merged["restore"] = {
            "ok": again["ok"],
            "restored_push": whole["seq"],
            "wall_s": again["wall_s"],
            "seconds": again["wall_s"],
            "error": again["error"],
        }
        if again["ok"]:
            merged["server_weights"] = "whole"
            merged["error"] += f"; server weights: whole again (restored push {whole['seq']})"
        else:
            merged["error"] += (
                f" ({PARTIAL_WEIGHTS_NOTE}: the restore of push {whole['seq']} failed: "
                f"{again['error']})"
            )

    def _execute(self, command: ServeCommand) -> dict[str, Any]:
        """This rank's part of one command, under its own deadline."""
        job = self.job
        assert job.coordinator is not None
        job.reporter.figures = StageLog()  # this push's stages only
        deadline = time.monotonic() + self.push_timeout
        job.watchdog.deadline = deadline + HARD_GRACE_S
        clock = PushClock(job.watchdog, deadline, self.push_timeout)
        # What its ranks agree on goes over the group; each waits at most until the watchdog
        # has ended a rank that never comes (its connections close, and this one fails).
        exchanges = Exchanges(
            self.channel,
            exchanges_of(command),
            lambda: max(clock.remaining(), 0.0) + HARD_GRACE_S + TICK_TIMEOUT_S,
        )
        push_job = Job(
            job.launch,
            job.coordinator.scoped(_scope(command)),
            cast(Any, clock),
            job.reporter,
            exchange=exchanges,
        )
        with self._lock:
            self._running = (command, push_job.coordinator)
            stop_reason = self._stop_reason
        if stop_reason is not None and command.action != "restore":
            # A stop that came as it started: give it up at once. (A restore still runs: it
            # leaves the server whole, and the stop's grace bounds it.)
            assert push_job.coordinator is not None
            push_job.coordinator.publish_abort(
                ExitCode.FAILED, f"stopped ({stop_reason})", request=True
            )
        if command.trace:
            timeline.start_recording()
        started = time.perf_counter()
        try:
            result = {"ok": True, "exit_code": 0, "error": None, **self.execute(push_job, command)}
        except GroupLost:
            raise
        except Exception as exc:  # noqa: BLE001 - one failed push must not end the job
            # checkpoint-engine raises plain exceptions too (an assert, a pin failure); the
            # push fails with them like with ours, and every rank gives up on it.
            result = failure_result(exc)
        finally:
            job.watchdog.deadline = float("inf")
            with self._lock:
                self._running = None
        if not result["ok"]:
            assert push_job.coordinator is not None
            push_job.coordinator.publish_abort(result["exit_code"], result["error"])
        # (after the abort notice: a rank waiting in the store for this one hears of it first)
        exchanges.finish(result["exit_code"], result["error"])
        result["rank"] = job.launch.rank
        result["wall_s"] = result["seconds"] = round(time.perf_counter() - started, 4)
        if command.trace:  # (taken out again by _run, once every rank's is in)
            result["trace_events"] = timeline.rank_events(
                job.launch.rank, job.reporter.figures.stages, timeline.take_spans()
            )
        return result


def _scope(command: ServeCommand) -> str:
    """The store scope of a command's keys: one per push (and one for the restore after it)."""
    return f"push{command.seq}" + ("-restore" if command.action == "restore" else "")


def serve_loop(
    job: Job,
    execute: Executor,
    *,
    control_socket: str | None,
    push_timeout: float,
    state: ServeState | None = None,
    targets: list[str] | None = None,
    restore: bool = True,
    metrics: Any = None,
) -> str:
    """Serve commands until a stop; returns why it stopped.

    control_socket: where this node's control endpoint listens (its local rank 0 hosts it);
    None: the default, named after `targets` (control.py). state: the executor's own state,
    shown by `status` (registered, pinned_pool_bytes).
    """
    assert job.coordinator is not None
    launch = job.launch
    channel = CommandChannel(job.coordinator.second_connection(), launch.rank, launch.world_size)
    server = None
    try:
        loop = ServeLoop(
            job,
            execute,
            channel,
            push_timeout=push_timeout,
            state=state if state is not None else ServeState(),
            targets=targets or [],
            restore=restore,
            metrics=metrics,
        )
        # A SIGTERM from here until the loop ends stops the job cleanly, also one that comes
        # while the ranks meet below: rank 0 opens the control socket when a rank may not run
        # the loop yet.
        job.watchdog.on_signal = loop._on_signal
        # Every rank is in the group: learn where each one runs (status names rank 0's host).
        hosts = channel.gather({"host": socket.gethostname()}, TICK_TIMEOUT_S)
        loop.status.hosts = [d["host"] for d in hosts]
        if launch.local_rank == 0:
            path = control_socket or default_socket_path(targets or [])
            server = ControlServer(path, loop.handlers()).start()
            job.reporter.log(f"serving: control socket {path}")
        return loop.run()
    finally:
        job.watchdog.on_signal = None
        if server is not None:
            server.close()
        channel.close()

"""One push of a serve job: the transfer of `update` (transfer/sequence.py), on every rank.

How a push fails without ending the job:
- before the transfer (a bad checkpoint, a server that is not up): every rank gives up on the
  push (its store scope's abort key); the previous checkpoint stays registered and served;
- during it, before the server's workers connected: each rank ends its blocked transfer with a
  stand-in peer (ParameterServerSession.rescue); the server's weights are untouched;
- after they connected: checkpoint-engine's own error path ends the transfer on every rank and
  the push fails with `"server_weights": "partial"` (the next whole push mends them); where
  that path does not end it within STUCK_TRANSFER_GRACE_S, the job ends as `update` would.

checkpoint-engine's store barrier reuses one key (its issue #106): from the second update on
it no longer waits for the other ranks, so a push ends with a barrier of ours under the push's
own scope before any rank unregisters the previous checkpoint or refills its buffers.

What decides what the server loads, or what a push reports, goes over the job's own group
(commands.Exchanges), never through the store, where anyone who reaches its port can write:
every rank's plan, with whether its stage can be sent (`exchanges_of`), and what --verify
proves. The store carries only what can make a rank more careful (SECURITY.md lists each key).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ckptctl.errors import (
    PARTIAL_WEIGHTS_NOTE,
    CkptctlError,
    ExitCode,
    InvalidInput,
    UsageError,
    error_for,
)
from ckptctl.job.coordination import describe_abort
from ckptctl.job.runner import Job
from ckptctl.serve.commands import CommandChannel, ServeCommand
from ckptctl.serve.state import ServedLayout, ServeState, Staged
from ckptctl.settings import PauseMode, RegisterMode, Setting
from ckptctl.transfer import stages
from ckptctl.transfer.pausing import RESUME_BUDGET_S, ServerPauses
from ckptctl.transfer.registration import Registration, for_request

if TYPE_CHECKING:
    from ckptctl.ce import ParameterServerSession
    from ckptctl.checkpoint import Checkpoint, Plan, RankPlan
    from ckptctl.job.groups import GroupAssignment
    from ckptctl.serve.state import ServeOptions
    from ckptctl.transfer.host_memory import ShareReader
    from ckptctl.transfer.overlap import OverlappedRead
    from ckptctl.transfer.request import TransferRequest
    from ckptctl.transfer.stages import ServerRequest

Executor = Any  # Callable[[Job, ServeCommand], dict] (loop.py)

# How long after a push's deadline the job's watchdog ends the job (a stage stuck for good).
HARD_GRACE_S = 30.0
# After a failure with the server's workers connected: how long checkpoint-engine's own error
# path may take to end the transfer before the job ends.
STUCK_TRANSFER_GRACE_S = 15.0


class PushClock:
    """The job's watchdog as a push's stages see it: the push's own deadline.

    Stages bound their waits by `watchdog.remaining()`; here that runs out at the push's
    deadline, so that a slow server fails the push (exit 4), not the job. Everything else is
    the job's watchdog (its deadline, later by HARD_GRACE_S, ends the job)."""

    def __init__(self, watchdog: Any, deadline: float, timeout_s: float) -> None:
        self._watchdog = watchdog
        self.push_deadline = deadline
        self.push_timeout_s = timeout_s

    def remaining(self) -> float:
        return self.push_deadline - time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._watchdog, name)


class PushFailure:
    """Ends a push's transfer on this rank when the push fails during it.

    Called by the leader's request thread with the server's refusal (or its death), and by the
    watcher on every rank when the push was given up (its abort key: another rank failed, a
    stop, a cancel) or its deadline passed. Its message is final (`guarding`).
    """

    def __init__(self, job: Job, session: ParameterServerSession) -> None:
        self.job = job
        self.session = session
        self.request: ServerRequest | None = None  # abandoned on a failure
        self.code: int | None = None
        self.message = ""
        self._handled = threading.Event()
        self._update_over = threading.Event()

    def __call__(self, code: int, message: str) -> None:
        if self._update_over.is_set():
            return  # a late word from an abandoned request: the push is decided already
        assert self.job.coordinator is not None
        self.job.coordinator.publish_abort(code, message)
        # The first failure wins (the abort key): a server that gave up because another rank
        # failed first (its read, mid-transfer) is not what this push failed of.
        abort = self.job.coordinator.aborted()
        if abort is not None and not abort["request"] and abort["rank"] != self.job.launch.rank:
            code, message = int(abort["code"]), describe_abort(abort)
        self._end_transfer(code, message)

    def _end_transfer(self, code: int, message: str) -> None:
        if self._handled.is_set():
            return
        self._handled.set()
        self.code, self.message = code, message
        if self.request is not None:
            self.request.abandon()
        if self.session.rescue(message):
            return
        # The workers connected: a cancel sends checkpoint-engine down its own error path on
        # every rank (ce/transfer_sockets.ReplyWatchingSocket.cancel). Where even that does not
        # end the transfer (a peer rank stuck in NCCL), only ending the process frees it.
        self.session.cancel(message)
        threading.Thread(
            target=self._end_job_if_stuck,
            args=(code, message),
            name="ckptctl-push-stuck",
            daemon=True,
        ).start()

    def _end_job_if_stuck(self, code: int, message: str) -> None:
        if not self._update_over.wait(STUCK_TRANSFER_GRACE_S):
            self.job.watchdog.fail(
                code,
                f"{message}; the transfer had started and did not end, so the serve job ends "
                f"({PARTIAL_WEIGHTS_NOTE})",
            )

    @contextlib.contextmanager
    def guarding(self, request: ServerRequest) -> Iterator[None]:
        """While the update runs, end it here too when another rank's push failed or the
        push's deadline passed (a little after it: the request thread's own timeout, which
        says more, goes first); a failed push fails with the server's words, not the
        rescue's echo of them."""
        self.request = request
        # Before the watcher starts: on a busy machine it may hear of a failure elsewhere before
        # this rank's update begins, and must end this transfer, not judge it by the last one
        # (whose workers connected: it waited for that to end, then ended the job).
        self.session.new_transfer()
        done = threading.Event()
        clock = self.job.watchdog

        def watch() -> None:
            assert self.job.coordinator is not None
            while not done.wait(0.1):
                abort = self.job.coordinator.aborted()
                if abort is not None:
                    self._end_transfer(int(abort["code"]), describe_abort(abort))
                    return
                if clock.remaining() < -2.0:
                    self(
                        ExitCode.TIMEOUT,
                        f"timed out after {getattr(clock, 'push_timeout_s', 0):g}s during the "
                        f"update; raise {Setting.push_timeout.flag} if the server is just slow",
                    )
                    return

        thread = threading.Thread(target=watch, name="ckptctl-push-watch", daemon=True)
        thread.start()
        try:
            yield
        except CkptctlError:
            if self.code is not None:
                raise error_for(self.code, self.message) from None
            raise
        finally:
            self._update_over.set()
            done.set()
            thread.join(timeout=5)


# A restore right after a failed push waits this long at most for the server: one that died
# with the push lost its weights anyway, and the job must take the next command (a stop) soon.
RESTORE_SERVER_WAIT_S = 5.0
# Whole pushes whose checkpoints a restore or a rollback may push again (the latest last).
KEPT_WHOLE = 4


def exchanges_of(command: ServeCommand) -> tuple[str, ...]:
    """The exchanges over the job's group that every rank of `command` makes, in order
    (commands.Exchanges): every rank's plan, with its vote on the stage (`vote_on_stage`);
    with --verify, what each server's checker offers, then what proves the weights
    (verification.py)."""
    return ("plan", "verify-offers", "verify-weights") if command.verify else ("plan",)


def check_layout(state: ServeState, checkpoint: Any, command: ServeCommand) -> None:
    """Refuse (exit 3) a checkpoint whose tensors are not those the server holds, unless the
    push allows a layout change: a server fails on a tensor of another shape in the middle of
    its update, with part of the checkpoint already taken."""
    served = state.layout
    if served is None or command.allow_layout_change:
        return
    from ckptctl.checkpoint.layout import layout_change

    change = layout_change(served.tensors, checkpoint.tensors)
    if change is not None:
        raise InvalidInput(
            f"{command.checkpoint_path}: its tensors are not those the server holds (from "
            f"push {served.seq}): {change}; a server fails on such a push mid-update and "
            "keeps partly updated weights: push a checkpoint of the served layout, or pass "
            "--allow-layout-change (allow_layout_change=True from Python) if the server takes this one"
        )


class ServePush(Registration):
    """A serve push's registration, around the way the job's mode asks for (`inner`):

    - prepare: the checks of what the job served before (the layout; a restore's files
      unchanged since), the inner way's own (--consume-shm-files'), then every rank's plan
      with its vote on the stage, over the job's group (vote_on_stage: the store decides
      nothing); then the read: the stage's buffers, where every rank can send its stage; else
      the job's pinned pool, refilled; else the inner way's;
    - register: the pool's buffers while the reader still fills them (overlap.py), from its
      second push on; else as the inner way registers.
    """

    def __init__(
        self,
        inner: Registration,
        state: ServeState,
        command: ServeCommand,
        session: ParameterServerSession,
        req: TransferRequest,
        opts: ServeOptions,
        read: OverlappedRead | None,
    ) -> None:
        super().__init__()
        self.inner, self.state, self.command = inner, state, command
        self.session, self.req, self.opts, self.read = session, req, opts, read
        self.staged: Staged | None = None  # the stage this push took, if it took one

    def plan(self, job: Job, req: TransferRequest) -> tuple[Checkpoint, Plan, RankPlan]:
        # (every rank's plan is compared over the job's group in prepare, with its vote)
        return stages.plan_share(job, self.command.checkpoint_path, req.split, check=False)

    def prepare(
        self, job: Job, checkpoint: Checkpoint, plan: Plan, share: RankPlan
    ) -> ShareReader | None:
        state, command, inner = self.state, self.command, self.inner
        inner.check(job, plan, meet=False)  # (the ranks meet in the plan exchange)
        if command.action != "push":
            _check_unchanged(state, command, checkpoint)
        # Every rank planned the same checkpoint (checked next, over the group): every rank
        # refuses alike, before any byte moves.
        check_layout(state, checkpoint, command)
        sendable = vote_on_stage(job, state, command, plan, share, inner.reads_ahead)
        self.staged = take_staged(state, sendable)
        if self.staged is not None:
            # Read already (or still reading) into buffers of its own: the checkpoint the
            # server holds stays registered until this one is in.
            job.reporter.log(f"push {command.seq}: read ahead by `stage`")
            return self.staged.reader
        pool = state.pool
        if pool is not None and inner.reads_ahead and state.registered is not None:
            # Its buffers are refilled with this checkpoint: the server already holds it, and
            # without p2p nobody reads it from here any more (every rank passed the previous
            # push's closing barrier).
            self.session.unregister(state.registered, pool)
            state.registered = None
        return stages.prefetch_share(
            checkpoint,
            share,
            inner.mode,
            pool,
            plan=plan,
            read_threads=self.req.read_threads,
            reporter=job.reporter,
            drop_page_cache=self.opts.drop_page_cache,
        )

    def register(
        self,
        job: Job,
        session: ParameterServerSession,
        name: str,
        checkpoint: Checkpoint,
        share: RankPlan,
        reader: ShareReader | None,
    ) -> None:
        if self.read is None or reader is None or not self.read.register(name, reader):
            self.inner.register(job, session, name, checkpoint, share, reader)


def gpu_executor(
    opts: ServeOptions,
    session: ParameterServerSession,
    assignment: GroupAssignment,
    state: ServeState,
) -> Executor:
    """One command: a push (the transfer of `update`, then the previous checkpoint is
    unregistered), or a restore / rollback, which pushes an earlier whole checkpoint again
    (`command.restores`: its push's seq) if its files have not changed since."""
    from ckptctl.transfer import overlap
    from ckptctl.transfer.sequence import Transfer

    # From the second push on, a pool's buffers are handed over while they are read.
    gate = overlap.Gate(session) if state.pool is not None else None

    def execute(job: Job, command: ServeCommand) -> dict[str, Any]:
        action, seq = command.action, command.seq
        if action == "stage":
            return stage(job, command)
        name = command.checkpoint_name or f"push-{seq}"
        if action != "push":
            name = f"{name}-{action}-{seq}"
        if name == state.registered:
            name = f"{name}-{seq}"  # the one being served is still registered
        req = push_request(opts, command, name)
        inner = for_request(req)  # how the job's mode (or this push's) registers
        pool = state.pool  # serve --register-mode direct: buffers kept between pushes

        # The first push may wait --server-start-wait for a server that is starting; later
        # ones --server-wait: a server that is down fails the push, not the job.
        if action == "restore":
            wait, bound = min(opts.server_wait, RESTORE_SERVER_WAIT_S), Setting.restore_wait
        elif state.server_seen:
            wait, bound = opts.server_wait, Setting.server_wait
        else:
            wait, bound = opts.server_start_wait, Setting.server_start_wait
        guard = PushFailure(job, session)
        read = None
        if gate is not None and inner.reads_ahead:
            read = overlap.OverlappedRead(job, session, gate, guard)
        way = ServePush(inner, state, command, session, req, opts, read)
        t = Transfer(
            job,
            req,
            assignment,
            way,
            session=session,
            group_built=True,
            server_wait=wait,
            server_wait_setting=bound,
            guard=guard,
            pauses=state.pauses,
        )
        try:
            t.run()
            if read is not None:
                read.finish()
            # checkpoint-engine #106: its own barrier no longer waits after the first update.
            job.barrier("pushed")
        except BaseException as exc:
            # This push failed: drop it. The previous one stays registered, except in direct
            # mode, which released it above to refill its buffers (once its reader stopped).
            if read is not None:
                read.stop()
            if t.registered:
                session.unregister(name, pool)
            elif way.staged is not None:
                way.staged.discard()
            # (read by failure_result; no bucket announced: the server kept its weights)
            if t.transfer_began and session.workers_connected() and session.buckets_announced():
                exc.server_weights = "partial"  # type: ignore[attr-defined]
            raise
        finally:
            if t.server_up:
                state.server_seen = True
        checkpoint = t.checkpoint
        assert checkpoint is not None and t.plan is not None
        previous, state.registered = state.registered, name
        # The push whose checkpoint this is.
        served = command.restores if command.restores is not None else seq
        state.layout = ServedLayout(served, checkpoint.tensors)
        if previous is not None:
            session.unregister(previous, pool)
        if pool is not None and inner.consumes:
            pool.trim()  # the consumed files hold this push: unpin what the pool kept idle
        if pool is not None:
            state.pinned_pool_bytes = pool.pinned_bytes  # (read by status)
        if not inner.consumes:  # consumed files are gone: nothing to push again
            whole = state.whole
            whole[served] = checkpoint
            for old in sorted(whole)[:-KEPT_WHOLE]:
                del whole[old]
        return {
            "checkpoint_name": name,
            "staged": way.staged is not None,  # read ahead by `ckptctl stage`
            "split": t.plan.split,
            "total_bytes": checkpoint.total_bytes,
            "tensor_count": len(checkpoint.tensors),  # the whole checkpoint's, as in update
            "pinned_pool_bytes": None if pool is None else pool.pinned_bytes,
            **t.verified_fields(),
            "figures": job.figures(),
        }

    def stage(job: Job, command: ServeCommand) -> dict[str, Any]:
        """`ckptctl stage`: plan the checkpoint and start reading it into buffers of its own
        (the pool's second set: one more share of pinned host memory), while the server keeps
        what it holds; the push of it that follows takes them (`take_staged`)."""
        pool = state.pool
        if pool is None or opts.request.register_mode is not RegisterMode.direct:
            raise UsageError(
                "stage reads ahead into the pinned pool of serve --register-mode direct "
                "(the default): this job registers another way"
            )
        req = push_request(opts, command, f"stage-{command.seq}")
        # (every rank's plan compared over the group: the "plan" exchange)
        checkpoint, plan, share = stages.plan_share(job, command.checkpoint_path, req.split)
        check_layout(state, checkpoint, command)  # refused now, as its push would be
        state.drop_staged()  # a stage replaces the one before it
        reader = stages.prefetch_share(
            checkpoint,
            share,
            RegisterMode.direct,
            pool,
            plan=plan,
            read_threads=req.read_threads,
            drop_page_cache=opts.drop_page_cache,
        )
        assert reader is not None
        state.staged = Staged(command.seq, command.checkpoint_path, checkpoint, share, reader)
        state.pinned_pool_bytes = pool.pinned_bytes
        return {
            "staged": True,
            "split": plan.split,
            "total_bytes": checkpoint.total_bytes,
            "tensor_count": len(checkpoint.tensors),
            "pinned_pool_bytes": pool.pinned_bytes,
            "figures": job.figures(),
        }

    return execute


def push_request(opts: ServeOptions, command: ServeCommand, name: str) -> TransferRequest:
    """The job's request with this command's checkpoint and flags."""
    return opts.request.for_push(
        command.checkpoint_path,
        name,
        weight_version=command.weight_version,
        consume=command.consume_shm_files,
        verify=command.verify,
        pause=command.pause,
    )


def vote_on_stage(
    job: Job,
    state: ServeState,
    command: ServeCommand,
    plan: Plan,
    share: RankPlan,
    reads_ahead: bool,
) -> bool:
    """Whether every rank can send the stage it holds for this command: one of the same
    files, unchanged since they were staged (the same tensors, inodes, sizes, mtimes and ctimes), of
    its same share, read without an error. Each rank's vote travels with its plan, over the
    job's group (stages.check_same_plan), never through the store: a rank that sent staged
    bytes while another read files changed since would push a mix of two checkpoints, and a
    forged "yes" there once did exactly that. A rank's own "no" always stands."""
    staged = state.staged
    checkpoint = plan.checkpoint
    mine = (
        staged is not None
        and reads_ahead  # (a stage is read into buffers of its own: direct registration)
        and command.action == "push"
        and staged.checkpoint_path == command.checkpoint_path
        and staged.checkpoint.tensors == checkpoint.tensors
        and staged.checkpoint.file_ids == checkpoint.file_ids
        and staged.share.tensors == share.tensors
        and staged.reader.progress.error is None
    )
    votes = stages.check_same_plan(job, plan, command.checkpoint_path, {"stage": mine})
    return all(vote.get("stage") is True for vote in votes)


def take_staged(state: ServeState, sendable: bool) -> Staged | None:
    """The stage, if every rank voted it can be sent (vote_on_stage); else it is discarded:
    a command that reads a checkpoint ends the stage either way."""
    staged, state.staged = state.staged, None
    if staged is None or sendable:
        return staged
    staged.discard()
    return None


def _check_unchanged(state: ServeState, command: ServeCommand, checkpoint: Any) -> None:
    """A restore or rollback pushes the checkpoint of push `command.restores` again only if
    its files are the ones that push read (exit 3 otherwise): same files, same inodes, sizes,
    mtimes and ctimes, same headers."""
    from ckptctl.checkpoint.headers import changed_since

    seq = command.restores
    before = None if seq is None else state.whole.get(seq)
    if before is None:
        raise InvalidInput(
            f"push {seq}'s checkpoint cannot be pushed again: its files were consumed, or it is "
            f"older than the last {KEPT_WHOLE} whole pushes"
        )
    change = changed_since(before, checkpoint)
    if change is not None:
        raise InvalidInput(
            f"push {seq}'s checkpoint changed since it was pushed ({change}): not pushing it again"
        )


def resume_after_command(
    pauses: ServerPauses | None,
    job: Job,
    channel: CommandChannel,
    command: ServeCommand,
    merged: dict[str, Any],
    stages: list[Any],
    timeout_s: float,
) -> None:
    """The serve loop's half, once a command and the restore after it are over on every rank:
    every leader resumes its server, and the ranks share how it went (`channel.gather` within
    `timeout_s` and the resume's budget, on every rank alike), so that the answer names a server
    that did not resume. A push whose weights went in whole but that left a server paused fails
    (exit 1), its weights still recorded as whole. The resume's stage joins the ranks' figures
    (and trace) and, on rank 0, `stages` (the metrics')."""
    if pauses is None or command.action == "stage":
        return
    mode = command.pause or pauses.default
    if mode is PauseMode.none and not pauses.retry:
        return
    errors, stage = pauses.resume_own(job.reporter)
    mine: dict[str, Any] = {
        "rank": job.launch.rank,
        "errors": errors,
        "left": pauses.still_paused(),
        "stage": None,
    }
    if stage is not None:
        mine["stage"] = stage.as_json()
        if command.trace:
            from ckptctl.observe import timeline

            spans = timeline.rank_events(job.launch.rank, [stage], [])
            mine["trace_events"] = [e for e in spans if e["ph"] == "X"]
        if job.launch.rank == 0 and not any(st is stage for st in stages):
            stages.append(stage)  # (after a restore, the reporter kept it in the restore's)
    docs = channel.gather(mine, timeout_s + RESUME_BUDGET_S)
    for doc in docs:
        for result in merged.get("ranks") or []:
            if result.get("rank") != doc.get("rank"):
                continue
            if doc.get("stage") and isinstance(result.get("figures"), dict):
                result["figures"].setdefault("stages", {})["resume"] = doc["stage"]
            if doc.get("trace_events") and isinstance(result.get("trace_events"), list):
                result["trace_events"] += doc["trace_events"]
    failed = [e for doc in docs for e in doc.get("errors") or []]
    pauses.retry = bool(failed)
    pauses.left = [a for doc in docs for a in doc.get("left") or []]  # (status: every rank's)
    if not failed:
        return
    merged["not_resumed"] = failed
    said = "; ".join(failed)
    if merged.get("ok"):
        merged.update(
            ok=False,
            exit_code=int(ExitCode.FAILED),
            whole_but_paused=True,  # (JobStatus records the weights as whole all the same)
            error=f"the weights went in whole, but {said} (the job tries again after its next "
            "command and when it stops)",
        )
    else:
        merged["error"] = f"{merged.get('error')}; and {said}"

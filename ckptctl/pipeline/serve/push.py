"""One push of a serve job: the stages of `update` for one checkpoint, on every rank.

How a push fails without ending the job:

- before the transfer (a bad checkpoint, a server that is not up): the stage raises, every
  rank gives up on the push (its store scope's abort key), the previous checkpoint stays
  registered and the server keeps its weights;
- during the transfer, before the server's workers connected (the server refused, or the
  push ran past --push-timeout): each rank ends its blocked transfer with a stand-in peer
  (ParameterServerSession.rescue); the server's weights are untouched;
- after the workers connected: checkpoint-engine's own error path (a worker's error reply,
  the all-reduce of return codes) ends the transfer on every rank, and the push fails with
  `"server_weights": "partial"`: the server may hold a mix of old and new weights, and the next
  successful push, which sends every tensor, makes them whole again. Where that path does not
  end the transfer within STUCK_TRANSFER_GRACE_S (a worker that died or hangs), nothing
  short of ending the process frees checkpoint-engine, and the job ends as `update` would.

The push's deadline (PushClock) is what its stages see as the watchdog's; the job's own
watchdog ends the job only HARD_GRACE_S after it, for a stage that nothing else can end
(a read that never returns, an NCCL collective whose peer hangs).

checkpoint-engine's store barrier reuses one key (its issue #106): from the second update of
a ParameterServer on, it no longer waits for the other ranks. A push therefore ends with a
barrier of ours under the push's own scope (a fresh key per push) before any rank
unregisters the previous checkpoint or refills the buffers it was read from.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from ckptctl.errors import (
    PARTIAL_WEIGHTS_NOTE,
    CkptctlError,
    ExitCode,
    InvalidInput,
    error_for,
)
from ckptctl.pipeline.coordination import describe_abort
from ckptctl.pipeline.job import Job

Executor = Any  # Callable[[Job, dict], dict] (loop.py)

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
    stop, a cancel) or its deadline passed. Its message is final: `raise_if_failed`.
    """

    def __init__(self, job: Job, session: Any) -> None:
        self.job = job
        self.session = session
        self.request: Any = None  # the push's ServerRequest, abandoned on a failure
        self.code: int | None = None
        self.message = ""
        self._handled = threading.Event()
        self._update_over = threading.Event()

    def __call__(self, code: int, message: str) -> None:
        if self._update_over.is_set():
            return  # a late word from an abandoned request: the push is decided already
        assert self.job.coordinator is not None
        self.job.coordinator.publish_abort(code, message)
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
        # every rank (parameter_server.ReplyWatchingSocket.cancel). Where even that does not
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
    def watching(self) -> Iterator[None]:
        """While the update runs, end it here too when another rank's push failed or the
        push's deadline passed (a little after it: the request thread's own timeout, which
        says more, goes first)."""
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
                        "update; raise serve --push-timeout if the server is just slow",
                    )
                    return

        thread = threading.Thread(target=watch, name="ckptctl-push-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._update_over.set()
            done.set()
            thread.join(timeout=5)

    def raise_if_failed(self) -> None:
        if self.code is None:
            return
        raise error_for(self.code, self.message)


# A restore right after a failed push waits this long at most for the server: one that died
# with the push lost its weights anyway, and the job must take the next command (a stop) soon.
RESTORE_SERVER_WAIT_S = 5.0
# Whole pushes whose checkpoints a restore or a rollback may push again (the latest last).
KEPT_WHOLE = 4


def check_layout(state: dict[str, Any], checkpoint: Any, command: dict[str, Any]) -> None:
    """Refuse (exit 3) a checkpoint whose tensors are not those the server holds, unless the
    push allows a layout change: a server fails on a tensor of another shape in the middle of
    its update, with part of the checkpoint already taken."""
    served = state.get("layout")
    if served is None or command.get("allow_layout_change"):
        return
    from ckptctl.checkpoint.layout import layout_change

    change = layout_change(served["tensors"], checkpoint.tensors)
    if change is not None:
        raise InvalidInput(
            f"{command['checkpoint_path']}: its tensors are not those the server holds (from "
            f"push {served['seq']}): {change}; a server fails on such a push mid-update and "
            "keeps partly updated weights: push a checkpoint of the served layout, or pass "
            "--allow-layout-change (allow_layout_change=True from Python) if the server takes this one"
        )


def gpu_executor(opts: Any, session: Any, assignment: Any, state: dict[str, Any]) -> Executor:
    """One command: a push (the stages of `update`, then the previous checkpoint is
    unregistered), or a restore / rollback, which pushes an earlier whole checkpoint again
    (`command["restores"]`: its push's seq) if its files have not changed since."""
    from ckptctl.pipeline import stages
    from ckptctl.pipeline.verification import check_offers, check_weights, start_hashing

    def execute(job: Job, command: dict[str, Any]) -> dict[str, Any]:
        action = command.get("action", "push")
        name = command.get("checkpoint_name") or f"push-{command['seq']}"
        if action != "push":
            name = f"{name}-{action}-{command['seq']}"
        if name == state.get("registered"):
            name = f"{name}-{command['seq']}"  # the one being served is still registered
        from ckptctl.checkpoint.consume import check_consume
        from ckptctl.pipeline.update import check_consumable_together

        mode = "consume" if command.get("consume_shm_files") else opts.register_mode
        split = check_consume(command["checkpoint_path"], mode, opts.split)
        checkpoint, plan, share = stages.plan_share(job, command["checkpoint_path"], split)
        if action != "push":
            _check_unchanged(state, command, checkpoint)
        # Every rank planned the same checkpoint: every rank refuses alike, before any byte moves.
        check_layout(state, checkpoint, command)
        if mode == "consume":
            check_consumable_together(job, plan)  # before any rank consumes a file
        pool = state.get("pool")  # serve --register-mode direct: buffers kept between pushes
        if pool is not None and mode == "direct" and state.get("registered") is not None:
            # Its buffers are refilled with this checkpoint: the server already holds it, and
            # without p2p nobody reads it from here any more (every rank passed the previous
            # push's closing barrier).
            session.unregister(state["registered"], pool)
            state["registered"] = None
        reader = stages.prefetch_share(
            checkpoint,
            share,
            mode,
            pool if mode == "direct" else None,
            plan=plan,
            read_threads=opts.read_threads,
            reporter=job.reporter,
            drop_page_cache=opts.drop_page_cache,
        )
        stages.register_share(job, session, name, checkpoint, share, mode, reader)
        transfer_began = False
        verified = None
        try:
            # The first push may wait for the server's start-up (its deadline); later ones
            # wait --server-wait at most: a server that is down fails the push, not the job.
            if action == "restore":
                wait, flag = min(opts.server_wait, RESTORE_SERVER_WAIT_S), "a restore's wait"
            elif state.get("server_seen"):
                wait, flag = opts.server_wait, "serve --server-wait"
            else:
                wait, flag = None, "serve --push-timeout"
            stages.wait_for_server(job, assignment, opts.servers.engine, limit_s=wait, flag=flag)
            state["server_seen"] = True
            verification = None
            if command.get("verify"):  # push --verify: before anything is pushed (exit 3)
                verification = check_offers(job, assignment, round_trip=False)
                start_hashing(job, session, name, verification)
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
                flag="serve --push-timeout",
            )
            failure.request = request
            transfer_began = True
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
            if verification is not None:
                names = {t.name for t in checkpoint.tensors}
                verified = check_weights(job, assignment, verification, names)
            # checkpoint-engine #106: its own barrier no longer waits after the first update.
            job.barrier("pushed")
        except BaseException as exc:
            # This push failed: drop it. The previous one stays registered, except in direct
            # mode, which released it above to refill its buffers.
            session.unregister(name, pool)
            if transfer_began and session.workers_connected():  # read by failure_result
                exc.server_weights = "partial"  # type: ignore[attr-defined]
            raise
        previous, state["registered"] = state.get("registered"), name
        served = command.get("restores", command["seq"])  # the push whose checkpoint this is
        state["layout"] = {"seq": served, "tensors": checkpoint.tensors}
        state["served_tensors"] = len(checkpoint.tensors)  # (read by status)
        if previous is not None:
            session.unregister(previous, pool)
        if pool is not None and mode == "consume":
            pool.trim()  # the consumed files hold this push: unpin what the pool kept idle
        if pool is not None:
            state["pinned_pool_bytes"] = pool.pinned_bytes  # (read by status)
        if mode != "consume":  # consumed files are gone: nothing to push again from them
            whole = state.setdefault("whole", {})
            whole[served] = checkpoint
            for old in sorted(whole)[:-KEPT_WHOLE]:
                del whole[old]
        return {
            "checkpoint_name": name,
            "split": plan.split,
            "total_bytes": checkpoint.total_bytes,
            "tensor_count": len(share.tensors),
            "pinned_pool_bytes": None if pool is None else pool.pinned_bytes,
            "verified": verified["how"] if verified else None,
            "verification": verified,
            "figures": job.figures(),
        }

    return execute


def _check_unchanged(state: dict[str, Any], command: dict[str, Any], checkpoint: Any) -> None:
    """A restore or rollback pushes the checkpoint of push `command["restores"]` again only if
    its files are the ones that push read (exit 3 otherwise): same files, same inodes, sizes
    and mtimes, same headers."""
    from ckptctl.checkpoint.headers import changed_since

    seq = command["restores"]
    before = state.get("whole", {}).get(seq)
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

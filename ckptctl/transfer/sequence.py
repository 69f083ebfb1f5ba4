"""The one transfer sequence that `update`, `join` and a serve push run on every rank:

    plan → register → wait for the server → group → gather metas → push → verify

What differs is a parameter: a checkpoint to plan and register, or (join) the holders' metas to
pull from; a parameter server to start, or the one a serve job keeps; how long to wait for the
server; and (serve) a guard that ends a failed push without ending the job. save-metas runs
the first half, with no server: up to the gathered metas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ckptctl.settings import P2P, RegisterMode, Setting
from ckptctl.transfer import stages
from ckptctl.transfer.request import TransferRequest
from ckptctl.transfer.verification import (
    check_offers,
    check_weights,
    round_trip_reset,
    start_hashing,
)

if TYPE_CHECKING:
    from ckptctl.ce import ParameterServerSession
    from ckptctl.checkpoint import Checkpoint, Plan, RankPlan
    from ckptctl.job.groups import GroupAssignment
    from ckptctl.job.runner import Job
    from ckptctl.transfer.host_memory import ShareReader


class PushGuard(Protocol):
    """A serve push's guard (serve/push.PushFailure): takes the request's failures and ends
    the transfer on this rank when the push fails, without ending the job."""

    def __call__(self, code: int, message: str) -> None: ...

    def guarding(
        self, request: stages.ServerRequest
    ) -> contextlib.AbstractContextManager[None]: ...


def check_consumable_together(job: Job, plan: Plan, *, meet: bool = True) -> None:
    """--consume-shm-files: every rank checks the whole plan, and only once all of them have
    does any rank consume (pin and delete) a file: one that went ahead would delete files
    another rank was still checking. meet: False where the ranks meet later, before anything
    is consumed (a serve push's plan exchange)."""
    from ckptctl.checkpoint import consume

    consume.check_consumable(plan)
    if meet:
        job.barrier("consume-checked")


def failing_job(job: Job, session: ParameterServerSession) -> Callable[[int, str], None]:
    """The server's refusal or a timeout during the transfer ends the job (the watchdog); once a
    worker had taken the IPC handle, the error line says the server may hold a mix of weights."""
    from ckptctl.errors import PARTIAL_WEIGHTS_NOTE

    def fail(code: int, message: str) -> None:
        if session.workers_connected() and PARTIAL_WEIGHTS_NOTE not in message:
            message += f" ({PARTIAL_WEIGHTS_NOTE})"
        job.watchdog.fail(code, message)

    return fail


@dataclass
class Transfer:
    """One transfer on this rank: what it is given, then (`run`) how far it got."""

    job: Job
    request: TransferRequest
    assignment: GroupAssignment | None  # None: no server (save-metas holds it for joiners)
    session: ParameterServerSession | None = None  # None: started after planning, with `p2p`
    p2p: P2P = P2P.off
    early: stages.EarlyShare | None = None  # update: planned (and read) since the start
    metas: dict[int, Any] | None = None  # join: the holders' metas (nothing registered here)
    save_metas_file: str | None = None  # update --save-metas-file
    group_built: bool = False  # serve: the NCCL group was built at start-up
    server_wait: float | None = None  # None: until the deadline (exit 4); else exit 1
    server_wait_setting: Setting = Setting.timeout  # what bounds that wait
    # serve: checks of the planned checkpoint against what the job served before, then every
    # rank's plan compared over the job's group (stages.check_same_plan), once every local
    # check, --consume-shm-files' too, is done: it stands in for the store's plan check and
    # consume barrier, which a forged key could pass
    on_planned: Callable[[Checkpoint, Plan, RankPlan], None] | None = None
    # serve: reads the share into the job's pool; else the early reader, if any
    prefetch: Callable[[Checkpoint, Plan, RankPlan], ShareReader | None] | None = None
    # serve: registers the reader's buffers while it still fills them (True: overlap.py);
    # else they are registered once read
    register_early: Callable[[str, ShareReader], bool] | None = None
    guard: PushGuard | None = None  # serve; else a failure ends the job (failing_job)

    checkpoint: Checkpoint | None = None
    plan: Plan | None = None
    share: RankPlan | None = None
    registered: bool = False
    server_up: bool = False
    transfer_began: bool = False
    verified: dict[str, Any] | None = None

    def run(self) -> Transfer:
        job, req, assignment = self.job, self.request, self.assignment
        if self.save_metas_file and job.launch.rank == 0:  # (rank 0 writes it)
            from ckptctl.metas.fileformat import check_target

            # Refused before anything is registered or sent (the early read may have begun):
            # a file there that is not a metas file is the user's, never replaced.
            check_target(self.save_metas_file, "the metas file")
        reader: ShareReader | None = None
        if self.metas is None:
            assert req.checkpoint_path is not None
            checkpoint, plan, share = stages.plan_share(
                job, req.checkpoint_path, req.split, self.early, check=self.on_planned is None
            )
            self.checkpoint, self.plan, self.share = checkpoint, plan, share
            if self.early is not None:  # (its thread is done now that it has planned)
                reader = self.early.reader
            if req.register_mode is RegisterMode.consume:  # before any rank consumes a file
                check_consumable_together(job, plan, meet=self.on_planned is None)
            if self.on_planned is not None:
                self.on_planned(checkpoint, plan, share)
            if self.prefetch is not None:
                reader = self.prefetch(checkpoint, plan, share)
        if self.session is None:
            self.session = stages.start_parameter_server(job, p2p=self.p2p)
        session = self.session
        name = req.checkpoint_name
        if self.checkpoint is not None and self.share is not None:
            early = self.register_early
            if early is None or reader is None or not early(name, reader):
                stages.register_share(
                    job, session, name, self.checkpoint, self.share, req.register_mode, reader
                )
            self.registered = True
            if reader is not None:
                # A read still running (register_early) that failed already fails here, where
                # every rank can still give up on the push, before any byte moves.
                reader.raise_if_failed()
        verification = None
        if assignment is not None:
            stages.wait_for_server(
                job,
                assignment,
                req.servers.engine,
                limit_s=self.server_wait,
                setting=self.server_wait_setting,
                deadline_setting=req.timeout_setting,
            )
            self.server_up = True
            if req.verify:  # before anything is pushed: exit 3 where it cannot be done
                verification = check_offers(job, assignment, req.verify, hashes=self.registered)
                start_hashing(job, session, name, verification, reader)
        if not self.group_built:
            stages.build_group(job, session)
        stages.gather_metas(job, session, name, reader)
        if self.save_metas_file:
            stages.save_metas(job, session, self.save_metas_file, name)
        if assignment is None:
            return self
        if self.metas is not None:
            session.load_metas(self.metas)
        if verification is not None:
            round_trip_reset(job, assignment, verification)
        request = stages.ServerRequest(
            assignment,
            req.servers,
            job.watchdog,
            timeout=req.timeout,
            transfer_finished=session.wait_transfer_finished,
            on_failure=self.guard or failing_job(job, session),
            setting=req.timeout_setting,
        )
        self.transfer_began = True
        guarding = self.guard.guarding(request) if self.guard else contextlib.nullcontext()
        with guarding:
            stages.push(
                job,
                session,
                name,
                request,
                broadcast=req.update_method.broadcasts,
                p2p_ranks=list(range(req.servers.parallel_size))
                if req.update_method.uses_p2p
                else None,
                nbytes=self.nbytes,
            )
        if req.servers.weight_version is not None:
            stages.verify_weight_version(
                job, assignment, req.servers.engine, req.servers.weight_version
            )
        if verification is not None:
            names = {t.name for t in self.checkpoint.tensors} if self.checkpoint else None
            self.verified = check_weights(job, assignment, verification, names)
        return self

    @property
    def nbytes(self) -> int:
        if self.checkpoint is not None:
            return self.checkpoint.total_bytes
        return sum(
            meta_list.size
            for entry in (self.metas or {}).values()
            for meta_list in entry.memory_buffer_metas_list
        )

    def verified_fields(self) -> dict[str, Any]:
        """`verified` (how, in a result's words) and `verification` (what was checked)."""
        how = self.verified["how"] if self.verified else None
        return {"verified": how, "verification": self.verified}

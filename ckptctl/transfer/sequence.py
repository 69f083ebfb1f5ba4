"""The one transfer sequence that `update`, `join` and a serve push run on every rank:

    plan → register → wait for the server → group → gather metas → (pause) → push → verify
    → (resume)

What differs is a parameter: how the share is registered (registration.py: a checkpoint's
files copied, read or consumed, or - join - the holders' metas to pull from); a parameter
server to start, or the one a serve job keeps; how long to wait for the server; and (serve) a
guard that ends a failed push without ending the job. save-metas runs the first half, with no
server: up to the gathered metas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from ckptctl.errors import PARTIAL_WEIGHTS_NOTE, CkptctlError
from ckptctl.settings import P2P, PauseMode, Setting
from ckptctl.transfer import stages
from ckptctl.transfer.pausing import DrainWatch, ServerPauses
from ckptctl.transfer.registration import Registration
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
    from ckptctl.inference_server import ServerAddress
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
    registration: Registration  # how the share reaches the parameter server (a join's: none)
    session: ParameterServerSession | None = None  # None: started after planning, with `p2p`
    p2p: P2P = P2P.off
    save_metas_file: str | None = None  # update --save-metas-file
    group_built: bool = False  # serve: the NCCL group was built at start-up
    server_wait: float | None = None  # None: until the deadline (exit 4); else exit 1
    server_wait_setting: Setting = Setting.timeout  # what bounds that wait
    guard: PushGuard | None = None  # serve; else a failure ends the job (failing_job)
    # --pause: serve's, kept from push to push (it resumes after the command); else made here
    pauses: ServerPauses | None = None

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
        way = self.registration
        reader: ShareReader | None = None
        if way.plans:
            checkpoint, plan, share = way.plan(job, req)
            self.checkpoint, self.plan, self.share = checkpoint, plan, share
            reader = way.prepare(job, checkpoint, plan, share)
        if self.session is None:
            self.session = stages.start_parameter_server(job, p2p=self.p2p)
        session = self.session
        name = req.checkpoint_name
        if self.checkpoint is not None and self.share is not None:
            way.register(job, session, name, self.checkpoint, self.share, reader)
            self.registered = True
            if reader is not None:
                # A read still running (registered while read) that failed already fails
                # here, where every rank can still give up on the push, before any byte moves.
                reader.raise_if_failed()
        verification = None
        pauses = self.pausing()
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
            if pauses is not None:  # (before anything is sent: exit 1)
                pauses.check(job, assignment, req.pause)
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
        way.load(session)
        if pauses is not None:
            # every server, before any takes weights
            pauses.pause(job, assignment, req.pause, req.timeout_setting)
        if verification is not None:
            round_trip_reset(job, assignment, verification)
        drains = req.pause is PauseMode.none and (pauses is None or pauses.mode is None)
        request = stages.ServerRequest(
            assignment,
            req.servers,
            job.watchdog,
            timeout=req.timeout,
            transfer_finished=session.wait_transfer_finished,
            on_failure=self.guard or failing_job(job, session),
            setting=req.timeout_setting,
            flush_cache=pauses.flush_cache(req.pause) if pauses is not None else True,
            drain=DrainWatch(job.reporter, session.workers_connected_at) if drains else None,
        )
        self.transfer_began = True
        guarding = self.guard.guarding(request) if self.guard else contextlib.nullcontext()
        with self.naming_failed_server(session, request), guarding:
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
        if pauses is not None and pauses.resume_in_transfer:
            pauses.finish(job)  # once every server holds it (a serve job's loop resumes later)
        return self

    @contextlib.contextmanager
    def naming_failed_server(
        self, session: ParameterServerSession, request: stages.ServerRequest
    ) -> Iterator[None]:
        """A transfer that fails because of this group's own server - its worker's error, its
        death or silence - names that server, and marks the error (`failed_server`, which a
        serve job's merged answer prefers): with several servers every rank's transfer fails
        alike, and the others' errors only echo the first."""
        try:
            yield
        except CkptctlError as exc:
            where = self.group_server().describe()
            own = request.server_failure
            worker = session.worker_error()
            if own is None and worker is not None:
                own = f"{where}'s worker failed while loading the weights: {worker}"
            if own is not None:
                exc.failed_server = where  # type: ignore[attr-defined]
                said = own if where in own else f"{where}: {own}"
                if PARTIAL_WEIGHTS_NOTE in str(exc) and PARTIAL_WEIGHTS_NOTE not in said:
                    said += f" ({PARTIAL_WEIGHTS_NOTE})"
                exc.args = (said,)
            raise

    def group_server(self) -> ServerAddress:
        """This rank's group's server (a leader's own; the leader's for the others)."""
        assert self.assignment is not None
        if self.assignment.address is not None:
            return self.assignment.address
        leader = replace(self.job.launch, rank=self.assignment.leader)
        address = self.request.servers.assign(leader).address
        assert address is not None
        return address

    def pausing(self) -> ServerPauses | None:
        """--pause: the job's ServerPauses (serve's, or one of this transfer's own)."""
        if self.pauses is None and self.request.pause is not PauseMode.none:
            self.pauses = ServerPauses.attach(
                self.job, self.request.servers, default=self.request.pause
            )
        return self.pauses

    @property
    def nbytes(self) -> int:
        return self.registration.nbytes(self.checkpoint)

    def verified_fields(self) -> dict[str, Any]:
        """`verified` (how, in a result's words) and `verification` (what was checked)."""
        how = self.verified["how"] if self.verified else None
        return {"verified": how, "verification": self.verified}

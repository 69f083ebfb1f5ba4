"""How a rank's share reaches checkpoint-engine's parameter server: one class per way, chosen
from a registry by the request (`for_request`), as vLLM's model loader picks a loader per load
format. The transfer (sequence.py) asks each, in turn:

    plan      the checkpoint and this rank's share (a join has none: `plans` is False)
    prepare   every check before anything is registered, then the read that starts now
    register  the share into the parameter server: the "register" stage
    load      before the push, what the session must know of others' weights (a join)

- CheckpointEngineCopy (--register-mode engine): checkpoint-engine copies the share out of the file
  mapping into buffers it allocates;
- DirectRead (direct): the share read straight into buffers pinned in place, from the start;
- ConsumeShm (--consume-shm-files): /dev/shm files pinned in place, then deleted;
- FromMetas (join): nothing registered here; the holders' metas are loaded instead.

A serve push wraps one of the first three (serve/push.py, ServePush).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from ckptctl.settings import RegisterMode
from ckptctl.transfer import stages

if TYPE_CHECKING:
    from ckptctl.ce import ParameterServerSession
    from ckptctl.checkpoint import Checkpoint, Plan, RankPlan
    from ckptctl.job.runner import Job
    from ckptctl.progress import StageFigures
    from ckptctl.transfer.host_memory import ShareReader
    from ckptctl.transfer.request import TransferRequest


class Registration:
    """The way of a registration mode: planned with every rank's plan checked alike, no check
    of its own, no read ahead (CheckpointEngineCopy and ConsumeShm register from the files)."""

    mode: ClassVar[RegisterMode]
    plans: ClassVar[bool] = True
    # Reads the share into buffers of ckptctl's own (a serve job's pool, a stage, a read that
    # overlaps the transfer): DirectRead alone.
    reads_ahead: ClassVar[bool] = False
    # Takes the files (deleted once registered): nothing to push again from them.
    consumes: ClassVar[bool] = False

    def __init__(self, early: stages.EarlyShare | None = None) -> None:
        self.early = early  # update, save-metas: planned (and read) since the command started

    def plan(self, job: Job, req: TransferRequest) -> tuple[Checkpoint, Plan, RankPlan]:
        assert req.checkpoint_path is not None
        return stages.plan_share(job, req.checkpoint_path, req.split, self.early)

    def check(self, job: Job, plan: Plan, *, meet: bool) -> None:
        """What must hold on every rank before any rank registers (meet: the ranks wait for
        each other here; False where they meet later, before anything is registered)."""

    def prepare(
        self, job: Job, checkpoint: Checkpoint, plan: Plan, share: RankPlan
    ) -> ShareReader | None:
        """The checks, then the read under way, if any (the early one)."""
        self.check(job, plan, meet=True)
        return self.early.reader if self.early is not None else None

    def register(
        self,
        job: Job,
        session: ParameterServerSession,
        name: str,
        checkpoint: Checkpoint,
        share: RankPlan,
        reader: ShareReader | None,
    ) -> None:
        label = "loading the shares"  # (short: the live view adds ", N ranks" at 80 columns)
        with job.reporter.stage("register", label, nbytes=share.bytes, node_wide=True) as st:
            st.detail = f"{self.mode} registration"
            self._register(st, session, name, checkpoint, share, reader)

    def _register(
        self,
        st: StageFigures,
        session: ParameterServerSession,
        name: str,
        checkpoint: Checkpoint,
        share: RankPlan,
        reader: ShareReader | None,
    ) -> None:
        raise NotImplementedError

    def load(self, session: ParameterServerSession) -> None:
        """Before the push: nothing, but for a join."""

    def nbytes(self, checkpoint: Checkpoint | None) -> int:
        assert checkpoint is not None
        return checkpoint.total_bytes


class CheckpointEngineCopy(Registration):
    mode = RegisterMode.ce_copy

    def _register(
        self,
        st: StageFigures,
        session: ParameterServerSession,
        name: str,
        checkpoint: Checkpoint,
        share: RankPlan,
        reader: ShareReader | None,
    ) -> None:
        from ckptctl.checkpoint import load_rank_tensors

        # checkpoint-engine copies out of the file mappings itself, with no hook: the pages
        # of the mappings it has touched so far are the bytes it has copied.
        st.done.track(stages.file_pages_mapped_since_now())
        tensors = load_rank_tensors(checkpoint, share)
        session.register(name, tensors)
        del tensors  # views of the file mapping: drop them so the pages can go


class DirectRead(Registration):
    mode = RegisterMode.direct
    reads_ahead = True

    def _register(
        self,
        st: StageFigures,
        session: ParameterServerSession,
        name: str,
        checkpoint: Checkpoint,
        share: RankPlan,
        reader: ShareReader | None,
    ) -> None:
        assert reader is not None  # (read since before this stage: prefetch_share)
        session.register_buffers(name, reader.result())
        # Read and pinned in a thread since before this stage: its time is the wait.
        st.background = {"read": reader.read_seconds or 0.0, "pin": reader.pin_seconds or 0.0}
        st.background_started = reader.started_at  # (--trace)
        st.detail += (
            f" ({reader.threads} reader thread{'' if reader.threads == 1 else 's'}"
            f"{', pinned through the driver' if reader.pinned_by_driver else ''}"
            f"{', before torch' if reader.pinned_before_torch else ''})"
        )


class ConsumeShm(Registration):
    mode = RegisterMode.consume
    consumes = True

    def check(self, job: Job, plan: Plan, *, meet: bool) -> None:
        """Every rank checks the whole plan, and only once all of them have does any rank
        consume (pin and delete) a file: one that went ahead would delete files another rank
        was still checking."""
        from ckptctl.checkpoint import consume

        consume.check_consumable(plan)
        if meet:
            job.barrier("consume-checked")

    def _register(
        self,
        st: StageFigures,
        session: ParameterServerSession,
        name: str,
        checkpoint: Checkpoint,
        share: RankPlan,
        reader: ShareReader | None,
    ) -> None:
        # checkpoint-engine pins /dev/shm files in place and deletes them (asked for with
        # --consume-shm-files): whole files only, so the split is by files.
        session.register_files(name, [str(checkpoint.path_of(f)) for f in share.files])


class FromMetas(Registration):
    """join: this rank holds nothing; the holders' metas (a metas file's) are loaded before
    the push, which pulls the weights from them over p2p."""

    plans = False  # (and no mode: nothing registered here)

    def __init__(self, metas: dict[int, Any]) -> None:
        super().__init__()
        self.metas = metas

    def load(self, session: ParameterServerSession) -> None:
        session.load_metas(self.metas)

    def nbytes(self, checkpoint: Checkpoint | None) -> int:
        return sum(
            meta_list.size
            for entry in self.metas.values()
            for meta_list in entry.memory_buffer_metas_list
        )


REGISTRATIONS: dict[RegisterMode, type[Registration]] = {
    way.mode: way for way in (CheckpointEngineCopy, DirectRead, ConsumeShm)
}


def for_request(req: TransferRequest, early: stages.EarlyShare | None = None) -> Registration:
    """The registration the request's mode asks for."""
    return REGISTRATIONS[req.register_mode](early)

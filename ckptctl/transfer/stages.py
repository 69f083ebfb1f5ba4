"""The stages the GPU commands are built from, each timed and shown by the job's reporter;
transfer/sequence.py runs them in order. hold_for_joiners keeps the weights up for joiners
(save-metas, --sleep-time).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx

from ckptctl.checkpoint.remembered import LastResult
from ckptctl.errors import DeadlineExceeded, ExitCode, InvalidInput, OperationFailed
from ckptctl.inference_server import ServerAddress
from ckptctl.job.coordination import PAST_DEADLINE_S, StoppedByPeer, abort_error
from ckptctl.job.groups import GroupAssignment, ServerTargets, group_handles
from ckptctl.job.runner import Job
from ckptctl.observe import timeline
from ckptctl.progress import Reporter, format_bytes
from ckptctl.settings import P2P, RegisterMode, ServerKind, Setting

if TYPE_CHECKING:
    import signal

    from ckptctl.ce import ParameterServerSession
    from ckptctl.checkpoint import Checkpoint, Plan, RankPlan
    from ckptctl.job.coordination import Watchdog
    from ckptctl.launch import LaunchInfo
    from ckptctl.transfer.host_memory import PinnedPool, ShareReader
    from ckptctl.transfer.pausing import DrainWatch

# After the server says "done", the IPC transfer must finish within this many seconds: SGLang
# and vLLM answer only once their workers have loaded every bucket.
AFTER_ANSWER_GRACE_S = 15.0
# Each request of the weight-version read-back, in all (a server that trickles cannot stretch it).
READ_BACK_TIMEOUT_S = 10.0


def read_and_plan(checkpoint_path: str, world_size: int, split: str) -> tuple[Checkpoint, Plan]:
    """(checkpoint, plan): the headers read and the split planned, with the garbage collector
    paused meanwhile (tens of thousands of tensors, no cyclic garbage)."""
    from ckptctl.checkpoint import plan_split, read_checkpoint
    from ckptctl.transfer.host_memory import gc_paused

    with gc_paused():
        checkpoint = read_checkpoint(checkpoint_path)
        return checkpoint, plan_split(checkpoint, world_size, split)  # type: ignore[arg-type]


class EarlyShare:
    """The split planned - and in direct mode this rank's share read - from the moment the
    command starts, in a thread, overlapping the join of the job's store and torch's import.
    Planning needs no torch, nor does reading into anonymous memory (host_memory.ShareReader); the
    buffers are pinned once torch is there. A failure here is raised by `plan_share`, inside
    the job, so every rank hears of it.
    """

    def __init__(
        self,
        checkpoint_path: str,
        split: str,
        launch: LaunchInfo,
        register_mode: RegisterMode,
        read_threads: int | None = None,
        reporter: Reporter | None = None,
    ) -> None:
        """reporter: the job's, whose "register" stage will count the bytes read here."""
        import threading

        self._args = (checkpoint_path, split, launch, register_mode, read_threads, reporter)
        self.checkpoint: Checkpoint | None = None
        self.plan: Plan | None = None
        self.reader: ShareReader | None = None
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        threading.Thread(target=self._run, name="ckptctl-plan", daemon=True).start()

    def _run(self) -> None:
        path, split, launch, mode, threads, reporter = self._args
        started = time.perf_counter()
        try:
            self.checkpoint, self.plan = read_and_plan(path, launch.world_size, split)
            self.seconds = time.perf_counter() - started
            self.reader = prefetch_share(
                self.checkpoint,
                self.plan.ranks[launch.rank],
                mode,
                plan=self.plan,
                read_threads=threads,
                reporter=reporter,
            )
        except BaseException as exc:  # noqa: BLE001 - raised by plan_share, inside the job
            self.error = exc
        finally:
            self._done.set()

    def wait(self, timeout_s: float) -> tuple[Checkpoint, Plan]:
        """(checkpoint, plan) once planned; what planning raised."""
        if not self._done.wait(max(timeout_s, 0.0)):
            raise DeadlineExceeded("planning the split did not finish within --timeout")
        if self.error is not None:
            raise self.error
        assert self.checkpoint is not None and self.plan is not None
        return self.checkpoint, self.plan


def plan_share(
    job: Job,
    checkpoint_path: str,
    split: str,
    early: EarlyShare | None = None,
    *,
    check: bool = True,
) -> tuple[Checkpoint, Plan, RankPlan]:
    """(checkpoint, plan, this rank's share): every rank computes the same plan on its own
    (already, when `early` started it before the job did). check: compare every rank's plan
    now (check_same_plan); False when the caller does, later (a serve push: sequence.py)."""
    with job.reporter.stage("split", "planning the split") as st:
        if early is not None:
            checkpoint, plan = early.wait(job.watchdog.remaining())
        else:
            checkpoint, plan = read_and_plan(checkpoint_path, job.launch.world_size, split)
        share = plan.ranks[job.launch.rank]
        st.detail = (
            f"{plan.split} split: this rank {format_bytes(share.bytes)}, "
            f"{len(share.tensors)} tensors from {len(share.files)} files"
        )
        if early is not None and early.seconds is not None:
            st.detail += f" (planned in {early.seconds:.2f}s, from the start)"
        if check:
            check_same_plan(job, plan, checkpoint_path)
    return checkpoint, plan, share


def plan_fingerprint(plan: Plan) -> str:
    """A digest of everything the plan depends on: the files, their headers, the split.

    Column by column (names, files, dtypes, shapes, offsets of each rank's tensors), so that
    the per-tensor work runs in C rather than in a JSON document's encoder. The same for the
    same split (a serve job's next push: checkpoint/remembered.py).
    """
    key = (plan.split, plan.world_size, plan.ranks)
    return _LAST_FINGERPRINT.get(key, lambda: _fingerprint(plan))


_LAST_FINGERPRINT: LastResult[str] = LastResult()


def _fingerprint(plan: Plan) -> str:
    import hashlib
    from array import array
    from itertools import chain
    from operator import attrgetter

    digest = hashlib.sha256(f"{plan.split}/{plan.world_size}".encode())
    for r in plan.ranks:
        tensors = r.tensors
        digest.update(f"/rank {r.rank}: {len(tensors)} tensors\0".encode())
        for column in ("name", "file", "dtype"):
            digest.update("\0".join(map(attrgetter(column), tensors)).encode() + b"\0\0")
        shapes = list(map(attrgetter("shape"), tensors))
        digest.update(array("q", map(len, shapes)).tobytes())
        digest.update(array("q", chain.from_iterable(shapes)).tobytes())
        for column in ("start", "end"):
            digest.update(array("q", map(attrgetter(column), tensors)).tobytes())
    return digest.hexdigest()


def check_same_plan(
    job: Job, plan: Plan, checkpoint_path: str, vote: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every node plans on its own copy of the checkpoint; they must all agree, or a tensor
    would be loaded twice or never (a partial copy, a stray file on one node).

    A serve job compares them over its own group (`job.exchange`), on every rank, and every
    rank's `vote` (what else its ranks must agree on before anything is read) travels with its
    plan: returns every rank's document. Elsewhere rank 0 compares what each rank published in
    the store (which anyone who reaches its port can write: SECURITY.md); returns []."""
    import socket

    mine = {"fingerprint": plan_fingerprint(plan), "host": socket.gethostname(), **(vote or {})}
    if job.exchange is not None:
        docs = job.exchange("plan", mine)
        first = docs[0]  # (every rank compares with rank 0, and refuses alike)
    elif job.coordinator is None:
        return [mine]
    else:  # (rank 0 compares; the others publish theirs and have none to compare)
        docs, first = job.gather("plan", mine) or [], mine
    for rank, doc in enumerate(docs):
        if doc.get("fingerprint") != first["fingerprint"]:
            raise InvalidInput(
                f"rank {rank} (on {doc.get('host')}) sees a different checkpoint at "
                f"{checkpoint_path} than rank 0 (on {first['host']}): copy the same files to "
                "every node (compare their sizes and model.safetensors.index.json)"
            )
    return docs if job.exchange is not None else []


def start_parameter_server(
    job: Job, *, p2p: P2P, longest_wait_s: float | None = None
) -> ParameterServerSession:
    """longest_wait_s: how long the job may wait in one collective before its watchdog ends it
    (default: the job's timeout); NCCL's own timeout is set past it (group_timeout_s)."""
    from ckptctl.ce import ParameterServerSession
    from ckptctl.job.process_group import group_timeout_s
    from ckptctl.transfer.host_memory import import_torch

    with job.reporter.stage("start", "starting checkpoint-engine's parameter server") as st:
        # A job of one process has joined no store yet, so its first `import torch` falls
        # here: say so, else it reads as a slow start.
        import_seconds = import_torch()
        if import_seconds is not None:
            st.detail = f"{import_seconds:.2f}s of it importing torch, this process's first"
        return ParameterServerSession(
            p2p=p2p,
            io_timeout=job.watchdog.remaining,
            on_failure=job.watchdog.fail,
            group_timeout_s=group_timeout_s(
                longest_wait_s if longest_wait_s is not None else job.watchdog.timeout_s
            ),
            group_store=(
                job.coordinator.second_connection() if job.coordinator is not None else None
            ),
        )


def prefetch_share(
    checkpoint: Checkpoint,
    share: RankPlan,
    mode: RegisterMode,
    pool: PinnedPool | None = None,
    *,
    plan: Plan | None = None,
    read_threads: int | None = None,
    reporter: Reporter | None = None,
    drop_page_cache: bool = False,
) -> ShareReader | None:
    """In direct mode, start reading and pinning the share now, while the ParameterServer
    starts (into the pinned buffers of `pool` when a long-lived job keeps them); with `plan`,
    every rank's metas are worked out there too, for gather_metas. The bytes it reads count
    towards the "register" stage that takes them over (`reporter`). drop_page_cache: the
    share's file pages are dropped from the page cache once read."""
    if mode != RegisterMode.direct:
        return None
    from ckptctl.transfer.host_memory import ShareReader

    on_read = reporter.counter("register").add if reporter is not None else None
    return ShareReader(
        checkpoint,
        share.tensors,
        read_threads,
        pool=pool,
        pin=True,
        plan=plan,
        rank=share.rank,
        on_read=on_read,
        drop_page_cache=drop_page_cache,
    )


def file_pages_mapped_since_now() -> Callable[[], int]:
    """Bytes of file pages this process has mapped since the call (RssFile in
    /proc/self/status; 0 where there is no such file). Never less than it said before: the
    kernel may take pages back under memory pressure."""

    def rss_file() -> int | None:
        try:
            with open("/proc/self/status", "rb") as fh:
                for line in fh:
                    if line.startswith(b"RssFile:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return None

    start = rss_file()
    most = [0]

    def mapped() -> int:
        now = rss_file()
        if start is not None and now is not None:
            most[0] = max(most[0], now - start)
        return most[0]

    return mapped


def wait_for_server(
    job: Job,
    assignment: GroupAssignment,
    engine: ServerKind,
    *,
    limit_s: float | None = None,
    setting: Setting = Setting.timeout,
    deadline_setting: Setting = Setting.timeout,
) -> None:
    """Each group leader waits until its server answers HTTP (SGLang's 503 counts); every rank
    then meets the others here, so no rank sits in checkpoint-engine's 10-minute store
    timeout while a slow server starts (--timeout may be longer).

    limit_s: the longest wait (a serve push's --server-wait, `setting`), which fails the push
    with exit 1; None, or one past the deadline: until the job's (or push's) deadline
    (`deadline_setting`), which is exit 4. The wait names what bounds it from its first line
    on, so that a wrong endpoint is no silent stall."""
    from ckptctl.readiness import Probe, Prober, wait_ready

    with job.reporter.stage("wait_server", "waiting for the inference server") as st:
        address = assignment.address
        if address is not None:  # (the leader)
            remaining = max(job.watchdog.remaining(), 0.0)
            limit = remaining if limit_s is None else min(limit_s, remaining)
            if limit_s is None or limit_s >= remaining:
                setting = deadline_setting  # (the deadline comes first)
            said = [-1.0]  # (when the last line was written: none yet)

            def on_attempt(probe: Probe, attempts: int, elapsed: float) -> None:
                # Visible while it lasts: `status` reads the detail; a log line at the first
                # answer that is not ready, then one every TICK_S.
                bound = f"{elapsed:.0f}s of {limit:.0f}s, {setting.flag}"
                st.detail = f"{address.describe()}: {probe.status} ({bound})"
                if not probe.ready and said[0] < 0:
                    said[0] = elapsed
                    job.reporter.log(
                        f"waiting up to {limit:.0f}s ({setting.flag}) for {address.describe()}: "
                        f"{probe.status}"
                    )
                elif not probe.ready and elapsed - said[0] >= job.reporter.TICK_S:
                    said[0] = elapsed
                    job.reporter.log(f"still waiting for {st.detail}")
                if job.coordinator is not None and job.coordinator.scope:
                    abort = job.coordinator.aborted()  # this push was given up (stop, cancel)
                    if abort is not None:
                        raise abort_error(abort)

            prober = Prober(address, ServerKind(engine))
            try:
                result = wait_ready(prober, timeout=limit, interval=0.5, on_attempt=on_attempt)
            finally:
                prober.close()
            if not result.ready:
                what = (
                    f"{address.describe()} did not answer within {setting.flag} ({limit:.1f}s, "
                    f"{result.attempts} attempts, last: {result.last_status})"
                )
                if limit_s is not None and limit_s < remaining:
                    raise OperationFailed(f"{what}; is the server up?")
                raise DeadlineExceeded(what)
            st.detail = f"{address.describe()}: {result.last_status}"
        job.barrier("servers-up")


def build_group(job: Job, session: ParameterServerSession) -> None:
    """Wait for the NCCL group that has been building since the session started (its own
    stage, so that gather_metas shows the gather alone)."""
    with job.reporter.stage("group", "building the NCCL process group") as st:
        built = session.ensure_group()
        if built is not None:
            st.detail = f"built in {built:.2f}s, in the background"


def gather_metas(
    job: Job, session: ParameterServerSession, name: str, reader: ShareReader | None = None
) -> None:
    """checkpoint-engine's gather; with a direct registration's reader, which knows every
    rank's buffers from the plan, only the buffers' addresses travel (gather_planned)."""
    with job.reporter.stage("gather_metas", "gathering metas from every rank") as st:
        planned = getattr(reader, "planned", None)
        if planned is None:
            session.gather(name)
            return
        session.gather_planned(name, planned)
        st.detail = "planned metas, addresses gathered"


def save_metas(job: Job, session: ParameterServerSession, path: str, name: str) -> None:
    """Rank 0 writes the metas file; says whether joiners can use it."""
    if job.launch.rank != 0:
        return
    from ckptctl.metas import write_metas_file

    with job.reporter.stage("save_metas", f"writing {path}") as st:
        write_metas_file(
            path, session.metas(), checkpoint_name=name, world_size=job.launch.world_size
        )
        st.detail = "joinable over p2p" if session.p2p_enabled else "not joinable (no p2p store)"
    if not session.p2p_enabled:
        job.reporter.warn(
            f"{path} carries no p2p store addresses (mooncake/RDMA unavailable here): "
            "`ckptctl join` cannot pull from it"
        )


class ServerRequest:
    """The `req_func` checkpoint-engine calls in a thread of its own, once per update.

    Only a group's leader talks to the server. checkpoint-engine would print and drop any error
    raised here and then block forever, so failures go straight to the watchdog instead.
    """

    def __init__(
        self,
        assignment: GroupAssignment,
        servers: ServerTargets,
        watchdog: Watchdog,
        *,
        timeout: float,
        transfer_finished: Callable[[float], bool],
        on_failure: Callable[[int, str], None] | None = None,
        setting: Setting = Setting.timeout,
        flush_cache: bool = True,
        drain: DrainWatch | None = None,
    ) -> None:
        """flush_cache: SGLang's, for the pause in force (pausing.py); drain: --pause none's
        watch of the wait for the generations in flight, around the request."""
        self.assignment = assignment
        # Where a failure goes: by default the watchdog, which ends every rank; a long-lived
        # job ends just the push instead (serve.py).
        self.fail = on_failure or watchdog.fail
        self.engine = servers.engine
        self.weight_version = servers.weight_version
        self.watchdog = watchdog
        self.timeout = timeout  # the command's timeout (`setting`), for messages
        self.setting = setting
        # Blocks until the IPC transfer of the current update is over (True) or times out.
        self.transfer_finished = transfer_finished
        self.messages: list[str] = []
        self.server_failure: str | None = None  # its server died, hung or took no weights
        self.flush_cache = flush_cache
        self.drain = drain
        self._abandoned = threading.Event()

    def __call__(self, socket_paths: list[tuple[str, str]]) -> None:
        if not self.assignment.is_leader:
            return
        address = self.assignment.address
        assert address is not None
        handles = group_handles(socket_paths, self.assignment.members)
        # The request runs in a thread of its own: checkpoint-engine joins this one before its
        # update returns, and a push that failed (`abandon`) must not wait for the server's
        # answer to a request that no longer matters (a server that hangs never gives one).
        done = threading.Event()

        def run() -> None:
            try:
                self._request(address, handles)
            except OperationFailed as exc:  # ours, one line already (a server socket refused...)
                self.fail(exc.exit_code, f"update request failed: {exc}")
            except Exception as exc:  # noqa: BLE001 - never let a thread swallow it
                self.fail(ExitCode.FAILED, f"update request failed: {type(exc).__name__}: {exc}")
            finally:
                done.set()

        threading.Thread(target=run, name="ckptctl-update-request", daemon=True).start()
        while not done.wait(0.1):
            if self._abandoned.is_set():
                return

    def abandon(self) -> None:
        """The push failed: stop waiting for the server's answer (see `__call__`)."""
        self._abandoned.set()

    def _server_failed(self, code: int, message: str) -> None:
        """This group's own server failed the push (not a refusal, which may only echo another
        server's failure): kept, to name it (Transfer.naming_failed_server)."""
        if not self._abandoned.is_set():
            self.server_failure = message
        self.fail(code, message)

    def _request(self, address: ServerAddress, handles: dict[str, str]) -> None:
        from ckptctl.inference_server import UpdateRefused, describe_failure, push_update

        # The whole exchange ends a little before the job's deadline (PAST_DEADLINE_S, at most
        # a quarter of what is left): a server that trickles then fails the request on its own
        # terms, and in `serve` only this push, before the watchdog would end the whole job.
        remaining = self.watchdog.remaining()
        left = max(remaining - min(PAST_DEADLINE_S, remaining / 4), 0.1)
        sent_at = time.perf_counter()
        try:
            with self.drain.watching() if self.drain else contextlib.nullcontext():
                message = push_update(
                    address,
                    self.engine,
                    handles,
                    weight_version=self.weight_version,
                    timeout=left,
                    flush_cache=self.flush_cache,
                )
            timeline.record(f"POST to {address.describe()}", timeline.REQUEST, sent_at)
        except UpdateRefused as exc:
            self.fail(ExitCode.FAILED, f"{address.describe()} refused the update: {exc}")
            return
        except httpx.TimeoutException:
            self._server_failed(
                ExitCode.TIMEOUT,
                f"timed out after {self.timeout:g}s: {address.describe()} did not finish "
                f"the update; raise {self.setting.flag} if the server is just slow",
            )
            return
        except httpx.HTTPError as exc:
            self._server_failed(
                ExitCode.FAILED,
                f"update request to {address.describe()} failed: "
                f"{describe_failure(exc, address, left)}",
            )
            return
        if self._abandoned.is_set():
            return  # a late answer to a push that failed: it decides nothing now
        self.messages.append(message)
        # The server says it is done: the transfer on our side must end now too. If it does
        # not, the server answered without taking the weights (it never connected over IPC).
        if not self.transfer_finished(AFTER_ANSWER_GRACE_S):
            self._server_failed(
                ExitCode.FAILED,
                f"{address.describe()} answered success ({message!r}) but never took the weights "
                "over IPC: check that its GPUs are the ones this job's ranks use",
            )


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """checkpoint-engine runs gc.collect() inside every update, on the critical path, over a
    process of torch's size. Nothing we hold is garbage, so the collector skips it all while
    the update runs."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def push(
    job: Job,
    session: ParameterServerSession,
    name: str,
    request: ServerRequest,
    *,
    p2p_ranks: list[int] | None,
    broadcast: bool,
    nbytes: int,
) -> None:
    """The update itself: broadcast, then (for `all`) p2p into `p2p_ranks`, as the seed does."""
    with (
        job.reporter.stage("update", "pushing the weights", nbytes=nbytes) as st,
        frozen_heap(),
    ):
        # Every bucket the server's worker has loaded counts (parameter_server).
        session.on_bucket_loaded = st.done.add
        try:
            if broadcast:
                session.update(name, request, None)
            if p2p_ranks is not None:
                # (The seed sleeps 2 s here for its process group to go down: ours stays up.)
                session.update(name, request, p2p_ranks)
        finally:
            session.on_bucket_loaded = None
        if request.messages:
            st.detail = request.messages[-1]
        drained = request.drain.seconds if request.drain is not None else None
        if drained:
            st.detail += f" ({drained:.2f}s of it the drain: generations in flight first)"


def verify_weight_version(
    job: Job, assignment: GroupAssignment, engine: ServerKind, want: str
) -> None:
    if not assignment.is_leader:
        return
    from ckptctl.inference_server import CONTRACTS, describe_failure, make_client
    from ckptctl.readiness import read_weight_version

    address = assignment.address
    assert address is not None
    with job.reporter.stage("verify", "reading the weight version back") as st:
        try:
            with make_client(address, timeout=READ_BACK_TIMEOUT_S) as client:
                version, status = read_weight_version(client, CONTRACTS[ServerKind(engine)])
        except httpx.HTTPError as exc:
            error = DeadlineExceeded if isinstance(exc, httpx.TimeoutException) else OperationFailed
            raise error(
                f"reading the weight version back from {address.describe()} failed: "
                f"{describe_failure(exc, address, READ_BACK_TIMEOUT_S)}"
            ) from None
        if version != want:
            raise OperationFailed(
                f"{address.describe()} reports {status} after the update, not {want!r}"
            )
        st.detail = status


# How long a rank that reads a stop waits for a signal of its own: torchrun passes its SIGTERM
# to every rank, and Ctrl-C reaches every process of the terminal, nearly at once.
OWN_SIGNAL_GRACE_S = 1.0


def hold_for_joiners(job: Job, seconds: float | None) -> str:
    """Keep the registered weights up for joiners: `seconds`, or until SIGTERM/SIGINT.

    A signal to any one rank stops them all: the rank that got it says so in the job's store,
    and the others see it there (rather than taking its silence for a crash). Anyone who
    reaches the store can write that stop too, so a rank ends with success only on its own
    signal or time; one that only read the stop ends as interrupted (StoppedByPeer, 130).
    """
    reason: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        reason.append(f"stopped by {sig.name}")
        if job.coordinator is not None:
            job.coordinator.publish_stop(reason[0])

    job.watchdog.on_signal = on_signal
    job.watchdog.deadline = float("inf")  # serving is not bounded by --timeout
    how = f"for {seconds:g}s" if seconds is not None else "until SIGTERM/SIGINT"
    job.reporter.log(f"serving the registered weights {how}")
    end = time.monotonic() + (seconds if seconds is not None else float("inf"))
    try:
        while not reason and time.monotonic() < end:
            time.sleep(min(0.2, max(end - time.monotonic(), 0)))
            stopped = job.coordinator.stopped() if job.coordinator is not None else None
            if stopped is not None and not reason:
                grace = time.monotonic() + OWN_SIGNAL_GRACE_S
                while not reason and time.monotonic() < grace:
                    time.sleep(0.05)
                if not reason:
                    raise StoppedByPeer(
                        f"rank {stopped['rank']} stopped the job ({stopped['reason']}), as "
                        "the job's store says; this rank got no signal itself, and anyone who "
                        "reaches the store can write a stop"
                    )
    finally:
        job.watchdog.on_signal = None
    return reason[0] if reason else "time is up"

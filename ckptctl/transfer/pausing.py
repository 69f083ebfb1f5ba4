"""The job's half of `--pause` (the HTTP half is server_pause.py): every server a job feeds is
paused before the transfer and resumed after it, as one transaction, and never left paused.

The steps are ServerPauses' methods, in order: `check` (the server's version honours the mode,
else the push is refused before any weight is sent), `pause`, then the transfer, `finish` or
(serve) `resume_own` once every rank is done, and `resume_on_exit` on every other way out. The
barriers matter: no server takes weights while another is still being paused (SGLang #25319:
a pause that comes while an update waits for the writer lock deadlocks it), and none serves
again before every server is whole.

With --pause none nothing is paused; the wait for the generations in flight is the "drain"
stage (DrainWatch).

Limits (docs/pause-contract.md): a server whose node has no rank left (the node died, or a job of
one rank got SIGKILL) stays paused until someone resumes it (`server_pause.left_paused` says
how); a pause whose answer never came (a timeout) may take effect after the resume was sent.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ckptctl import server_pause
from ckptctl.errors import OperationFailed, print_error
from ckptctl.job.coordination import PAST_DEADLINE_S
from ckptctl.results import utc
from ckptctl.settings import PAUSE_MODES, PauseMode, ServerKind, Setting

if TYPE_CHECKING:
    from ckptctl.inference_server import ServerAddress
    from ckptctl.job.groups import GroupAssignment, ServerTargets
    from ckptctl.job.runner import Job
    from ckptctl.launch import LaunchInfo
    from ckptctl.progress import Reporter, StageFigures

# How long a resume may take (its retries included) after a push, and on the way out of a rank
# that is ending (torchrun gives a rank 30 s between its SIGTERM and its SIGKILL).
RESUME_BUDGET_S = 30.0
EXIT_RESUME_BUDGET_S = 10.0
DRAIN_POLL_S = 0.005


def node_servers(servers: ServerTargets, launch: LaunchInfo) -> list[ServerAddress]:
    """The servers of this rank's node, as its leaders' flags name them."""
    local = max(launch.local_world_size, 1)
    first = launch.rank - launch.rank % local
    found: list[ServerAddress] = []
    for leader in range(first, min(first + local, launch.world_size)):
        if leader % max(servers.parallel_size, 1) == 0:
            address = servers.assign(replace(launch, rank=leader)).address
            if address is not None and address not in found:
                found.append(address)
    return found


class ServerPauses:
    """What this rank has paused and must resume. Every rank of a job keeps one, alike: a leader
    pauses its own server; every rank knows whether a pause is in force, and which servers its
    node has (the backup on its way out)."""

    def __init__(
        self,
        servers: ServerTargets,
        launch: LaunchInfo,
        *,
        default: PauseMode = PauseMode.none,
        resume_in_transfer: bool = True,
    ) -> None:
        self.engine = servers.engine
        self.default = default  # serve --pause (a push may ask for another)
        self.resume_in_transfer = resume_in_transfer  # update, join; serve: after the command
        self.node_servers = node_servers(servers, launch)
        self._lock = threading.Lock()
        self.mode: PauseMode | None = None  # in force, from the pause stage until the resume
        self.since: float | None = None  # (time.time) when it was paused, for `status`
        self.last_mode: PauseMode | None = None
        # The servers this rank (a leader) sent a pause to and has not resumed: a pause that
        # got no answer may still take effect, so it is resumed all the same.
        self.paused: list[ServerAddress] = []
        self.version: str | None = None  # this leader's server's, read by `check`
        self.retry = False  # serve: a resume failed on some rank; the next command retries
        # serve: every server of the job a resume left paused, on whichever rank (for `status`,
        # which this node's first rank answers, whoever's leader failed to resume it)
        self.left: list[str] = []

    @classmethod
    def attach(cls, job: Job, servers: ServerTargets, **kw: Any) -> ServerPauses:
        """One for this rank, resumed by the watchdog's exit hook whatever ends the rank."""
        pauses = cls(servers, job.launch, **kw)
        job.watchdog.add_exit_hook(pauses.resume_on_exit)
        return pauses

    # -- before the transfer -----------------------------------------------------------------
    def check(self, job: Job, assignment: GroupAssignment, mode: PauseMode) -> None:
        """A leader: refuse (exit 1) a mode its server's version cannot honour, before any
        weight is sent. Nothing to ask while a pause is in force (a restore within the push)."""
        address = assignment.address
        if mode is PauseMode.none or address is None or self.mode is not None:
            return
        import httpx

        from ckptctl.inference_server import describe_failure

        timeout = min(server_pause.VERSION_TIMEOUT_S, max(job.watchdog.remaining(), 0.1))
        try:
            version = server_pause.read_version(address, self.engine, timeout)
        except httpx.HTTPError as exc:
            raise OperationFailed(
                f"reading the version of {address.describe()} (for --pause {mode}) failed: "
                f"{describe_failure(exc, address, timeout)}"
            ) from None
        problem = server_pause.version_problem(self.engine, mode, version)
        if problem is not None:
            others = [m.value for m in PAUSE_MODES[self.engine] if m is not mode]
            raise OperationFailed(
                f"{address.describe()} runs {self.engine} {version or '(no version read)'}, "
                f"which {problem}: --pause {mode} is refused before anything is sent (upgrade "
                f"the server, or use --pause {' or '.join(others)})"
            )
        self.version = version

    def pause(
        self,
        job: Job,
        assignment: GroupAssignment,
        mode: PauseMode,
        setting: Setting = Setting.timeout,
    ) -> None:
        """The "pause" stage: each leader pauses its server, then every rank waits for every
        server to be paused, within what is left of `setting` (named from the stage's first
        line). A no-op while a pause is in force (a restore keeps the push's)."""
        if mode is PauseMode.none or self.mode is not None:
            return
        left = job.watchdog.remaining()
        timeout = max(left - min(PAST_DEADLINE_S, left / 4), 0.1)
        label = f"pausing generation ({mode}), up to {timeout:.0f}s ({setting.flag})"
        with job.reporter.stage("pause", label) as st:
            with self._lock:
                self.mode = self.last_mode = mode
                self.since = time.time()
            address = assignment.address
            if address is not None and address in self.paused:
                st.detail = f"{address.describe()}: still paused (a resume failed before)"
            elif address is not None:
                with self._lock:
                    self.paused.append(address)  # before it is sent (see `paused`)
                server_pause.pause(address, self.engine, mode, timeout, setting.flag)
                st.detail = f"{address.describe()}: paused ({mode})"
            job.barrier("servers-paused")

    def flush_cache(self, mode: PauseMode) -> bool:
        """Whether the update asks SGLang to flush its cache (server_pause.flush_cache), for the
        pause in force (a restore's request carries no mode of its own)."""
        return server_pause.flush_cache(self.engine, self.mode or mode, self.version)

    # -- after it ---------------------------------------------------------------------------
    def finish(self, job: Job) -> None:
        """update, join: once every rank is done (read back, verified), each leader resumes its
        server; one that does not resume fails the command (its generation stays paused)."""
        if self.mode is None:
            return
        job.barrier("servers-whole")
        errors, _ = self.resume_own(job.reporter)
        if errors:
            raise OperationFailed(f"the weights went in, but {'; '.join(errors)}")

    def resume_own(self, reporter: Reporter) -> tuple[list[str], StageFigures | None]:
        """The "resume" stage on a leader that paused its server: (errors, the stage's figures);
        the pause is no longer in force on this rank either way."""
        with self._lock:
            targets = list(self.paused)
            self.mode = None
        if not targets:
            return [], None
        errors: list[str] = []
        with reporter.stage("resume", "resuming generation") as st:
            for address in targets:
                try:
                    attempts = server_pause.resume(address, self.engine, budget_s=RESUME_BUDGET_S)
                except server_pause.ResumeFailed as exc:
                    errors.append(server_pause.left_paused(str(exc), address, self.engine))
                    continue
                with self._lock:  # (unless the exit hook took it meanwhile)
                    if address in self.paused:
                        self.paused.remove(address)
                more = f" ({attempts} attempts)" if attempts > 1 else ""
                st.detail = f"{address.describe()}: resumed{more}"
            if errors:
                st.detail = errors[-1]
        return errors, st

    def still_paused(self) -> list[str]:
        """The servers this rank paused and could not resume (described)."""
        with self._lock:
            return [a.describe() for a in self.paused]

    def resume_on_exit(self) -> None:
        """The watchdog's exit hook (and run_job's end): whatever ended this rank, resume what it
        paused and, while a pause is in force, every server of its node (another rank's own
        may have been killed outright; resuming is idempotent). Bounded: EXIT_RESUME_BUDGET_S
        for all of them together."""
        with self._lock:
            targets = list(self.paused)
            if self.mode is not None:
                targets += [a for a in self.node_servers if a not in targets]
            self.paused, self.mode = [], None
        failed = resume_all(targets, self.engine, EXIT_RESUME_BUDGET_S)
        for address, why in failed.items():
            print_error(server_pause.left_paused(why, address, self.engine))

    def describe(self) -> dict[str, Any] | None:
        """What `status` says while servers are paused: the mode, since when, which servers
        (this node's while a command holds them paused; after a failed resume, those left)."""
        with self._lock:
            if self.mode is not None:
                servers, left = [a.describe() for a in self.node_servers], False
            elif self.left or self.paused:
                servers = self.left or [a.describe() for a in self.paused]
                left = True
            else:
                return None
            return {
                "mode": str(self.mode or self.last_mode),
                "since": utc(self.since) if self.since else None,
                "seconds": round(time.time() - self.since, 1) if self.since else None,
                "servers": servers,
                "resume_failed": left,
            }


def resume_all(targets: list[ServerAddress], engine: ServerKind, budget_s: float) -> dict[Any, str]:
    """Resume every server in `targets` side by side, within `budget_s` in all; the reason for
    each that did not resume."""
    failed: dict[Any, str] = {}

    def one(address: ServerAddress) -> None:
        try:
            server_pause.resume(address, engine, budget_s=budget_s)
        except Exception as exc:  # noqa: BLE001 - whatever it was, the server stays paused
            failed[address] = str(exc) or type(exc).__name__

    threads = [threading.Thread(target=one, args=(a,), daemon=True) for a in targets]
    for t in threads:
        t.start()
    end = time.monotonic() + budget_s + 1.0
    for address, t in zip(targets, threads, strict=True):
        t.join(max(end - time.monotonic(), 0.0))
        if t.is_alive():
            failed[address] = f"{address.describe()} did not answer the resume in time"
    return failed


class DrainWatch:
    """--pause none: the "drain" stage, from the update's request until the server's worker
    connects to take the weights - SGLang's update first waits for every generation in flight
    (its writer lock); it ends with the request's answer where no worker connects first."""

    def __init__(self, reporter: Reporter, connected_at: Callable[[], float | None]) -> None:
        self.reporter = reporter
        self.connected_at = connected_at  # (perf_counter of the worker's connection, or None)
        self.seconds: float | None = None

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Around the update's request (the leader's request thread)."""
        answered = threading.Event()

        def look(st: StageFigures) -> None:
            """The stage ends where the worker connected (if it has), not up to a poll later."""
            with contextlib.suppress(Exception):
                st.ended_at = self.connected_at()

        def watch() -> None:
            label = "waiting for the generations in flight (until the server takes the weights)"
            with self.reporter.stage("drain", label) as st:
                while st.ended_at is None and not answered.wait(DRAIN_POLL_S):
                    look(st)
                if st.ended_at is None:  # (one look more: a worker that connected in the last poll)
                    look(st)
                if st.ended_at is not None:
                    st.detail = "until the server's worker connected"
                else:
                    st.detail = "until the server answered (no worker connected first)"
            self.seconds = st.seconds

        thread = threading.Thread(target=watch, name="ckptctl-drain", daemon=True)
        thread.start()
        try:
            yield
        finally:
            answered.set()
            thread.join(timeout=5)


def pause_refusal(pauses: ServerPauses | None, mode: PauseMode | None) -> str | None:
    """Why a serve job cannot take a push's --pause (None: it can), a mode being one of
    PauseMode's (ServeCommand checked that): one the job's servers' kind lacks is refused at its
    control socket (a usage error, exit 2) before the push is queued, let alone sent."""
    if mode is None:
        return None
    from ckptctl.errors import UsageError
    from ckptctl.transfer.request import check_pause

    try:
        check_pause(mode, pauses.engine if pauses else None, flag="pause")
    except UsageError as exc:
        return f"{exc}: the serve job's servers are of that kind (serve --engine)"
    return None

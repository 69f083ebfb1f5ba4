"""One rank's share of a multi-rank job: where it sits, its watchdog, its stage figures.

`run_job` wraps every GPU command (update, save-metas, join): it connects to the job's store,
starts the watchdog, runs the command's body, and - when the body fails - tells the other ranks
why before this rank exits, so that none of them waits for it.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ckptctl.errors import CkptctlError, ExitCode, OperationFailed
from ckptctl.job.coordination import PAST_DEADLINE_S, Coordinator, StoppedByPeer, Watchdog
from ckptctl.job.node_progress import NodeProgress
from ckptctl.launch import LaunchInfo, launch_info
from ckptctl.observe import timeline
from ckptctl.progress import Reporter
from ckptctl.settings import Setting

T = TypeVar("T")
# (name, this rank's document) -> every rank's, in rank order: a serve push's exchange of what
# its ranks must agree on, over the job's own group (serve/commands.Exchanges)
Exchange = Callable[[str, dict[str, Any]], list[dict[str, Any]]]


@dataclass
class Job:
    launch: LaunchInfo
    coordinator: Coordinator | None
    watchdog: Watchdog
    reporter: Reporter
    started: float = field(default_factory=time.perf_counter)
    # A serve push's: what its ranks agree on (plans, --verify) goes there, not to the store.
    exchange: Exchange | None = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def figures(self, **extra: Any) -> dict[str, Any]:
        """This rank's figures: wall time, peak RSS and every stage."""
        return {
            "rank": self.launch.rank,
            **extra,
            "wall_s": round(self.elapsed(), 4),
            "peak_rss_bytes": peak_rss_bytes(),
            "stages": self.reporter.figures.as_json(),
        }

    def barrier(self, name: str) -> None:
        """Every rank reaches `name` (nothing to wait for in a job of one process)."""
        if self.coordinator is not None:
            self.coordinator.barrier(name, timeout_s=self.watchdog.remaining() + PAST_DEADLINE_S)

    def gather(
        self, key: str, mine: dict[str, Any], *, collect: bool | None = None
    ) -> list[dict[str, Any]] | None:
        """Every rank's `mine` (in rank order, through the store) where `collect` (default: on
        rank 0); None elsewhere. Every rank must call it."""
        if self.coordinator is None:
            return [mine]
        self.coordinator.publish(key, mine)
        if not (self.launch.rank == 0 if collect is None else collect):
            return None
        return self.coordinator.collect(key, timeout_s=max(self.watchdog.remaining(), 1.0))

    def gather_figures(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's figures on rank 0 (through the store); just ours elsewhere."""
        return self.gather("figures", mine) or [mine]


def peak_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def prepare_environment(
    *, bucket_size_gb: float | None = None, mem_fraction: float | None = None
) -> LaunchInfo:
    """checkpoint-engine reads its settings from the environment; a lone process gets a world of 1."""
    if bucket_size_gb is not None:
        os.environ["PS_MAX_BUCKET_SIZE_GB"] = bucket_size_env(bucket_size_gb)
    if mem_fraction is not None:
        os.environ["PS_MEM_FRACTION"] = str(mem_fraction)
    launch = launch_info()
    if not launch.under_torchrun:
        with socket.socket() as s:  # a free port for checkpoint-engine's store (it uses port+1)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port - 1),
        )
        launch = launch_info()
    return launch


def bucket_size_env(gb: float) -> str:
    """PS_MAX_BUCKET_SIZE_GB for about `gb` GiB, rounded to whole MiB.

    checkpoint-engine uses int(value * 2**30) bytes as is; the worker then views the second
    half of its double buffer at that offset as, say, bf16, which fails unless it is aligned.
    A whole number of MiB is a binary fraction of a GiB, so the string round-trips exactly.
    """
    mib = max(round(gb * 1024), 1)
    return repr(mib / 1024)


_P2P_NOTICE = "fail to initialize p2p store"


def configure_engine_logging(verbose: bool, debug: bool) -> None:
    """checkpoint-engine logs through loguru: keep its INFO chatter and tracebacks for -v / debug."""
    from loguru import logger

    rank = os.environ.get("RANK", "0")
    logger.remove()
    level = "DEBUG" if debug else ("INFO" if verbose else "WARNING")

    def fmt(record: Any) -> str:
        # A callable format: loguru then appends no traceback (our own error line says it).
        text = record["message"].replace("{", "{{").replace("}", "}}")
        # -v is for finding where the time goes: keep checkpoint-engine's own timeline.
        when = f"{record['time']:%H:%M:%S.%f} " if verbose or debug else ""
        return f"[rank {rank}] {when}checkpoint-engine: {text}\n" + ("{exception}" if debug else "")

    def wanted(record: Any) -> bool:
        # checkpoint-engine warns that it could not start its p2p store whenever mooncake is
        # missing or blocked, also when nobody asked for p2p; when p2p was asked for, our own
        # error (or save_metas' warning) says it better.
        return verbose or debug or _P2P_NOTICE not in str(record["message"])

    logger.add(sys.stderr, level=level, format=fmt, filter=wanted, backtrace=debug, diagnose=False)


def run_job(
    launch: LaunchInfo,
    reporter: Reporter,
    body: Callable[[Job], T],
    *,
    timeout: float,
    timeout_setting: Setting = Setting.timeout,
    verbose: bool = False,
    debug: bool = False,
) -> T:
    """Run `body` on this rank under a watchdog, bounded by `timeout` seconds (the setting that
    gave them, named in the timeout's line); a failure here ends every rank promptly."""
    coordinator = Coordinator.connect(launch, timeout)
    watchdog = Watchdog(
        launch, coordinator, timeout_s=timeout, timeout_flag=timeout_setting.flag,
        describe_stage=reporter.describe_running,
    )  # fmt: skip
    configure_engine_logging(verbose, debug)
    node = NodeProgress.start(launch, coordinator, reporter)  # rank 0 draws the whole node
    with watchdog:
        try:
            job = Job(launch, coordinator, watchdog, reporter)
            result = body(job)
            timeline.finish(job)  # --trace: every rank's stages, written by rank 0
            return result
        except CkptctlError as exc:
            # (A stop every rank has read needs no abort: the rank that was signalled ends 0.)
            if coordinator is not None and not isinstance(exc, StoppedByPeer):
                coordinator.publish_abort(exc.exit_code, str(exc))
            raise
        except Exception as exc:
            # Anything checkpoint-engine or torch raises: tell the other ranks before we go.
            if coordinator is not None:
                coordinator.publish_abort(ExitCode.FAILED, f"{type(exc).__name__}: {exc}")
            raise OperationFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            watchdog.run_exit_hooks()  # (the servers it paused, on every way out)
            if node is not None:
                node.stop()

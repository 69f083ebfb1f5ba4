"""`update`: split → register → wait for the server → gather metas → update → verify.

Every rank of the torchrun job runs `run_update`. Registration comes before waiting for the
server, so loading the checkpoint overlaps the server's own start-up (`--load-format dummy`).
Every wait is bounded by the watchdog (see coordination.py); every failure ends every rank.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptctl.errors import (
    CkptctlError,
    DeadlineExceeded,
    ExitCode,
    InvalidInput,
    OperationFailed,
    UsageError,
)
from ckptctl.launch import LaunchInfo, launch_info
from ckptctl.pipeline.coordination import Coordinator, Watchdog
from ckptctl.pipeline.groups import GroupAssignment, assign_group, group_handles
from ckptctl.progress import Reporter

# After the server says "done", the IPC transfer must finish within this many seconds: SGLang
# and vLLM answer only once their workers have loaded every bucket.
AFTER_ANSWER_GRACE_S = 15.0


@dataclass
class UpdateOptions:
    checkpoint_path: str
    checkpoint_name: str = "my-checkpoint-iter-0"
    endpoints: list[str] = field(default_factory=lambda: ["http://localhost:19730"])
    uds: list[str] = field(default_factory=list)
    api_key: str | None = None
    engine: str = "sglang"
    parallel_size: int = 8
    update_method: str = "broadcast"
    split: str = "auto"
    weight_version: str | None = None
    save_metas_file: str | None = None
    sleep_time: float = 0.0
    timeout: float = 600.0
    bucket_size_gb: float | None = None
    mem_fraction: float | None = None
    verbose: bool = False


def prepare_environment(opts: UpdateOptions, launch: LaunchInfo) -> LaunchInfo:
    """checkpoint-engine reads its settings from the environment; a lone process gets a world of 1."""
    if opts.bucket_size_gb is not None:
        os.environ["PS_MAX_BUCKET_SIZE_GB"] = bucket_size_env(opts.bucket_size_gb)
    if opts.mem_fraction is not None:
        os.environ["PS_MEM_FRACTION"] = str(opts.mem_fraction)
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
            MASTER_PORT=str(port - 1 if port > 1024 else port),
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


def configure_engine_logging(verbose: bool, debug: bool) -> None:
    """checkpoint-engine logs through loguru: keep its INFO chatter and tracebacks for -v / debug."""
    import sys

    from loguru import logger

    rank = os.environ.get("RANK", "0")
    logger.remove()
    level = "DEBUG" if debug else ("INFO" if verbose else "WARNING")

    def fmt(record: Any) -> str:
        # A callable format: loguru then appends no traceback (our own error line says it).
        text = record["message"].replace("{", "{{").replace("}", "}}")
        return f"[rank {rank}] checkpoint-engine: {text}\n" + ("{exception}" if debug else "")

    logger.add(sys.stderr, level=level, format=fmt, backtrace=debug, diagnose=False)


class ServerRequest:
    """The `req_func` checkpoint-engine calls in a thread of its own, once per update.

    Only a group's leader talks to the server. checkpoint-engine would print and drop any error
    raised here and then block forever, so failures go straight to the watchdog instead.
    """

    def __init__(
        self,
        opts: UpdateOptions,
        assignment: GroupAssignment,
        watchdog: Watchdog,
        transfer_finished: Callable[[float], bool],
    ) -> None:
        self.opts = opts
        self.assignment = assignment
        self.watchdog = watchdog
        # Blocks until the IPC transfer of the current update is over (True) or times out.
        self.transfer_finished = transfer_finished
        self.messages: list[str] = []

    def __call__(self, socket_paths: list[tuple[str, str]]) -> None:
        if not self.assignment.is_leader:
            return
        import httpx

        from ckptctl.server import UpdateRefused, describe_failure, push_update

        address = self.assignment.address
        assert address is not None
        handles = group_handles(socket_paths, self.assignment.members)
        timeout = max(self.watchdog.remaining(), 0.1)
        try:
            message = push_update(
                address,
                self.opts.engine,
                handles,
                weight_version=self.opts.weight_version,
                timeout=timeout,
            )
        except UpdateRefused as exc:
            self.watchdog.fail(ExitCode.FAILED, f"{address.describe()} refused the update: {exc}")
            return
        except httpx.TimeoutException:
            self.watchdog.fail(
                ExitCode.TIMEOUT,
                f"timed out after {self.opts.timeout:g}s: {address.describe()} did not finish "
                "the update; raise --timeout if the server is just slow",
            )
            return
        except httpx.HTTPError as exc:
            self.watchdog.fail(
                ExitCode.FAILED,
                f"update request to {address.describe()} failed: "
                f"{describe_failure(exc, address, timeout)}",
            )
            return
        except Exception as exc:  # noqa: BLE001 - never let checkpoint-engine's thread swallow it
            self.watchdog.fail(
                ExitCode.FAILED, f"update request failed: {type(exc).__name__}: {exc}"
            )
            return
        self.messages.append(message)
        # The server says it is done: the transfer on our side must end now too. If it does
        # not, the server answered without taking the weights (it never connected over IPC).
        if not self.transfer_finished(AFTER_ANSWER_GRACE_S):
            self.watchdog.fail(
                ExitCode.FAILED,
                f"{address.describe()} answered success ({message!r}) but never took the weights "
                "over IPC: check that its GPUs are the ones this job's ranks use",
            )


def _wait_for_server(opts: UpdateOptions, assignment: GroupAssignment, watchdog: Watchdog) -> str:
    from ckptctl.readiness import Prober, wait_ready

    assert assignment.address is not None
    prober = Prober(assignment.address, opts.engine, "listening")
    try:
        result = wait_ready(prober, timeout=max(watchdog.remaining(), 0.0), interval=0.5)
    finally:
        prober.close()
    if not result.ready:
        raise DeadlineExceeded(
            f"{assignment.address.describe()} did not answer within --timeout "
            f"({result.attempts} attempts, last: {result.last_status})"
        )
    return result.last_status


def _verify_weight_version(opts: UpdateOptions, assignment: GroupAssignment) -> str:
    from ckptctl.readiness import read_weight_version
    from ckptctl.server import CONTRACTS, make_client

    assert assignment.address is not None and opts.weight_version is not None
    with make_client(assignment.address, timeout=10.0) as client:
        version, status = read_weight_version(client, CONTRACTS[opts.engine])
    if version != opts.weight_version:
        raise OperationFailed(
            f"{assignment.address.describe()} reports {status} after the update, "
            f"not {opts.weight_version!r}"
        )
    return status


def run_update(opts: UpdateOptions, reporter: Reporter, *, debug: bool = False) -> dict[str, Any]:
    """Run every stage on this rank. Returns the job's summary (complete on rank 0)."""
    launch = prepare_environment(opts, launch_info())
    if opts.weight_version is not None and opts.engine == "vllm":
        raise UsageError("--weight-version needs --engine sglang: vLLM records no weight version")
    assignment = assign_group(
        rank=launch.rank,
        world_size=launch.world_size,
        local_world_size=launch.local_world_size,
        parallel_size=opts.parallel_size,
        endpoints=opts.endpoints,
        uds=opts.uds,
        api_key=opts.api_key,
    )
    if opts.update_method in ("p2p", "all"):
        from ckptctl.pipeline.parameter_server import p2p_missing

        missing = p2p_missing()
        if missing:
            raise InvalidInput(
                f"--update-method {opts.update_method} needs checkpoint-engine's p2p store: "
                f"{missing}; use --update-method broadcast"
            )

    coordinator = Coordinator.connect(launch, opts.timeout)
    watchdog = Watchdog(
        launch, coordinator, timeout_s=opts.timeout, describe_stage=lambda: reporter.figures.current
    )
    configure_engine_logging(opts.verbose, debug)
    with watchdog:
        try:
            summary = _run_stages(opts, reporter, launch, assignment, coordinator, watchdog)
        except CkptctlError as exc:
            if coordinator is not None:
                coordinator.publish_abort(exc.exit_code, str(exc))
            raise
        except Exception as exc:
            # Anything checkpoint-engine or torch raises: tell the other ranks before we go.
            if coordinator is not None:
                coordinator.publish_abort(ExitCode.FAILED, f"{type(exc).__name__}: {exc}")
            raise OperationFailed(f"{type(exc).__name__}: {exc}") from exc
        return summary


def _run_stages(
    opts: UpdateOptions,
    reporter: Reporter,
    launch: LaunchInfo,
    assignment: GroupAssignment,
    coordinator: Coordinator | None,
    watchdog: Watchdog,
) -> dict[str, Any]:
    from ckptctl.checkpoint import load_rank_tensors, plan_split, read_checkpoint
    from ckptctl.pipeline.parameter_server import ParameterServerSession

    wall_start = time.perf_counter()
    with reporter.stage("split", "planning the split") as st:
        checkpoint = read_checkpoint(opts.checkpoint_path)
        plan = plan_split(checkpoint, launch.world_size, opts.split)
        share = plan.ranks[launch.rank]
        st.bytes = share.bytes
        st.detail = (
            f"{plan.split} split, {len(share.tensors)} tensors from {len(share.files)} files"
        )

    with reporter.stage("start", "starting checkpoint-engine's parameter server"):
        session = ParameterServerSession(
            update_method=opts.update_method, io_timeout=watchdog.remaining
        )

    with reporter.stage("register", "loading and pinning this rank's share", nbytes=share.bytes):
        tensors = load_rank_tensors(checkpoint, share)
        session.register(opts.checkpoint_name, tensors)
        del tensors  # the views of the file mapping; the pinned copy lives in the PS

    if assignment.is_leader:
        with reporter.stage("wait_server", "waiting for the inference server") as st:
            st.detail = _wait_for_server(opts, assignment, watchdog)

    with reporter.stage("gather_metas", "gathering metas from every rank"):
        session.gather(opts.checkpoint_name)

    if opts.save_metas_file and launch.rank == 0:
        from ckptctl.metas import write_metas_file

        with reporter.stage("save_metas", f"writing {opts.save_metas_file}"):
            write_metas_file(
                opts.save_metas_file,
                session.metas(),
                checkpoint_name=opts.checkpoint_name,
                world_size=launch.world_size,
            )

    request = ServerRequest(opts, assignment, watchdog, session.wait_transfer_finished)
    with reporter.stage(
        "update", "pushing the weights to the server", nbytes=checkpoint.total_bytes
    ) as st:
        if opts.update_method in ("broadcast", "all"):
            session.update(opts.checkpoint_name, request, None)
        if opts.update_method in ("p2p", "all"):
            if opts.update_method == "all":
                time.sleep(2)  # as the seed: let the broadcast's process group go down first
            session.update(opts.checkpoint_name, request, list(range(opts.parallel_size)))
        if request.messages:
            st.detail = request.messages[-1]

    if opts.weight_version is not None and assignment.is_leader:
        with reporter.stage("verify", "reading the weight version back") as st:
            st.detail = _verify_weight_version(opts, assignment)

    wall = time.perf_counter() - wall_start
    mine = {
        "rank": launch.rank,
        "group": assignment.group,
        "leader": assignment.is_leader,
        "endpoint": assignment.address.describe() if assignment.address else None,
        "wall_s": round(wall, 4),
        "peak_rss_bytes": _peak_rss_bytes(),
        "stages": reporter.figures.as_json(),
    }
    ranks = [mine]
    if coordinator is not None:
        coordinator.publish("figures", mine)
        if launch.rank == 0:
            ranks = coordinator.collect("figures", timeout_s=max(watchdog.remaining(), 1.0))

    if opts.sleep_time > 0:
        # Keep the registered weights (and p2p store) up for joiners, beyond --timeout.
        watchdog.deadline += opts.sleep_time
        reporter.log(f"staying up for {opts.sleep_time:g}s (--sleep-time)")
        time.sleep(opts.sleep_time)
    session.unregister(opts.checkpoint_name)

    return {
        "ok": True,
        "checkpoint_name": opts.checkpoint_name,
        "checkpoint_path": str(opts.checkpoint_path),
        "engine": opts.engine,
        "update_method": opts.update_method,
        "split": plan.split,
        "world_size": launch.world_size,
        "inference_parallel_size": opts.parallel_size,
        "total_bytes": checkpoint.total_bytes,
        "tensors": len(checkpoint.tensors),
        "weight_version": opts.weight_version,
        "wall_s": round(wall, 4),
        "ranks": ranks,
    }


def _peak_rss_bytes() -> int:
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

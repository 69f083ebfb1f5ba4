"""`update`: split → register → wait for the server → gather metas → update → verify.

Every rank of the torchrun job runs `run_update`. Registration comes before waiting for the
server, so loading the checkpoint overlaps the server's own start-up (`--load-format dummy`).
Every wait is bounded by the watchdog (see coordination.py); every failure ends every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptctl.checkpoint.consume import check_consume
from ckptctl.errors import InvalidInput
from ckptctl.pipeline import stages
from ckptctl.pipeline.groups import ServerTargets
from ckptctl.pipeline.job import Job, prepare_environment, run_job
from ckptctl.pipeline.verification import (
    check_offers,
    check_weights,
    round_trip_reset,
    start_hashing,
)
from ckptctl.progress import Reporter


@dataclass
class UpdateOptions:
    checkpoint_path: str
    checkpoint_name: str = "my-checkpoint-iter-0"
    servers: ServerTargets = field(default_factory=ServerTargets)
    update_method: str = "broadcast"
    split: str = "auto"
    save_metas_file: str | None = None
    sleep_time: float = 0.0
    timeout: float = 600.0
    bucket_size_gb: float | None = None
    mem_fraction: float | None = None
    register_mode: str = "direct"
    read_threads: int | None = None  # direct registration's reader threads (None: from the cores)
    verify: str | None = None  # None | "auto" (--verify) | "round-trip" (--verify-round-trip)
    verbose: bool = False


def check_consumable_together(job: Job, plan: Any) -> None:
    """--consume-shm-files: every rank checks the whole plan, and only once all of them have
    does any rank consume (pin and delete) a file. A rank that went ahead deleted files that
    another rank was still checking (seen on 2x H200: rank 0 failed with FileNotFoundError)."""
    from ckptctl.checkpoint import consume

    consume.check_consumable(plan)
    job.barrier("consume-checked")


def _failing_job(job: Job, session: Any) -> Any:
    """The server's refusal or a timeout during the transfer ends the job (the watchdog); once a
    worker had taken the IPC handle, the error line says the server may hold a mix of weights."""
    from ckptctl.errors import PARTIAL_WEIGHTS_NOTE

    def fail(code: int, message: str) -> None:
        if session.workers_connected() and PARTIAL_WEIGHTS_NOTE not in message:
            message += f" ({PARTIAL_WEIGHTS_NOTE})"
        job.watchdog.fail(code, message)

    return fail


def run_update(opts: UpdateOptions, reporter: Reporter, *, debug: bool = False) -> dict[str, Any]:
    """Run every stage on this rank. Returns the job's summary (complete on rank 0)."""
    from ckptctl.pipeline.parameter_server import p2p_missing

    launch = prepare_environment(bucket_size_gb=opts.bucket_size_gb, mem_fraction=opts.mem_fraction)
    servers = opts.servers
    assignment = servers.assign(launch)
    split = check_consume(opts.checkpoint_path, opts.register_mode, opts.split)
    missing = p2p_missing()
    if opts.update_method in ("p2p", "all") and missing:
        raise InvalidInput(
            f"--update-method {opts.update_method} needs checkpoint-engine's p2p store: "
            f"{missing}; use --update-method broadcast"
        )
    # Broadcast never touches mooncake, unless the metas being saved should be joinable.
    if opts.update_method != "broadcast":
        p2p = "required"
    else:
        p2p = "optional" if opts.save_metas_file and missing is None else "off"

    # Planning (and in direct mode reading) starts now, while the job's store is joined and
    # torch imported.
    early = stages.EarlyShare(
        opts.checkpoint_path, split, launch, opts.register_mode, opts.read_threads, reporter
    )

    def body(job: Job) -> dict[str, Any]:
        checkpoint, plan, share = stages.plan_share(job, opts.checkpoint_path, split, early)
        if opts.register_mode == "consume":
            check_consumable_together(job, plan)  # before any rank consumes a file
        reader = early.reader
        session = stages.start_parameter_server(job, p2p=p2p)
        stages.register_share(
            job, session, opts.checkpoint_name, checkpoint, share, opts.register_mode, reader
        )
        stages.wait_for_server(job, assignment, servers.engine)
        verification = None
        if opts.verify:
            verification = check_offers(job, assignment, round_trip=opts.verify == "round-trip")
            start_hashing(job, session, opts.checkpoint_name, verification)
        stages.build_group(job, session)
        stages.gather_metas(job, session, opts.checkpoint_name, reader)
        if opts.save_metas_file:
            stages.save_metas(job, session, opts.save_metas_file, opts.checkpoint_name)
        if verification is not None:
            round_trip_reset(job, assignment, verification)
        request = stages.ServerRequest(
            assignment,
            servers,
            job.watchdog,
            timeout=opts.timeout,
            transfer_finished=session.wait_transfer_finished,
            on_failure=_failing_job(job, session),
        )
        stages.push(
            job,
            session,
            opts.checkpoint_name,
            request,
            broadcast=opts.update_method in ("broadcast", "all"),
            p2p_ranks=list(range(servers.parallel_size))
            if opts.update_method != "broadcast"
            else None,
            nbytes=checkpoint.total_bytes,
        )
        if servers.weight_version is not None:
            stages.verify_weight_version(job, assignment, servers.engine, servers.weight_version)
        verified = None
        if verification is not None:
            names = {t.name for t in checkpoint.tensors}
            verified = check_weights(job, assignment, verification, names)
        wall = job.elapsed()
        ranks = job.gather_figures(
            job.figures(
                group=assignment.group,
                leader=assignment.is_leader,
                endpoint=assignment.address.describe() if assignment.address else None,
            )
        )
        if opts.sleep_time > 0:
            stages.hold_for_joiners(job, opts.sleep_time)  # the seed's --sleep-time
        session.unregister(opts.checkpoint_name)
        return {
            "ok": True,
            "checkpoint_name": opts.checkpoint_name,
            "checkpoint_path": str(opts.checkpoint_path),
            "engine": servers.engine,
            "update_method": opts.update_method,
            "split": plan.split,
            "world_size": launch.world_size,
            "inference_parallel_size": servers.parallel_size,
            "total_bytes": checkpoint.total_bytes,
            "tensor_count": len(checkpoint.tensors),
            "weight_version": servers.weight_version,
            "metas_file": opts.save_metas_file,
            "verified": verified["how"] if verified else None,
            "verification": verified,
            "wall_s": round(wall, 4),
            "ranks": ranks,
        }

    return run_job(launch, reporter, body, timeout=opts.timeout, verbose=opts.verbose, debug=debug)

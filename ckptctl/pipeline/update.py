"""`update`: split → register → wait for the server → gather metas → update → verify.

Every rank of the torchrun job runs `run_update`. Registration comes before waiting for the
server, so loading the checkpoint overlaps the server's own start-up (`--load-format dummy`).
Every wait is bounded by the watchdog (see coordination.py); every failure ends every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptctl.defaults import DEFAULT_ENDPOINT
from ckptctl.errors import InvalidInput, UsageError
from ckptctl.pipeline import stages
from ckptctl.pipeline.groups import assign_group
from ckptctl.pipeline.job import Job, prepare_environment, run_job
from ckptctl.progress import Reporter


@dataclass
class UpdateOptions:
    checkpoint_path: str
    checkpoint_name: str = "my-checkpoint-iter-0"
    endpoints: list[str] = field(default_factory=lambda: [DEFAULT_ENDPOINT])
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


def run_update(opts: UpdateOptions, reporter: Reporter, *, debug: bool = False) -> dict[str, Any]:
    """Run every stage on this rank. Returns the job's summary (complete on rank 0)."""
    from ckptctl.pipeline.parameter_server import p2p_missing

    launch = prepare_environment(bucket_size_gb=opts.bucket_size_gb, mem_fraction=opts.mem_fraction)
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
    missing = p2p_missing()
    if opts.update_method in ("p2p", "all") and missing:
        raise InvalidInput(
            f"--update-method {opts.update_method} needs checkpoint-engine's p2p store: "
            f"{missing}; use --update-method broadcast"
        )
    # Broadcast never touches mooncake, unless the metas being saved should be joinable.
    p2p = opts.update_method != "broadcast" or (bool(opts.save_metas_file) and missing is None)

    def body(job: Job) -> dict[str, Any]:
        checkpoint, plan, share = stages.plan_share(job, opts.checkpoint_path, opts.split)
        session = stages.start_parameter_server(job, p2p=p2p)
        stages.register_share(job, session, opts.checkpoint_name, checkpoint, share)
        stages.wait_for_server(job, assignment, opts.engine)
        stages.gather_metas(job, session, opts.checkpoint_name)
        if opts.save_metas_file:
            stages.save_metas(job, session, opts.save_metas_file, opts.checkpoint_name)
        request = stages.ServerRequest(
            assignment,
            job.watchdog,
            engine=opts.engine,
            weight_version=opts.weight_version,
            timeout=opts.timeout,
            transfer_finished=session.wait_transfer_finished,
        )
        stages.push(
            job,
            session,
            opts.checkpoint_name,
            request,
            broadcast=opts.update_method in ("broadcast", "all"),
            p2p_ranks=list(range(opts.parallel_size))
            if opts.update_method != "broadcast"
            else None,
            nbytes=checkpoint.total_bytes,
        )
        if opts.weight_version is not None:
            stages.verify_weight_version(job, assignment, opts.engine, opts.weight_version)
        wall = job.elapsed()
        ranks = job.gather_figures(
            job.figures(
                group=assignment.group,
                leader=assignment.is_leader,
                endpoint=assignment.address.describe() if assignment.address else None,
            )
        )
        if opts.sleep_time > 0:
            stages.serve(job, opts.sleep_time)  # the seed's --sleep-time: stay up for joiners
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
            "metas_file": opts.save_metas_file,
            "wall_s": round(wall, 4),
            "ranks": ranks,
        }

    return run_job(launch, reporter, body, timeout=opts.timeout, verbose=opts.verbose, debug=debug)

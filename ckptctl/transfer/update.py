"""`update`: the transfer (transfer/sequence.py) from a checkpoint's files, on every rank.

Registration comes before waiting for the server, so loading the checkpoint overlaps the
server's own start-up (`--load-format dummy`). Every wait is bounded by the watchdog (see
coordination.py); every failure ends every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptctl.job.runner import Job, prepare_environment, run_job
from ckptctl.progress import Reporter
from ckptctl.transfer import registration, stages
from ckptctl.transfer.request import TransferRequest, p2p_for_update
from ckptctl.transfer.sequence import Transfer


@dataclass
class UpdateOptions:
    request: TransferRequest
    save_metas_file: str | None = None
    sleep_time: float = 0.0
    bucket_size_gb: float | None = None
    mem_fraction: float | None = None
    verbose: bool = False


def run_update(opts: UpdateOptions, reporter: Reporter, *, debug: bool = False) -> dict[str, Any]:
    """Run every stage on this rank. Returns the job's summary (complete on rank 0)."""
    from ckptctl.ce import p2p_missing

    req = opts.request
    assert req.checkpoint_path is not None
    launch = prepare_environment(bucket_size_gb=opts.bucket_size_gb, mem_fraction=opts.mem_fraction)
    servers = req.servers
    assignment = servers.assign(launch)
    p2p = p2p_for_update(
        req.update_method, save_metas=bool(opts.save_metas_file), missing=p2p_missing()
    )
    # Planning (and in direct mode reading) starts now, while the job's store is joined and
    # torch imported.
    early = stages.EarlyShare(
        req.checkpoint_path, req.split, launch, req.register_mode, req.read_threads, reporter
    )

    def body(job: Job) -> dict[str, Any]:
        way = registration.for_request(req, early)
        t = Transfer(job, req, assignment, way, p2p=p2p, save_metas_file=opts.save_metas_file)
        t.run()
        assert t.checkpoint is not None and t.plan is not None and t.session is not None
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
        t.session.unregister(req.checkpoint_name)
        return {
            "ok": True,
            "checkpoint_name": req.checkpoint_name,
            "checkpoint_path": req.checkpoint_path,
            "engine": servers.engine,
            "update_method": req.update_method.value,
            "split": t.plan.split,
            "world_size": launch.world_size,
            "inference_parallel_size": servers.parallel_size,
            "total_bytes": t.checkpoint.total_bytes,
            "tensor_count": len(t.checkpoint.tensors),  # the whole checkpoint's
            "weight_version": servers.weight_version,
            "metas_file": opts.save_metas_file,
            **t.verified_fields(),
            "wall_s": round(wall, 4),
            "ranks": ranks,
        }

    return run_job(launch, reporter, body, timeout=req.timeout, verbose=opts.verbose, debug=debug)

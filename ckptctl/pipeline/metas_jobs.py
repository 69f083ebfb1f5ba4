"""`save-metas` (hold a registered checkpoint for joiners) and `join` (pull it over p2p).

save-metas: split → register → gather → write the metas file (rank 0) → serve until
`--sleep-time` runs out or SIGTERM/SIGINT → unregister. The file is joinable only when
checkpoint-engine's p2p store (mooncake + RDMA) runs here; otherwise it says so.

join: read and check the metas file → check that p2p can work, *before* touching the server
→ start the PS with p2p → wait for this node's server → gather (own pool empty) → load_metas
→ update into this node's server over p2p.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptctl.errors import InvalidInput
from ckptctl.pipeline import stages
from ckptctl.pipeline.groups import ServerTargets
from ckptctl.pipeline.job import Job, prepare_environment, run_job
from ckptctl.pipeline.verification import check_offers, check_weights
from ckptctl.progress import Reporter


@dataclass
class SaveMetasOptions:
    checkpoint_path: str
    metas_file: str
    checkpoint_name: str = "my-checkpoint-iter-0"
    split: str = "auto"
    sleep_time: float | None = None  # None: until SIGTERM/SIGINT
    timeout: float = 600.0
    register_mode: str = "direct"
    read_threads: int | None = None
    verbose: bool = False


def run_save_metas(
    opts: SaveMetasOptions, reporter: Reporter, *, debug: bool = False
) -> dict[str, Any]:
    from ckptctl.pipeline.parameter_server import p2p_missing

    launch = prepare_environment()
    missing = p2p_missing()

    early = stages.EarlyShare(
        opts.checkpoint_path, opts.split, launch, opts.register_mode, opts.read_threads, reporter
    )

    def body(job: Job) -> dict[str, Any]:
        checkpoint, plan, share = stages.plan_share(job, opts.checkpoint_path, opts.split, early)
        reader = early.reader
        session = stages.start_parameter_server(job, p2p="optional" if missing is None else "off")
        stages.register_share(
            job, session, opts.checkpoint_name, checkpoint, share, opts.register_mode, reader
        )
        stages.build_group(job, session)
        stages.gather_metas(job, session, opts.checkpoint_name, reader)
        stages.save_metas(job, session, opts.metas_file, opts.checkpoint_name)
        ranks = job.gather_figures(job.figures())
        ended = stages.hold_for_joiners(job, opts.sleep_time)
        session.unregister(opts.checkpoint_name)
        job.reporter.log(f"unregistered {opts.checkpoint_name} ({ended})")
        return {
            "ok": True,
            "metas_file": opts.metas_file,
            "checkpoint_name": opts.checkpoint_name,
            "checkpoint_path": opts.checkpoint_path,
            "split": plan.split,
            "world_size": launch.world_size,
            "total_bytes": checkpoint.total_bytes,
            "tensor_count": len(checkpoint.tensors),
            "joinable": session.p2p_enabled,
            "why_not_joinable": None if session.p2p_enabled else (missing or session.p2p_error),
            "served": ended,
            "ranks": ranks,
        }

    return run_job(launch, reporter, body, timeout=opts.timeout, verbose=opts.verbose, debug=debug)


@dataclass
class JoinOptions:
    load_metas_file: str
    checkpoint_name: str = "my-checkpoint-iter-0"
    servers: ServerTargets = field(default_factory=ServerTargets)
    allow_pickle: bool = False
    timeout: float = 600.0
    verify: bool = False  # --verify: per-engine agreement (nothing registered here to hash)
    verbose: bool = False


def check_joinable(metas: dict[int, Any], path: str) -> None:
    """checkpoint-engine's load_metas asserts a p2p address and RDMA device on every entry."""
    bare = sorted(r for r, m in metas.items() if not m.p2p_store_addr or not m.rdma_device)
    if not metas or bare:
        raise InvalidInput(
            f"{path}: the metas carry no p2p store address for rank(s) {bare or 'any'}: the "
            "holder ran without mooncake/RDMA, so nothing can be pulled from it; "
            "use `ckptctl update` from the checkpoint files instead"
        )


def run_join(opts: JoinOptions, reporter: Reporter, *, debug: bool = False) -> dict[str, Any]:
    from ckptctl.metas import read_metas_file
    from ckptctl.pipeline.parameter_server import p2p_missing

    # Everything that can be refused is refused before the server is touched.
    metas_file = read_metas_file(opts.load_metas_file, allow_pickle=opts.allow_pickle)
    check_joinable(metas_file.metas, opts.load_metas_file)
    missing = p2p_missing()
    if missing:
        raise InvalidInput(f"join pulls weights over p2p, which cannot start here: {missing}")
    launch = prepare_environment()
    servers = opts.servers
    assignment = servers.assign(launch)

    def body(job: Job) -> dict[str, Any]:
        session = stages.start_parameter_server(job, p2p="required")
        stages.wait_for_server(job, assignment, servers.engine)
        verification = None
        if opts.verify:
            verification = check_offers(job, assignment, round_trip=False, hashes_available=False)
        stages.build_group(job, session)
        stages.gather_metas(job, session, opts.checkpoint_name)  # our own pool is empty
        session.load_metas(metas_file.metas)
        request = stages.ServerRequest(
            assignment,
            servers,
            job.watchdog,
            timeout=opts.timeout,
            transfer_finished=session.wait_transfer_finished,
        )
        nbytes = sum(
            meta_list.size
            for entry in metas_file.metas.values()
            for meta_list in entry.memory_buffer_metas_list
        )
        stages.push(
            job,
            session,
            opts.checkpoint_name,
            request,
            broadcast=False,
            p2p_ranks=list(range(servers.parallel_size)),
            nbytes=nbytes,
        )
        if servers.weight_version is not None:
            stages.verify_weight_version(job, assignment, servers.engine, servers.weight_version)
        verified = check_weights(job, assignment, verification) if verification else None
        return {
            "ok": True,
            "metas_file": opts.load_metas_file,
            "checkpoint_name": opts.checkpoint_name,
            "verified": verified["how"] if verified else None,
            "verification": verified,
            "world_size": launch.world_size,
            "ranks": job.gather_figures(job.figures(group=assignment.group)),
        }

    return run_job(launch, reporter, body, timeout=opts.timeout, verbose=opts.verbose, debug=debug)

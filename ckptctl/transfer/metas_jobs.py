"""`save-metas` (hold a registered checkpoint for joiners) and `join` (pull it over p2p).

save-metas: the transfer's first half (sequence.py, no server): split → register → gather →
write the metas file (rank 0); then hold until `--sleep-time` runs out or SIGTERM/SIGINT. The file is joinable only where
checkpoint-engine's p2p store (mooncake + RDMA) runs; otherwise it says so.

join: every refusal before the server is touched; then the transfer (sequence.py) with the
holders' metas in place of a registration here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptctl.errors import InvalidInput
from ckptctl.job.runner import Job, prepare_environment, run_job
from ckptctl.progress import Reporter
from ckptctl.settings import P2P
from ckptctl.transfer import registration, stages
from ckptctl.transfer.request import TransferRequest, check_join_p2p
from ckptctl.transfer.sequence import Transfer


@dataclass
class SaveMetasOptions:
    request: TransferRequest  # the checkpoint, its name, split and register mode
    metas_file: str
    sleep_time: float | None = None  # None: until SIGTERM/SIGINT
    verbose: bool = False


def run_save_metas(
    opts: SaveMetasOptions, reporter: Reporter, *, debug: bool = False
) -> dict[str, Any]:
    from ckptctl.ce import p2p_missing

    req = opts.request
    assert req.checkpoint_path is not None
    launch = prepare_environment()
    missing = p2p_missing()
    p2p = P2P.optional if missing is None else P2P.off
    early = stages.EarlyShare(
        req.checkpoint_path, req.split, launch, req.register_mode, req.read_threads, reporter
    )

    def body(job: Job) -> dict[str, Any]:
        way = registration.for_request(req, early)
        t = Transfer(job, req, None, way, p2p=p2p, save_metas_file=opts.metas_file).run()
        assert t.checkpoint is not None and t.plan is not None and t.session is not None
        session = t.session
        ranks = job.gather_figures(job.figures())
        ended = stages.hold_for_joiners(job, opts.sleep_time)
        session.unregister(req.checkpoint_name)
        job.reporter.log(f"unregistered {req.checkpoint_name} ({ended})")
        return {
            "ok": True,
            "metas_file": opts.metas_file,
            "checkpoint_name": req.checkpoint_name,
            "checkpoint_path": req.checkpoint_path,
            "split": t.plan.split,
            "world_size": launch.world_size,
            "total_bytes": t.checkpoint.total_bytes,
            "tensor_count": len(t.checkpoint.tensors),
            "joinable": session.p2p_enabled,
            "why_not_joinable": None if session.p2p_enabled else (missing or session.p2p_error),
            "served": ended,
            "ranks": ranks,
        }

    return run_job(launch, reporter, body, timeout=req.timeout, verbose=opts.verbose, debug=debug)


@dataclass
class JoinOptions:
    load_metas_file: str
    request: TransferRequest  # its update method is p2p; no checkpoint path
    allow_pickle: bool = False
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
    from ckptctl.ce import p2p_missing
    from ckptctl.metas import read_metas_file

    # Everything that can be refused is refused before the server is touched.
    metas_file = read_metas_file(opts.load_metas_file, allow_pickle=opts.allow_pickle)
    check_joinable(metas_file.metas, opts.load_metas_file)
    check_join_p2p(p2p_missing())
    launch = prepare_environment()
    req = opts.request
    assignment = req.servers.assign(launch)

    def body(job: Job) -> dict[str, Any]:
        # Our own pool stays empty: gather_metas gathers nothing, load_metas brings theirs.
        way = registration.FromMetas(metas_file.metas)
        t = Transfer(job, req, assignment, way, p2p=P2P.required).run()
        return {
            "ok": True,
            "metas_file": opts.load_metas_file,
            "checkpoint_name": req.checkpoint_name,
            **t.verified_fields(),
            "world_size": launch.world_size,
            "ranks": job.gather_figures(job.figures(group=assignment.group)),
        }

    return run_job(launch, reporter, body, timeout=req.timeout, verbose=opts.verbose, debug=debug)

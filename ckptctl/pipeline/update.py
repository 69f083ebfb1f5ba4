"""`update`: split → register → wait for the server → gather metas → update → verify.

Every rank of the torchrun job runs `run_update`. Registration comes before waiting for the
server, so loading the checkpoint overlaps the server's own start-up (`--load-format dummy`).
Every wait is bounded by the watchdog (see coordination.py); every failure ends every rank.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from ckptctl.errors import InvalidInput, UsageError
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


def check_consume(checkpoint_path: str, register_mode: str, split: str) -> str:
    """--consume-shm-files: only files in /dev/shm, and only whole files per rank."""
    if register_mode != "consume":
        return split
    real = os.path.realpath(checkpoint_path)
    if not real.startswith("/dev/shm/"):
        raise UsageError(
            f"--consume-shm-files pins and deletes files under /dev/shm only; {checkpoint_path} "
            "is not there (drop the flag to leave the files alone)"
        )
    if split == "tensors":
        raise UsageError("--consume-shm-files registers whole files: use --split files (or auto)")
    return "files"


def check_consumable_together(job: Job, plan: Any) -> None:
    """--consume-shm-files: every rank checks the whole plan, and only once all of them have
    does any rank consume (pin and delete) a file. A rank that went ahead deleted files that
    another rank was still checking (seen on 2x H200: rank 0 failed with FileNotFoundError)."""
    check_consumable(plan)
    job.barrier("consume-checked")


SHM = "/dev/shm"


def check_in_shm(path: str) -> None:
    """Refuse (exit 3) a file that --consume-shm-files must not delete: one that is a symbolic
    link, or does not really live under /dev/shm (a folder on its way there is a symlink to
    elsewhere: checkpoint-engine would pin and delete the file where it really is), or whose
    way there someone else could change before checkpoint-engine opens it: the file and every
    folder below /dev/shm must be ours (folders may be root's)."""
    drop = "--consume-shm-files deletes the files it pins: drop the flag, or copy the files there"
    if os.path.islink(path):
        raise InvalidInput(f"{path}: is a symbolic link, not a file under {SHM}; {drop}")
    shm = os.path.realpath(SHM)
    real = os.path.realpath(path)
    if not real.startswith(shm + "/"):
        raise InvalidInput(
            f"{path}: really lives at {real}, outside {SHM} (a folder on the way is a symbolic "
            f"link); {drop}"
        )
    uid = os.getuid()
    try:
        if os.lstat(real).st_uid != uid:
            raise InvalidInput(f"{path}: belongs to another user; {drop}")
        folder = os.path.dirname(real)
        while folder != shm:
            st = os.lstat(folder)
            if st.st_uid not in (uid, 0):
                raise InvalidInput(
                    f"{path}: its folder {folder} belongs to another user, who could swap the "
                    f"file before it is consumed; {drop}"
                )
            if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
                # (mkdir under umask 000): anyone may rename what is in it, a subfolder for a
                # symlink to elsewhere, between this check and checkpoint-engine's os.remove.
                raise InvalidInput(
                    f"{path}: its folder {folder} is writable by other users (mode "
                    f"{stat.S_IMODE(st.st_mode):o}), who could swap what is in it before it is "
                    f"consumed: chmod go-w it; {drop}"
                )
            folder = os.path.dirname(folder)
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot be checked ({exc.strerror or exc})") from None


def check_consumable(plan: Any) -> None:
    """Refuse, before any file is consumed, a checkpoint that checkpoint-engine's in-place
    pinning cannot serve, or files it must not delete (`check_in_shm`). Every rank checks every
    rank's share, so all refuse together.

    It pins each file's data area as is and asserts the tensors tile it with no gap (a file
    that fails that would be refused halfway, after other files were deleted). The update then
    packs a rank's tensors back to back, unpadded, into buckets that may start at any tensor,
    and the server views each tensor at its offset as its dtype, which fails unless the offset
    is a multiple of the element size. So every tensor before a tensor in its share must have
    a size that is a multiple of that tensor's element size (a 0-dim bf16 before an int64 is
    not).
    """
    from ckptctl.checkpoint.headers import DTYPE_BITS, open_planned

    checkpoint = plan.checkpoint
    for file in checkpoint.files:
        check_in_shm(str(checkpoint.path_of(file)))
    known = _in_place_dtypes()
    for t in checkpoint.tensors:
        if known is not None and t.dtype not in known:
            raise InvalidInput(
                f"{checkpoint.path_of(t.file)}: tensor {t.name!r} is {t.dtype}, which "
                "checkpoint-engine's in-place pinning cannot read: drop --consume-shm-files"
            )
    widest = max((max(DTYPE_BITS[t.dtype] // 8, 1) for t in checkpoint.tensors), default=1)
    largest = max(checkpoint.tensors, key=lambda t: t.nbytes, default=None)
    if largest is not None and largest.nbytes % widest:
        # A tensor larger than the bucket cap sets the bucket size, and the second half of
        # the double buffer starts at that offset: it must keep every dtype aligned.
        raise InvalidInput(
            f"{checkpoint.path_of(largest.file)}: the largest tensor {largest.name!r} "
            f"({largest.nbytes} bytes) is not a multiple of {widest} bytes, which in-place "
            "pinning's buffers would need: drop --consume-shm-files"
        )
    in_file: dict[str, list[Any]] = {f: [] for f in checkpoint.files}
    for t in checkpoint.tensors:  # (in read order: file, then offset)
        in_file[t.file].append(t)
    for file, tensors in in_file.items():
        path = checkpoint.path_of(file)
        fd = open_planned(checkpoint, file)  # still the file that was planned, else exit 3
        try:
            at = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")  # where the data area starts
            size = os.fstat(fd).st_size
        except OSError as exc:
            raise InvalidInput(f"{path}: cannot be read ({exc.strerror or exc})") from None
        finally:
            os.close(fd)
        for t in tensors:
            if t.start != at:
                raise InvalidInput(
                    f"{path}: {t.start - at} bytes between tensor {t.name!r} and the one before; "
                    "checkpoint-engine's in-place pinning needs tightly packed files: drop "
                    "--consume-shm-files"
                )
            at = t.end
        if at != size:
            raise InvalidInput(
                f"{path}: {size - at} bytes after the last tensor; "
                "checkpoint-engine's in-place pinning needs tightly packed files: drop "
                "--consume-shm-files"
            )
    for share in plan.ranks:
        common = 0  # gcd of the sizes of the tensors so far in this share
        for t in share.tensors:
            width = max(DTYPE_BITS[t.dtype] // 8, 1)
            if common % width:
                raise InvalidInput(
                    f"{checkpoint.path_of(t.file)}: tensor {t.name!r} ({t.dtype}) would lose its "
                    f"{width}-byte alignment in checkpoint-engine's unpadded in-place layout "
                    "(a smaller tensor before it leaves it off), and the server could not read "
                    "it: drop --consume-shm-files"
                )
            common = math.gcd(common, t.nbytes)


def _in_place_dtypes() -> set[str] | None:
    """The safetensors dtypes checkpoint-engine's in-place pinning can read (it looks them up
    in safetensors' own table), or None when that table is not where it used to be."""
    try:
        from safetensors.torch import _TYPES
    except ImportError:
        return None
    return set(_TYPES)


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
            stages.serve(job, opts.sleep_time)  # the seed's --sleep-time: stay up for joiners
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

"""The real serve job: a ParameterServer per rank, kept up between pushes."""

from __future__ import annotations

from typing import Any

from ckptctl.job.coordination import Coordinator
from ckptctl.job.runner import Job
from ckptctl.serve.control import check_socket_path, default_socket_path, job_targets
from ckptctl.serve.loop import serve_loop
from ckptctl.serve.push import HARD_GRACE_S, gpu_executor
from ckptctl.serve.state import ServeOptions, ServeState
from ckptctl.settings import P2P, RegisterMode, Setting
from ckptctl.transfer.pausing import ServerPauses


def run_serve(opts: ServeOptions, reporter: Any, *, debug: bool = False) -> dict[str, Any]:
    from ckptctl.job.runner import prepare_environment, run_job
    from ckptctl.transfer import stages

    launch = prepare_environment(bucket_size_gb=opts.bucket_size_gb, mem_fraction=opts.mem_fraction)
    servers = opts.request.servers
    assignment = servers.assign(launch)
    targets = job_targets(servers.endpoints, servers.uds)
    control_socket = opts.control_socket
    if launch.local_rank == 0:
        # Refuse a socket path we could not use now, not after a minute of start-up.
        control_socket = control_socket or default_socket_path(targets)
        check_socket_path(control_socket)
    state = ServeState()
    metrics = None
    if opts.metrics is not None and launch.rank == 0:  # (bound before the long start-up)
        from ckptctl.observe import metrics as observe_metrics

        metrics = observe_metrics.start(*opts.metrics)

    def body(job: Job) -> dict[str, Any]:
        if job.coordinator is None:  # one process: a store of our own for the rendezvous
            job.coordinator = Coordinator.local(job.launch)
            job.watchdog.coordinator = job.coordinator
        # A push's collectives may wait until its watchdog ends the job (push.py).
        session = stages.start_parameter_server(
            job, p2p=P2P.off, longest_wait_s=opts.push_timeout + HARD_GRACE_S
        )
        # The NCCL group now, not at the first push: a job that cannot build it fails at
        # start-up instead of failing every push.
        stages.build_group(job, session)
        state.pauses = ServerPauses.attach(
            job, servers, default=opts.request.pause, resume_in_transfer=False
        )
        if opts.request.register_mode is RegisterMode.direct:
            from ckptctl.transfer.host_memory import PinnedPool

            state.pool = PinnedPool()  # pinned once, refilled by every push
        ended = serve_loop(
            job,
            gpu_executor(opts, session, assignment, state),
            control_socket=control_socket,
            push_timeout=opts.push_timeout,
            state=state,
            targets=targets,
            restore=opts.restore,
            metrics=metrics,
        )
        if state.staged is not None:  # read ahead for a push that never came: stop its read
            # (not waited for: the job ends, and the pool's close keeps its memory mapped)
            state.staged.reader.progress.stop()
            state.staged = None
        if state.registered is not None:
            session.unregister(state.registered, state.pool)
        if state.pool is not None:
            state.pool.close()
        return {"ok": True, "ended": ended, "world_size": launch.world_size}

    try:
        # (Until it serves, the job's start is bounded by --push-timeout too.)
        return run_job(
            launch, reporter, body, timeout=opts.push_timeout,
            timeout_setting=Setting.push_timeout, verbose=opts.verbose, debug=debug,
        )  # fmt: skip
    finally:
        if metrics is not None:
            metrics.close()

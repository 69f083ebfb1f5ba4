"""One rank of a real torchrun `serve` job on CPU (run by test_serve.py): the real command
queue, control endpoint and scoped stages, with the GPU part of a push (register, update)
left out - each push plans the checkpoint for real and meets the other ranks."""

from __future__ import annotations

import sys

from ckptctl.launch import launch_info
from ckptctl.pipeline import stages
from ckptctl.pipeline.coordination import Coordinator, Watchdog
from ckptctl.pipeline.job import Job
from ckptctl.pipeline.serve import serve_loop
from ckptctl.progress import Reporter


def execute(job: Job, command: dict) -> dict:
    _, plan, share = stages.plan_share(job, command["checkpoint_path"], "auto")
    if command.get("checkpoint_name") == "boom" and job.launch.rank == 1:
        raise RuntimeError("injected: not one of ckptctl's errors")  # as checkpoint-engine's
    assert job.coordinator is not None
    job.coordinator.barrier("pushed", timeout_s=30)  # stands in for the collective update
    return {"checkpoint_name": command.get("checkpoint_name"), "tensors": len(share.tensors)}


def main(control_socket: str) -> None:
    launch = launch_info()
    coordinator = Coordinator.connect(launch, timeout_s=30) or Coordinator.local(launch)
    watchdog = Watchdog(launch, coordinator, timeout_s=60).start()
    job = Job(launch, coordinator, watchdog, Reporter(print, primary=launch.rank == 0))
    ended = serve_loop(job, execute, control_socket=control_socket, push_timeout=30, state={})
    print(f"rank {launch.rank}: {ended}", flush=True)
    watchdog.stop()


if __name__ == "__main__":
    main(sys.argv[1])

"""One rank of a real torchrun `serve` job on CPU (run by test_serve*.py): the real command
channel, control socket and scoped stages, with the GPU part of a push (register, update)
left out - each push plans the checkpoint for real and meets the other ranks.

    torchrun ... tests/support/serve_rank.py CONTROL_SOCKET

SERVE_RANK_LOG=F: each rank appends one line per push it runs to F.<rank> (what it ran);
SERVE_RANK_PIDS=DIR: each rank writes its pid to DIR/<rank> (to signal one rank).

A push named "boom" fails on rank 1 with a plain exception (as checkpoint-engine's); one named
"unmerged" fails where every rank merges the results, after the push (a bug of the loop's).
"""

from __future__ import annotations

import json
import os
import sys

from ckptctl.job.coordination import Coordinator, Watchdog
from ckptctl.job.runner import Job
from ckptctl.launch import launch_info
from ckptctl.progress import Reporter
from ckptctl.serve.commands import ServeCommand
from ckptctl.serve.loop import serve_loop
from ckptctl.transfer import stages


def execute(job: Job, command: ServeCommand) -> dict:
    log = os.environ.get("SERVE_RANK_LOG")
    if log:
        with open(f"{log}.{job.launch.rank}", "a") as fh:
            fh.write(
                json.dumps({"seq": command.seq, "checkpoint_name": command.checkpoint_name}) + "\n"
            )
    # (every rank's plan compared over the job's group: the command's one exchange)
    _, plan, share = stages.plan_share(job, command.checkpoint_path, "auto")
    if command.checkpoint_name == "boom" and job.launch.rank == 1:
        raise RuntimeError("injected: not one of ckptctl's errors")  # as checkpoint-engine's
    job.barrier("pushed")  # stands in for the collective update
    return {"checkpoint_name": command.checkpoint_name, "tensors": len(share.tensors)}


def main(control_socket: str) -> None:
    import ckptctl.serve.loop as loop_module

    merge_results = loop_module.merge_results

    def failing_merge(command: ServeCommand, ranks: list) -> dict:
        if command.checkpoint_name == "unmerged":
            raise RuntimeError("injected: the loop's own bookkeeping failed")
        return merge_results(command, ranks)

    loop_module.merge_results = failing_merge  # type: ignore[assignment]
    launch = launch_info()
    pids = os.environ.get("SERVE_RANK_PIDS")
    if pids:
        with open(os.path.join(pids, str(launch.rank)), "w") as fh:
            fh.write(str(os.getpid()))
    coordinator = Coordinator.connect(launch, timeout_s=30) or Coordinator.local(launch)
    watchdog = Watchdog(launch, coordinator, timeout_s=60).start()
    job = Job(launch, coordinator, watchdog, Reporter(print, primary=launch.rank == 0))
    ended = serve_loop(job, execute, control_socket=control_socket, push_timeout=30)
    print(f"rank {launch.rank}: {ended}", flush=True)
    watchdog.stop()


if __name__ == "__main__":
    main(sys.argv[1])

"""One rank of a real torchrun job exercising ckptctl's coordination (run by test_coordination.py).

The main thread blocks the way checkpoint-engine's does (waiting on a peer that never comes);
the watchdog must end every rank with the right code and message.
"""

from __future__ import annotations

import json
import os
import sys
import time

from ckptctl.errors import InvalidInput
from ckptctl.launch import launch_info
from ckptctl.pipeline.coordination import Coordinator, Watchdog


def main(scenario: str) -> None:
    launch = launch_info()
    coordinator = Coordinator.connect(launch, timeout_s=30)
    assert coordinator is not None
    timeout = 3.0 if scenario == "timeout" else 60.0
    watchdog = Watchdog(
        launch,
        coordinator,
        timeout_s=timeout,
        stale_after_s=3.0,
        describe_stage=lambda: "the test stage",
    ).start()
    if scenario == "figures":
        coordinator.publish("figures", {"rank": launch.rank, "pid": os.getpid()})
        if launch.rank == 0:
            docs = coordinator.collect("figures", timeout_s=20)
            print(json.dumps([d["rank"] for d in docs]), flush=True)
        watchdog.stop()
        return
    if scenario == "plan":
        # Each rank plans on "its node's copy" of the checkpoint: argv[2] for rank 0, argv[3]
        # for the others. run_job publishes the failure, so every rank ends with rank 0's code.
        from ckptctl.checkpoint import plan_split, read_checkpoint
        from ckptctl.pipeline.job import Job
        from ckptctl.pipeline.stages import check_same_plan
        from ckptctl.progress import Reporter

        watchdog.stop()
        path = sys.argv[2] if launch.rank == 0 else sys.argv[3]
        watchdog = Watchdog(launch, coordinator, timeout_s=60).start()
        job = Job(launch, coordinator, watchdog, Reporter(print, primary=launch.rank == 0))
        plan = plan_split(read_checkpoint(path), launch.world_size, "files")
        try:
            check_same_plan(job, plan, path)
        except InvalidInput as exc:
            coordinator.publish_abort(3, str(exc))
            watchdog.fail(3, str(exc))
        time.sleep(2)  # long enough to see an abort published by rank 0
        watchdog.stop()
        print("plans agree", flush=True)
        return
    if scenario == "barrier":
        # Rank 0 (the group leader waiting for a slow server) arrives 3 s late; the others
        # wait at the barrier, with heartbeats going on (stale after 3 s would fire otherwise).
        if launch.rank == 0:
            time.sleep(3.0)
        t0 = time.monotonic()
        coordinator.barrier("servers-up", timeout_s=30)
        print(
            f"rank {launch.rank} passed the barrier after {time.monotonic() - t0:.1f}s", flush=True
        )
        time.sleep(1.0)
        watchdog.stop()
        return
    if scenario == "serve":
        # save-metas' serving phase: the test signals rank 1 only; every rank must stop cleanly.
        from ckptctl.pipeline.job import Job
        from ckptctl.pipeline.stages import serve
        from ckptctl.progress import Reporter

        job = Job(launch, coordinator, watchdog, Reporter(print, primary=launch.rank == 0))
        print(f"rank {launch.rank} pid {os.getpid()} serving", flush=True)
        ended = serve(job, None)
        print(f"rank {launch.rank}: {ended}", flush=True)
        watchdog.stop()
        return
    if scenario == "fail" and launch.rank == 1:
        time.sleep(1.0)
        watchdog.fail(1, "the server refused the update: HTTP 400: boom")
    if scenario == "die" and launch.rank == 1:
        time.sleep(1.0)
        os._exit(9)  # no goodbye, like a segfault or the OOM killer
    time.sleep(3600)  # stands in for a rank stuck in an NCCL collective


if __name__ == "__main__":
    main(sys.argv[1])

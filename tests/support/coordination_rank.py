"""One rank of a real torchrun job exercising ckptctl's coordination (run by test_coordination.py).

The main thread blocks the way checkpoint-engine's does (waiting on a peer that never comes);
the watchdog must end every rank with the right code and message.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from ckptctl.errors import InvalidInput
from ckptctl.job.coordination import Coordinator, Watchdog
from ckptctl.launch import launch_info


def say(line: str) -> None:
    """One line on stdout in one write (the job's Reporter writes through it too): the ranks,
    and each rank's threads, share the pipe, unbuffered under torchrun, so a print's text and
    its newline could be split by another's line, which would then match nothing."""
    os.write(1, (line + "\n").encode())


def wait_for_key(coordinator: Coordinator, key: str, timeout_s: float = 60) -> None:
    """Wait until some rank has set `key` in the job's store (an event, not a delay)."""
    deadline = time.monotonic() + timeout_s
    while not coordinator.store.check([key]):
        if time.monotonic() > deadline:
            raise SystemExit(f"rank never saw {key!r} in the store")
        time.sleep(0.05)


def main(scenario: str) -> None:
    launch = launch_info()
    coordinator = Coordinator.connect(launch, timeout_s=30)
    assert coordinator is not None
    # Every rank is up before any watchdog starts: heartbeats go stale after 3 s here, and on
    # a busy machine one rank may take longer than that to import torch than another.
    coordinator.barrier("started", timeout_s=60)
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
            say(json.dumps([d["rank"] for d in docs]))
        watchdog.stop()
        return
    if scenario == "plan":
        # Each rank plans on "its node's copy" of the checkpoint: argv[2] for rank 0, argv[3]
        # for the others. run_job publishes the failure, so every rank ends with rank 0's code.
        from ckptctl.checkpoint import plan_split, read_checkpoint
        from ckptctl.job.runner import Job
        from ckptctl.progress import Reporter
        from ckptctl.transfer.stages import check_same_plan

        watchdog.stop()
        path = sys.argv[2] if launch.rank == 0 else sys.argv[3]
        watchdog = Watchdog(launch, coordinator, timeout_s=60).start()
        job = Job(launch, coordinator, watchdog, Reporter(say, primary=launch.rank == 0))
        plan = plan_split(read_checkpoint(path), launch.world_size, "files")
        try:
            check_same_plan(job, plan, path)
        except InvalidInput as exc:
            coordinator.publish_abort(3, str(exc))
            watchdog.fail(3, str(exc))
            time.sleep(3600)  # the watchdog ends this rank
        # Rank 0 has compared every plan once it is here too: only then do the others go on
        # (or their watchdogs end them with rank 0's abort).
        coordinator.barrier("plans-checked", timeout_s=60)
        watchdog.stop()
        say("plans agree")
        return
    if scenario == "barrier":
        # Rank 0 (the group leader waiting for a slow server) arrives late: once every other
        # rank is in the barrier, and longer after that than a heartbeat may be missing (3 s
        # here). The others wait with their heartbeats going on, or rank 0 would take them
        # for dead.
        others = [f"servers-up/{r}" for r in range(1, launch.world_size)]
        if launch.rank == 0:
            for key in others:
                wait_for_key(coordinator, key)  # (set by each rank as it enters the barrier)
            time.sleep(4.0)
            coordinator.store.set("rank-0-arrives", "1")
        coordinator.barrier("servers-up", timeout_s=60)
        late = coordinator.store.check(["rank-0-arrives"])
        say(f"rank {launch.rank} passed the barrier, rank 0 late: {late}")
        coordinator.barrier("done", timeout_s=60)  # nobody leaves while others still check
        watchdog.stop()
        return
    if scenario == "serve":
        # save-metas' serving phase: the test signals one rank, or every rank.
        from ckptctl.job.coordination import StoppedByPeer
        from ckptctl.job.runner import Job
        from ckptctl.progress import Reporter
        from ckptctl.transfer.stages import hold_for_joiners

        job = Job(launch, coordinator, watchdog, Reporter(say, primary=launch.rank == 0))

        def announce() -> None:
            # Once hold_for_joiners() has taken over the signals: a SIGTERM from now on stops it cleanly.
            while job.watchdog.on_signal is None:
                time.sleep(0.01)
            say(f"rank {launch.rank} pid {os.getpid()} serving")

        threading.Thread(target=announce, daemon=True).start()
        try:
            ended = hold_for_joiners(job, None)
        except StoppedByPeer as exc:  # (the CLI prints it as an error line, exit 130)
            say(f"rank {launch.rank}: interrupted: {exc}")
            watchdog.stop()
            sys.exit(exc.exit_code)
        say(f"rank {launch.rank}: {ended}")
        watchdog.stop()
        return
    if scenario in ("fail", "die") and launch.rank == 1:
        wait_for_key(coordinator, "stuck/0")  # rank 0 is stuck: now rank 1 goes wrong
        if scenario == "fail":
            watchdog.fail(1, "the server refused the update: HTTP 400: boom")
        else:
            os._exit(9)  # no goodbye, like a segfault or the OOM killer
    coordinator.store.set(f"stuck/{launch.rank}", "1")
    time.sleep(3600)  # stands in for a rank stuck in an NCCL collective


if __name__ == "__main__":
    main(sys.argv[1])

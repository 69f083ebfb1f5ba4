"""The process group built in the background (process_group.py), on CPU with gloo: the ranks of
a real torchrun job meet through the job's store, a missing rank is a bounded, reported wait,
and a process whose group is still being built leaves without hanging."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from fake_server import run_torchrun

REPO = Path(__file__).resolve().parent.parent

TWO_RANKS = r"""
import json, os, time
import torch, torch.distributed as dist
from ckptctl.launch import launch_info
from ckptctl.job.coordination import Coordinator
from ckptctl.job.process_group import BackgroundProcessGroup

launch = launch_info()
coordinator = Coordinator.connect(launch, timeout_s=30)
if launch.rank == 1:
    # Rank 1 starts building only once rank 0's constructor has returned: a constructor
    # that waited for its peers would never return, and this wait would fail.
    deadline = time.monotonic() + 60
    while not coordinator.store.check(["rank-0-constructed"]):
        assert time.monotonic() < deadline, "rank 0's constructor waited for its peers"
        time.sleep(0.02)
# On a store client of its own, as stages.py builds it: a client serves one call at a time,
# and the rendezvous blocks in it until every rank joins - on the shared client, rank 0's `set`
# below would wait behind it for rank 1, which waits for that `set`.
group = BackgroundProcessGroup(rank=launch.rank, world_size=launch.world_size,
                               store=coordinator.second_connection(), backend="gloo")
if launch.rank == 0:
    coordinator.store.set("rank-0-constructed", "1")
group.wait(60)
value = torch.tensor([launch.rank + 1.0])
dist.all_reduce(value)  # the default group: what checkpoint-engine's collectives use
doc = {"rank": launch.rank, "sum": value.item(), "world": dist.get_world_size()}
os.write(1, (json.dumps(doc) + "\n").encode())  # one write: the ranks share the pipe
# As the CLI ends a GPU job: a group built off the main thread can abort an interpreter
# shutdown ("terminate called without an active exception", seen with gloo here).
from ckptctl import results
results.leave_group_to_exit(0)
"""


def test_the_ranks_of_a_torchrun_job_meet_in_the_default_group(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(TWO_RANKS)
    r = run_torchrun(str(script), nproc=2, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    docs = sorted((json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")),
                  key=lambda d: d["rank"])  # fmt: skip
    assert [d["rank"] for d in docs] == [0, 1]
    assert all(d["sum"] == 3.0 and d["world"] == 2 for d in docs)


def _run(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_the_collective_timeout_outlasts_the_jobs_own_bound() -> None:
    """Issue 23 item 6: NCCL aborts the process (SIGABRT) when a collective outlasts its
    timeout, so a serve job of --push-timeout 900 must not keep checkpoint-engine's 10 min."""
    from ckptctl.job.process_group import MIN_TIMEOUT_S, TIMEOUT_GRACE_S, group_timeout_s

    assert group_timeout_s(None) == group_timeout_s(float("inf")) == MIN_TIMEOUT_S == 600
    assert group_timeout_s(60) == MIN_TIMEOUT_S  # never shorter than checkpoint-engine's
    assert group_timeout_s(930) == 930 + TIMEOUT_GRACE_S > 930
    assert group_timeout_s(MIN_TIMEOUT_S) > MIN_TIMEOUT_S


def test_the_group_is_built_with_the_timeout_it_is_given() -> None:
    r = _run("""
        import torch, torch.distributed as dist
        from ckptctl import results
        from ckptctl.job.process_group import BackgroundProcessGroup
        g = BackgroundProcessGroup(rank=0, world_size=1, store=None, backend="gloo",
                                   timeout_s=1234)
        g.wait(30)
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        print(backend.options._timeout.total_seconds())
        results.leave_group_to_exit(0)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1234.0"]


def test_a_job_of_one_process_needs_no_store() -> None:
    r = _run("""
        import torch.distributed as dist
        from ckptctl import results
        from ckptctl.job.process_group import BackgroundProcessGroup
        g = BackgroundProcessGroup(rank=0, world_size=1, store=None, backend="gloo")
        g.wait(30)
        print(dist.is_initialized(), dist.get_world_size())
        # As every job ends: an interpreter shutdown under gloo's threads can abort
        # ("terminate called without an active exception", seen once on a busy 2-core VM).
        results.leave_group_to_exit(0)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "1"]


def test_a_rank_that_never_comes_is_a_bounded_wait_and_the_process_still_leaves() -> None:
    """Rank 1 never joins: `wait` gives up with the timeout error (exit code 4 in the CLI),
    and leave_group_to_exit ends the process although the builder thread is still stuck in
    the rendezvous (an interpreter shutdown under it could hang)."""
    r = _run("""
        from torch.distributed import TCPStore
        from ckptctl import results
        from ckptctl.errors import DeadlineExceeded
        from ckptctl.job.process_group import BackgroundProcessGroup
        # Port 0: the store binds a free port itself (a port found free and bound later
        # could be taken meanwhile by a test running beside this one).
        store = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        g = BackgroundProcessGroup(rank=0, world_size=2, store=store, backend="gloo")
        try:
            g.wait(1.0)
        except DeadlineExceeded as exc:
            print("timeout:", exc, flush=True)
            results.leave_group_to_exit(int(exc.exit_code))
        print("still here", flush=True)
    """)
    assert r.returncode == 4, r.stderr
    assert "did not come up in time" in r.stdout
    assert "still here" not in r.stdout


def test_a_failed_build_is_raised_on_the_waiting_thread() -> None:
    r = _run("""
        from ckptctl.errors import OperationFailed
        from ckptctl.job.process_group import BackgroundProcessGroup
        g = BackgroundProcessGroup(rank=0, world_size=1, store=None, backend="no-such-backend")
        try:
            g.wait(30)
        except OperationFailed as exc:
            print("failed:", exc, flush=True)
            from ckptctl import results
            # A build that failed may still have left NCCL's threads: leave without the
            # interpreter's shutdown, as after a successful build.
            results.leave_group_to_exit(7)
        print("still here", flush=True)
    """)
    assert r.returncode == 7, r.stderr  # raised at once: a wait that ran out would say 4
    assert "still here" not in r.stdout
    assert r.stdout.startswith("failed: could not build the NCCL process group")


ONE_FAILS_FIRST = r"""
import sys
from ckptctl import results
from ckptctl.errors import CkptctlError, InvalidInput, print_error
from ckptctl.launch import launch_info
from ckptctl.job.runner import run_job
from ckptctl.job.process_group import BackgroundProcessGroup
from ckptctl.progress import Reporter

launch = launch_info()

def body(job):
    if launch.rank == 0:
        raise InvalidInput("rank 0 refuses before building the group")
    # What ParameterServerSession does (stages.start_parameter_server passes the connection).
    group = BackgroundProcessGroup(rank=launch.rank, world_size=launch.world_size,
                                   store=job.coordinator.second_connection(), backend="gloo")
    group.wait(120)

try:
    run_job(launch, Reporter(print, primary=launch.rank == 0), body, timeout=120)
except CkptctlError as exc:
    print_error(str(exc))
    results.leave_group_to_exit(int(exc.exit_code))
    sys.exit(int(exc.exit_code))
"""


def test_a_rank_that_fails_before_the_group_ends_the_ranks_that_wait_in_it(
    tmp_path: Path,
) -> None:
    """Rank 1 sits in the group's rendezvous when rank 0 fails: its watchdog must still hear
    of the failure through the store (the rendezvous blocks a store client of its own, not
    the watchdog's) and end it with rank 0's exit code, long before --timeout."""
    script = tmp_path / "rank.py"
    script.write_text(ONE_FAILS_FIRST)
    r = run_torchrun(str(script), nproc=2, cwd=REPO)
    assert r.returncode != 0
    # Rank 1 ends with rank 0's failure and code, not with its own 120 s timeout (exit 4).
    assert "[rank 1] error: rank 0 failed: rank 0 refuses" in r.stderr, r.stderr[-3000:]
    assert "exitcode  : 3" in r.stderr or "exitcode: 3" in r.stderr, r.stderr[-3000:]
    assert "timed out" not in r.stderr


def test_a_second_connection_sees_the_same_keys_for_a_job_of_one_process() -> None:
    """serve with one process keeps a store of its own (Coordinator.local), in memory: the
    group's connection to it reaches the same keys, and a wait blocked in it (the group's
    rendezvous) does not hold up the watchdog's calls on the first."""
    import threading
    from datetime import timedelta

    from ckptctl.job.coordination import Coordinator
    from ckptctl.launch import launch_info

    coordinator = Coordinator.local(launch_info())
    other = coordinator.second_connection()
    other.set("k", "from the second connection")
    assert coordinator.store.get("k") == b"from the second connection"
    waiter = threading.Thread(target=lambda: other.wait(["late"], timedelta(seconds=60)))
    waiter.start()
    coordinator.beat()
    assert coordinator.beats(0) == 1 and coordinator.aborted() is None
    assert waiter.is_alive()  # those calls did not wait for it
    coordinator.store.set("late", "1")
    waiter.join(timeout=60)
    assert not waiter.is_alive()

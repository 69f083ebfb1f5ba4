"""Progress that is progress (issue 15, item 6): bytes done of total, rate and ETA for the
stages that move bytes; the node's ranks on rank 0's bar; quiet ranks beside rank 0 on a
terminal; a summary table that fits 80 columns; no p2p notice nobody asked for.

The sources of the byte counts are tested where they are, with real parts: direct
registration's reader on a real checkpoint, the update's socket with real zmq sockets, the
node's counters through a real TCPStore, engine registration's mapped pages on a real mapping.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until
from cpu_jobs import UPDATE_ON_CPU
from fake_server import Behaviour, FakeServer
from pty_run import run_on_pty
from rich.console import Console
from warm_launch import torchrun_cmd

from ckptctl.job.node_progress import NodeProgress, parse
from ckptctl.launch import LaunchInfo
from ckptctl.progress import ByteCounter, Reporter, RichReporter, format_bytes

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-checkpoint"


# -- the reporter ---------------------------------------------------------------------------------


def test_a_counter_made_before_its_stage_is_the_stages() -> None:
    reporter = Reporter(lambda _: None, primary=True)
    early = reporter.counter("register")
    early.add(10)  # a read that started before the stage (prefetch)
    with reporter.stage("register", "reading", nbytes=100) as st:
        assert st.done is early and st.done_bytes() == 10
        st.done.add(200)
        assert st.done_bytes() == 100  # never more than the stage's total
    with reporter.stage("register", "reading", nbytes=100) as again:  # (a second push)
        assert again.done is not early and again.done_bytes() == 0 and again.key == "register#2"


def test_a_deadline_names_the_innermost_stage_and_what_it_waits_on() -> None:
    """The watchdog's "timed out ... during X" used to name the stage alone: the wait for a
    server that never came up did not say which server, or what it last answered."""
    reporter = Reporter(lambda _: None, primary=True)
    assert reporter.describe_running() == ""
    with reporter.stage("push", "pushing"), reporter.stage("wait_server", "waiting") as st:
        assert reporter.describe_running() == "waiting"
        st.detail = "http://127.0.0.1:9: connection refused, 12s of 13s"
        assert reporter.describe_running() == (
            "waiting (http://127.0.0.1:9: connection refused, 12s of 13s)"
        )
    assert reporter.describe_running() == ""


def test_plain_progress_lines_while_bytes_move() -> None:
    lines: list[str] = []
    reporter = Reporter(lines.append, primary=True)
    reporter.TICK_S = 0.05  # (a log gets one every 10 s)
    try:
        with reporter.stage("register", "reading the share", nbytes=4_000_000) as st:
            st.done.add(1_000_000)  # (read before the stage: no rate can be had from it)
            wait_until(lambda: any("of 4.00 MB" in line for line in lines), 20, "a progress line")
            st.done.add(1_000_000)
            wait_until(lambda: any("2.00 MB of" in line for line in lines), 20, "a second line")
    finally:
        reporter.close()
    progress = [line for line in lines if "of 4.00 MB" in line]
    assert progress[0] == "reading the share: 1.00 MB of 4.00 MB"
    # The rate of a later line is that of the bytes since the line before (the first line
    # at 2 MB; a tick after it, with no new bytes, may have none).
    second = next(line for line in progress if "2.00 MB of" in line)
    assert re.fullmatch(r"reading the share: 2\.00 MB of 4\.00 MB \(\d+\.\d\d [kMG]?B/s\)", second)
    assert lines[-1].startswith("register: ")


def test_other_ranks_and_quiet_write_no_progress_lines() -> None:
    lines: list[str] = []
    for reporter in (
        Reporter(lines.append, primary=False),
        Reporter(lines.append, primary=True, quiet=True),
    ):
        reporter.TICK_S = 0.01
        with reporter.stage("register", "reading", nbytes=10) as st:
            st.done.add(5)
            time.sleep(0.1)
        reporter.close()
    assert not any(" of " in line for line in lines)


def test_the_live_view_draws_bytes_rate_and_eta() -> None:
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=80, color_system=None)
    reporter = RichReporter(console)
    try:
        with reporter.stage("register", "loading the shares", nbytes=2_000_000_000) as st:
            st.done.add(500_000_000)
            wait_until(lambda: "0.50/2.00 GB" in _frame(reporter), 20, "the bytes drawn")

            # A rate needs the counter sampled twice as it moves: feed it until it shows.
            def moving() -> bool:
                st.done.add(1_000_000)
                time.sleep(0.01)
                return "B/s" in _frame(reporter)

            wait_until(moving, 20, "a rate drawn")
            frame = _frame(reporter)
            assert re.search(r"0\.\d\d/2\.00 GB +\d+\.\d\d [kMG]B/s eta \d+:\d\d", frame), frame
            assert "━" in frame and "…" not in frame  # figures are never cut
        with reporter.stage("wait_server", "waiting for the inference server"):
            assert "GB" not in _frame(reporter)  # no byte figures for a stage without bytes
    finally:
        reporter.close()
    out = buffer.getvalue()
    assert "✓ register: " in out and "2.00 GB" in out  # a finished stage stays as a line


def _frame(reporter: RichReporter) -> str:
    """The live rows as an 80-column terminal shows them now."""
    reporter._tick()
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(reporter.progress.make_tasks_table(reporter.progress.tasks))
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_a_stage_whose_bytes_are_not_counted_shows_no_figures() -> None:
    reporter = RichReporter(Console(file=io.StringIO(), force_terminal=True, width=80))
    try:
        with reporter.stage("update", "pushing the weights", nbytes=3_000_000):
            frame = _frame(reporter)
            assert "3.00 MB" in frame and "/3.00 MB" not in frame and "eta" not in frame
    finally:
        reporter.close()


def test_a_stage_whose_bytes_are_all_done_shows_its_time_not_eta_0() -> None:
    """Every byte counted while the stage is still busy (pinning after the read, the server's
    answer after the last bucket): the row shows the time taken, not an "eta 0:00" that stays,
    and no rate."""
    reporter = RichReporter(Console(file=io.StringIO(), force_terminal=True, width=80))
    try:
        with reporter.stage("register", "loading the shares", nbytes=2_000_000) as st:
            st.done.add(1_000_000)
            wait_until(lambda: "1.00/2.00 MB" in _frame(reporter), 20, "half drawn")
            st.done.add(1_000_000)
            wait_until(lambda: "2.00/2.00 MB" in _frame(reporter), 20, "all drawn")
            frame = _frame(reporter)
            assert "eta" not in frame and "B/s" not in frame, frame
            assert re.search(r"2\.00/2\.00 MB +0:\d\d", frame), frame
    finally:
        reporter.close()


def test_background_work_is_reported_as_what_it_was() -> None:
    """A stage whose bytes were read and pinned in a thread that started before it: its own
    time is the wait, with no rate; the read and the pin each get their time and rate."""
    lines: list[str] = []
    reporter = Reporter(lines.append, primary=True)
    with reporter.stage("register", "loading the shares", nbytes=16_380_000_000) as st:
        st.background = {"read": 1.38, "pin": 3.37}
    reporter.close()
    figures = reporter.figures.stages[-1]
    assert figures.gb_per_s is None
    doc = figures.as_json()
    assert doc["gb_per_s"] is None
    assert doc["background"] == {
        "read": {"wall_s": 1.38, "seconds": 1.38, "gb_per_s": 11.87},
        "pin": {"wall_s": 3.37, "seconds": 3.37, "gb_per_s": 4.861},
    }
    assert doc["wall_s"] == doc["seconds"]
    assert re.fullmatch(
        r"register: \d\.\d\ds, 16\.38 GB moved in the background: read 1\.38s "
        r"\(11\.87 GB/s\) \+ pin 3\.37s \(4\.86 GB/s\)",
        lines[-1],
    ), lines[-1]


def test_the_summary_table_shows_no_rate_for_background_work() -> None:
    """The register row of a direct registration that waited 0.0005 s for 16.38 GB printed
    32762.94 GB/s; now it has no rate, and the read and pin rows under it have theirs."""
    from ckptctl.cli._job_view import stage_table

    register = {
        "seconds": 0.0005, "bytes": 16_381_470_720, "gb_per_s": None,
        "background": {
            "read": {"seconds": 1.38, "gb_per_s": 11.87},
            "pin": {"seconds": 3.37, "gb_per_s": 4.861},
        },
    }  # fmt: skip
    update = {"seconds": 2.0, "bytes": 16_381_470_720, "gb_per_s": 8.191}
    summary = {
        "checkpoint_name": "my-checkpoint-iter-0", "checkpoint_path": "/models/q",
        "world_size": 2,
        "ranks": [
            {"rank": r, "peak_rss_bytes": 10**9, "stages": {"register": register, "update": update}}
            for r in (0, 1)
        ],
    }  # fmt: skip
    console = Console(file=io.StringIO(), width=80, color_system=None)
    console.print(stage_table(summary))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    rows = {re.split(r"\s{2,}", line.strip())[0]: line for line in text.splitlines()}
    assert "GB/s" not in rows["register"], text
    assert re.search(r"1\.38s +11\.87 GB/s", rows["read, in the background"]), text
    assert re.search(r"3\.37s +4\.86 GB/s", rows["pin, in the background"]), text
    assert re.search(r"2\.00s +8\.19 GB/s +rank \d +2\.00s", rows["update"]), text
    assert text.splitlines()[0].startswith("/models/q, ") and "my-checkpoint" not in text
    summary["checkpoint_name"] = "step-7"
    console.print(stage_table(summary))
    assert "/models/q as step-7, " in console.file.getvalue()  # type: ignore[attr-defined]


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 999, 58_768, 16_381_470_720)] == [
        "0 B",
        "999 B",
        "58.77 kB",
        "16.38 GB",
    ]


# -- where the bytes come from --------------------------------------------------------------------


def test_direct_registration_reports_every_byte_it_reads() -> None:
    from ckptctl.checkpoint import plan_split, read_checkpoint
    from ckptctl.transfer.host_memory import ShareReader

    checkpoint = read_checkpoint(TINY)
    share = plan_split(checkpoint, 2, "tensors").ranks[1]
    counter = ByteCounter()
    reader = ShareReader(checkpoint, list(share.tensors), threads=4, pin=False, on_read=counter.add)
    reader.result()
    assert counter.value == share.bytes


def test_engine_registration_counts_the_file_pages_it_maps(tmp_path: Path) -> None:
    from ckptctl.transfer.stages import file_pages_mapped_since_now

    path = tmp_path / "data"
    path.write_bytes(os.urandom(8 << 20))
    with open(path, "rb") as fh:
        mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    mapped = file_pages_mapped_since_now()
    assert mapped() < 1 << 20
    total = sum(mapping[i] for i in range(0, 8 << 20, 4096))  # touch every page
    assert total >= 0 and mapped() >= 7 << 20  # (the kernel may have mapped a few already)
    mapping.close()


def test_the_update_counts_a_bucket_once_the_worker_loaded_it() -> None:
    import torch
    import zmq

    from ckptctl.ce.transfer_sockets import ReplyWatchingSocket

    ctx = zmq.Context()
    address = f"ipc://@ckptctl-test-buckets-{os.getpid()}-{time.monotonic_ns()}"
    req = ctx.socket(zmq.REQ)
    req.bind(address)
    loaded: list[int] = []
    watched = ReplyWatchingSocket(req, timeout_ms=10_000, on_bucket=loaded.append)
    rep = ctx.socket(zmq.REP)
    rep.connect(address)
    bucket = [
        {"name": "a", "dtype": torch.bfloat16, "shape": torch.Size([4, 8]), "offset": 0},
        {"name": "b", "dtype": torch.float32, "shape": torch.Size([3]), "offset": 256},
        {"name": "c", "dtype": torch.int64, "shape": torch.Size([]), "offset": 512},
    ]
    try:
        watched.send_pyobj(("the", "ipc", "handle"))
        rep.recv()
        rep.send(b"")
        watched.recv()
        assert loaded == []  # the handle is no bucket
        watched.send_pyobj(bucket)
        rep.recv()
        assert loaded == []  # sent, not yet loaded
        rep.send(b"")
        watched.recv()
        assert loaded == [4 * 8 * 2 + 3 * 4 + 8]
        watched.send_pyobj(bucket)
        rep.recv()
        rep.send(b"the worker failed")  # an error: not loaded
        watched.recv()
        assert loaded == [84] and watched.errors == ["the worker failed"]
    finally:
        req.close(linger=0)
        rep.close(linger=0)
        ctx.term()


# -- the node's ranks on rank 0's bar ------------------------------------------------------------


class _Job:
    """What NodeProgress takes from the job: its store."""

    def __init__(self, store: Any) -> None:
        self.store = store


def _node_shares(reporters: list[Reporter], local_world_size: int) -> tuple[Any, list[Any]]:
    """(store, each rank's NodeProgress) for ranks 0.. of `reporters`, through a real TCPStore."""
    from torch.distributed import TCPStore

    # Port 0: the store binds a free port itself (one found free could be taken meanwhile).
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    world = len(reporters)
    launch = [
        LaunchInfo(
            rank=r,
            world_size=world,
            local_rank=r,
            local_world_size=local_world_size,
            under_torchrun=True,
        )
        for r in range(world)
    ]
    return store, [
        NodeProgress.start(launch[r], _Job(store), rep) for r, rep in enumerate(reporters)
    ]


def test_rank_0_sums_the_node_through_the_store() -> None:
    reporters = [Reporter(lambda _: None, primary=r == 0) for r in range(4)]
    store, shares = _node_shares(reporters, local_world_size=3)
    assert shares[3] is None  # rank 3 is on node 1: its terminal is not rank 0's
    try:
        with (
            reporters[1].stage("register", "reading", nbytes=100, node_wide=True) as one,
            reporters[2].stage("register", "reading", nbytes=50, node_wide=True) as two,
            reporters[0].stage("register", "reading", nbytes=80, node_wide=True) as mine,
        ):
            one.done.add(30)
            two.done.add(50)
            mine.done.add(8)
            assert reporters[0].node is shares[0]
            wait_until(
                lambda: reporters[0].progress_of(mine) == (88, 230, 3), 20, "3 ranks counted"
            )
            # a hostile writer on the store's port: rank 0 ignores what it cannot read
            shares[2].stop()  # (else it writes its own figures again)
            store.set("progress/2", b"\xff" * 10)
            # ... and knows no total for the node while a rank's share is unknown.
            wait_until(
                lambda: reporters[0].progress_of(mine) == (38, None, 2), 20, "2 ranks counted"
            )
    finally:
        for share in shares:
            if share is not None:
                share.stop()


def test_the_node_bar_has_no_total_until_every_rank_said_its_share() -> None:
    """Rank 0's bar counted its own share, then the node's once the others published: its
    total grew mid-way and the bar went back (42% to 31%). Until every rank of the node has
    said its share, rank 0 shows the bytes done so far, with no total."""
    console = Console(file=io.StringIO(), force_terminal=True, width=80, color_system=None)
    rich = RichReporter(console)
    reporters = [rich, *(Reporter(lambda _: None, primary=False) for _ in range(2))]
    _, shares = _node_shares(reporters, local_world_size=3)
    try:
        with (
            reporters[1].stage("register", "reading", nbytes=100_000, node_wide=True) as one,
            rich.stage("register", "loading the shares", nbytes=80_000, node_wide=True) as mine,
        ):
            one.done.add(30_000)
            mine.done.add(8_000)
            wait_until(lambda: rich.progress_of(mine) == (38_000, None, 2), 20, "rank 1 counted")
            frame = _frame(rich)
            assert "38.00 kB so far" in frame and "/" not in frame.split("so far")[0], frame
            assert "eta" not in frame and "B/s" not in frame, frame
            with reporters[2].stage("register", "reading", nbytes=50_000, node_wide=True) as two:
                two.done.add(50_000)
                wait_until(lambda: "88.00/230.00 kB" in _frame(rich), 20, "the node's total drawn")
    finally:
        for share in shares:
            if share is not None:
                share.stop()
        rich.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'{"register#1": [1]}',
        b'{"register#1": [-1, 5]}',
        b'{"register#1": [1, 1e300]}',
        b'{"register#1": [true, 5]}',
        b'{"register#1": [1, 2]}' + b" " * 5000,
    ],
)
def test_what_rank_0_reads_from_the_store_is_checked(raw: bytes) -> None:
    assert parse(raw) == {}


def test_a_rank_cannot_claim_more_done_than_its_total() -> None:
    assert parse(b'{"register#1": [9, 5], "x": "y"}') == {"register#1": (5, 5)}


# -- checkpoint-engine's notice about p2p ----------------------------------------------------------


def test_the_p2p_notice_shows_only_when_asked_for(capfd: pytest.CaptureFixture[str]) -> None:
    from loguru import logger

    from ckptctl.job.runner import configure_engine_logging

    notice = "[rank0] fail to initialize p2p store due to import of mooncake.engine"
    configure_engine_logging(verbose=False, debug=False)
    logger.warning(notice)
    logger.warning("something else")
    err = capfd.readouterr().err
    assert "mooncake" not in err and "something else" in err
    configure_engine_logging(verbose=True, debug=False)
    logger.warning(notice)
    assert "mooncake" in capfd.readouterr().err
    logger.remove()


# -- a real 2-rank job on a terminal ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["engine", "direct"])
def test_two_ranks_on_one_terminal(mode: str) -> None:
    """Rank 1 keeps quiet on the terminal it shares with rank 0; rank 0 draws; the summary on
    stdout (a pipe) fits 80 columns."""
    with FakeServer(Behaviour()) as server:
        code, out, err = run_on_pty(
            torchrun_cmd(
                *UPDATE_ON_CPU,
                "--inference-parallel-size",
                "2",
                "--endpoint",
                server.endpoint,
                "--register-mode",
                mode,
            )
        )
    assert code == 0, err
    assert "[rank 1]" not in err  # (its lines tore the live view: "...0:00:00[rank 1] split:")
    # The stages are named as in the table below ("wait server", not "wait_server").
    for stage in ("split", "register", "wait server", "update"):
        assert f"✓ {stage}: " in err or f"✓ \x1b[0m{stage}: " in err, stage
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "stage" in line)
    assert header.split() == ["stage", "time", "rate", "slowest", "rank", "fastest", "time"]
    rate = r"\d+\.\d\d [kMG]?B/s"
    register = next(line for line in lines if line.strip().startswith("register"))
    if mode == "engine":
        assert re.search(rate, register), register
    else:  # read and pinned from the start, in a thread: the stage only waited for it
        assert not re.search(rate, register), register
        for what in ("read", "pin"):
            row = next(line for line in lines if f"{what}, in the background" in line)
            assert re.search(rf"\d+\.\d\ds +{rate}", row), row
    # The checkpoint is named by its path; the seed's default name is not news.
    assert str(TINY) in out and "my-checkpoint-iter-0" not in out


@pytest.mark.slow
def test_the_update_summary_counts_tensors_as_tensor_count() -> None:
    with FakeServer(Behaviour()) as server:
        r = subprocess.run(
            torchrun_cmd(
                *UPDATE_ON_CPU,
                "--inference-parallel-size",
                "2",
                "--endpoint",
                server.endpoint,
                "--json",
            ),
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["ok"], doc["exit_code"], doc["error"]) == (True, 0, None)
    assert doc["tensor_count"] == 25 and "tensors" not in doc
    assert "mooncake" not in r.stderr


def test_the_drain_stage_ends_where_the_worker_connected_not_a_poll_later() -> None:
    """The drain watcher polls; the stage it reports ends at the connection's own moment, so
    it never overlaps the first bucket (which goes out after the connection) in a trace."""
    import threading

    from ckptctl.transfer.pausing import DrainWatch

    reporter = Reporter(lambda _: None, primary=True)
    connected_at: list[float] = []
    polled = threading.Event()

    def seen_at() -> float | None:
        polled.set()
        return connected_at[0] if connected_at else None

    drain = DrainWatch(reporter, seen_at)
    with drain.watching():
        assert polled.wait(30)
        connected_at.append(time.perf_counter())
        time.sleep(0.05)  # the request runs on past the connection
    (stage,) = [s for s in reporter.figures.stages if s.name == "drain"]
    assert stage.detail == "until the server's worker connected"
    assert stage.started_at + stage.seconds == pytest.approx(connected_at[0], abs=1e-6)
    assert drain.seconds == stage.seconds


def test_a_connection_before_the_drain_began_is_a_drain_of_no_time() -> None:
    """A worker that connected before the watcher's stage began (a fast server) makes a drain
    of 0 s, never a negative one; one that connected within the last poll still counts."""
    from ckptctl.transfer.pausing import DrainWatch

    reporter = Reporter(lambda _: None, primary=True)
    early = time.perf_counter()
    drain = DrainWatch(reporter, lambda: early)
    with drain.watching():
        pass  # the request answered at once: the watcher may not have polled yet
    (stage,) = [s for s in reporter.figures.stages if s.name == "drain"]
    assert stage.seconds == 0.0 and drain.seconds == 0.0
    assert stage.detail == "until the server's worker connected"

"""`--trace FILE`: a job's stages on every rank as one Chrome trace-event file (Perfetto,
chrome://tracing), one process per rank (pid = rank) and one track per thread (TRACKS): the
stages as the Reporter timed them, the share's read and pin in its background thread, each
bucket from its metas going to the server's worker to the worker's reply that it loaded it
(ce/transfer_sockets.ReplyWatchingSocket), each bucket's host-to-device copy and its wait for a
read still filling it (transfer/overlap.py), the rest of checkpoint-engine's exchange with the
worker, the HTTP request that makes the server take the weights, and when each host buffer
was full.

There is no second timing system: a stage's events come from its StageFigures (its start and
its seconds), the rest from `record` at the few places they happen, which keeps them only while
a trace is wanted. Rank 0 gathers every rank's events through the job's store and writes FILE:
for update and join once the job succeeded (a failing job's ranks may be gone), for a push
whatever its outcome (its result comes back from every rank anyway).

FILE is written safely (`check_path`, `write`): into a new temporary file beside it (O_EXCL,
mode 0600), then renamed over it, so that a symlink planted at FILE is replaced, never
followed. FILE may exist only as a trace ckptctl wrote before: a regular file of this user that
starts with ckptctl's mark (MARK: the trace's `otherData`, which viewers ignore, comes first);
any other file (another tool's trace), a symlink or a directory there is refused.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from ckptctl.errors import UsageError

# The tracks (tid) of each rank.
STAGES, BACKGROUND, BUCKETS, COPIES, WORKER, REQUEST, BUFFERS = 1, 2, 3, 4, 5, 6, 7
TRACKS = {
    STAGES: "stages",
    BACKGROUND: "background read and pin",
    BUFFERS: "host buffers read",
    BUCKETS: "buckets",
    COPIES: "host-to-device copies",
    WORKER: "exchange with the server's worker",
    REQUEST: "request to the server",
}
# How every trace ckptctl writes starts (`document`), and how one it may replace is told.
MARK = b'{"otherData":{"producer":"ckptctl",'


@dataclass
class Span:
    """Something that took time on one rank, on `track`, from `start` to `end` (perf_counter)."""

    name: str
    track: int
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


_lock = threading.Lock()
_spans: list[Span] | None = None  # while recording
_requested: str | None = None  # update/join --trace FILE (this process)


def recording() -> bool:
    return _spans is not None


def record(name: str, track: int, start: float, end: float | None = None, **args: Any) -> None:
    """Keep a span (ending now unless `end`) while a trace is wanted; from any thread."""
    if _spans is not None and start:
        _spans.append(Span(name, track, start, time.perf_counter() if end is None else end, args))


def bucket(sent_at: float, nbytes: int) -> None:
    """A bucket's worker replied that it loaded it (called from the transfer's thread)."""
    record("bucket", BUCKETS, sent_at, bytes=nbytes)


def start_recording() -> None:
    """Keep the spans of the transfers from now on (until `take_spans`)."""
    global _spans
    with _lock:
        _spans = []


def take_spans() -> list[Span]:
    global _spans
    with _lock:
        taken, _spans = _spans or [], None
    return taken


def rank_events(rank: int, stages: list[Any], spans: list[Span]) -> list[dict[str, Any]]:
    """This rank's trace events: its StageFigures and spans, in microseconds since the epoch
    (each rank converts its own monotonic clock, so that the ranks line up)."""
    offset = time.time() - time.perf_counter()

    def span(name: str, tid: int, start: float, end: float, **args: Any) -> dict[str, Any]:
        # Start and end rounded alike: a stage that ends where the next begins never overlaps it.
        ts, te = round((start + offset) * 1e6), round((end + offset) * 1e6)
        event = {"name": name, "ph": "X", "ts": ts, "dur": max(te - ts, 0), "pid": rank}
        return {**event, "tid": tid, "args": {k: v for k, v in args.items() if v is not None}}

    events = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
    ]
    for tid, title in TRACKS.items():
        events.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": title}}
        )
    for st in stages:
        end = st.started_at + st.seconds
        events.append(
            span(
                st.name,
                STAGES,
                st.started_at,
                end,
                label=st.label,
                detail=st.detail or None,
                bytes=st.bytes,
            )  # fmt: skip
        )
        if st.background:
            # The work began with its reader (`background_started`) or, where that is not
            # known, as late as it can have: back to back, ending with the stage.
            at = st.background_started
            if at is None:
                at = end - sum(st.background.values())
            for what, secs in st.background.items():
                events.append(span(what, BACKGROUND, at, at + secs, bytes=st.bytes))
                at += secs
    buckets = itertools.count()
    for sp in spans:
        name = f"bucket {next(buckets)}" if sp.track == BUCKETS else sp.name
        events.append(span(name, sp.track, sp.start, sp.end, **sp.args))
    return events


def document(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The file's JSON: every rank's events, their times from the first one (in µs)."""
    first = min((e["ts"] for e in events if "ts" in e), default=0)
    shifted = [{**e, "ts": e["ts"] - first} if "ts" in e else e for e in events]
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(first / 1e6))
    return {  # (otherData first: its producer is the file's MARK)
        "otherData": {"producer": "ckptctl", "started_at": f"{started}.{first % 10**6:06d}Z"},
        "traceEvents": shifted,
        "displayTimeUnit": "ms",
    }


def check_path(path: str | os.PathLike[str], what: str = "--trace") -> str:
    """FILE as an absolute path (its last part not resolved: a symlink there is refused, never
    followed), or a UsageError saying why it cannot be written (`what`: how it names FILE's
    flag or argument)."""
    from ckptctl.regular_files import replaceable_target

    return replaceable_target(path, _is_a_trace, "a trace", what)


def _is_a_trace(f: BinaryIO, _size: int) -> bool:
    return f.read(len(MARK)) == MARK


def _not_a_trace(path: str) -> str | None:
    """Why the file at `path` may not be replaced; None when there is none or it is a trace."""
    from ckptctl.regular_files import why_not_replace

    return why_not_replace(path, _is_a_trace, "a trace")


def write(path: str, events: list[dict[str, Any]], what: str = "--trace") -> int:
    """Write the trace of `events` to `path` (see the module's docstring); returns how many
    events it holds. Raises UsageError or OSError."""
    full = check_path(path, what)
    fd, tmp = tempfile.mkstemp(prefix=".ckptctl-trace-", dir=os.path.dirname(full))
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(document(events), fh, separators=(",", ":"))
        problem = _not_a_trace(full)  # (checked again: it may have appeared meanwhile)
        if problem:
            raise UsageError(f"{what} {path}: {problem}")
        os.replace(tmp, full)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return sum(1 for e in events if e["ph"] == "X")


# -- update and join: FILE from the command line --------------------------------------------------


def request(path: str | os.PathLike[str] | None, *, primary: bool) -> None:
    """`--trace FILE` for this process's job: checked now on the rank that writes it (rank 0);
    every rank records its spans from now on."""
    global _requested
    if path is None:
        return
    _requested = check_path(path) if primary else os.fspath(path)
    start_recording()


def finish(job: Any) -> None:
    """After a job's body succeeded: every rank's events to rank 0, which writes the file."""
    if _requested is None:
        return
    mine = rank_events(job.launch.rank, job.reporter.figures.stages, take_spans())
    gathered = job.gather("trace", {"events": mine})
    if gathered is None:
        return
    ranks = [d["events"] for d in gathered]
    if job.launch.rank == 0:
        try:  # (the job did its work: a trace it cannot write is worth a warning, no more)
            count = write(_requested, [e for events in ranks for e in events])
        except (UsageError, OSError) as exc:
            job.reporter.warn(f"no trace written: {exc}")
            return
        job.reporter.log(f"trace: {_requested} ({count} events on {len(ranks)} rank(s))")


# -- a serve job's push (push --trace FILE) ------------------------------------------------------


def push_trace(path: str, ranks: list[dict[str, Any]], *, write_it: bool) -> dict[str, Any]:
    """Take every rank's events out of a push's results (`trace_events`) and, on rank 0,
    write them to `path`: what the push's answer says of its trace."""
    events = [e for r in ranks for e in (r.pop("trace_events", None) or [])]
    if not write_it:
        return {"path": path}
    try:
        return {"path": path, "events": write(path, events, what="trace")}
    except (UsageError, OSError) as exc:
        return {"path": path, "error": str(exc)}

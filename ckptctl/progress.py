"""Stage timing and its display: a Rich live view on rank 0's terminal, plain lines elsewhere.

The pipeline only calls `reporter.stage(...)`; which display (if any) is chosen by the CLI.
A stage that moves bytes says how many (`nbytes`) and counts what is done in its counter:
`figures.done.add(n)` from any thread, `reporter.counter(name)` for work that starts before
its stage does (a read that overlaps the parameter server's start-up), or `done.track(f)` for
a figure that can only be read (how much of the files is mapped). The display decides how to
draw it: bars with bytes, rate and ETA on a terminal, a line every 10 s in a log, nothing with
--quiet. A stage marked `node_wide` adds the other ranks of the node (through `reporter.node`,
which the job sets: job/node_progress.py) - their shares of the checkpoint, read side by
side on one machine.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.console import RenderableType
from rich.markup import escape
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn
from rich.table import Column
from rich.text import Text

from ckptctl.errors import log_line, redact


class ByteCounter:
    """Bytes done so far: added to from any thread, or read from a `source`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0
        self._source: Callable[[], int] | None = None

    def add(self, n: int) -> None:
        with self._lock:
            self._value += n

    def track(self, source: Callable[[], int]) -> None:
        """Read the figure from `source` from now on (it must not raise, and be cheap)."""
        self._source = source

    @property
    def value(self) -> int:
        if self._source is not None:
            return max(int(self._source()), 0)
        return self._value

    @property
    def live(self) -> bool:
        """Bytes are being counted: until then a display shows no byte figures, only time."""
        return self._source is not None or self._value > 0


@dataclass
class StageFigures:
    name: str
    seconds: float = 0.0
    bytes: int | None = None
    detail: str = ""
    label: str = ""
    done: ByteCounter = field(default_factory=ByteCounter, repr=False)
    node_wide: bool = False  # the node's ranks each move their own share: show their sum
    seq: int = 1  # the n-th stage of this name in this job (a serve job pushes many times)
    started_at: float = field(default_factory=time.perf_counter, repr=False)
    # Where the stage's body saw its end come earlier than the body returned (a watcher that
    # polls): that moment, not the return.
    ended_at: float | None = field(default=None, repr=False)
    # Work on this stage's bytes done outside its time, in a thread that started before it
    # (what -> seconds, each over all the bytes: {"read": 1.38, "pin": 3.37}). The stage's own
    # time is then only its wait for that work: it has no rate of its own.
    background: dict[str, float] = field(default_factory=dict)
    background_started: float | None = field(default=None, repr=False)  # (its perf_counter)

    @property
    def title(self) -> str:
        """The stage's name as lines and tables show it ("wait server"; JSON keeps the key)."""
        return self.name.replace("_", " ")

    @property
    def gb_per_s(self) -> float | None:
        """The rate, only where the stage's bytes moved within its time."""
        if self.background:
            return None
        return _rate(self.bytes, self.seconds)

    @property
    def key(self) -> str:
        """Names this stage the same on every rank (they run the same stages in order)."""
        return f"{self.name}#{self.seq}"

    def done_bytes(self) -> int:
        """Bytes done, at most the stage's total (an estimate may overshoot)."""
        done = self.done.value
        return min(done, self.bytes) if self.bytes is not None else done

    def as_json(self) -> dict[str, Any]:
        # wall_s; `seconds` is its name before it (programs read it).
        wall = round(self.seconds, 4)
        doc: dict[str, Any] = {"wall_s": wall, "seconds": wall}
        if self.bytes is not None:
            doc["bytes"] = self.bytes
            rate = self.gb_per_s
            doc["gb_per_s"] = round(rate, 3) if rate is not None else None
            if self.done.live:  # what the progress display counted (an estimate for some)
                doc["bytes_done"] = self.done_bytes()
            if self.background:
                doc["background"] = {
                    what: {
                        "wall_s": round(secs, 4),
                        "seconds": round(secs, 4),
                        "gb_per_s": _rounded(self.bytes, secs),
                    }
                    for what, secs in self.background.items()
                }
        if self.detail:
            doc["detail"] = self.detail
        return doc

    def summary(self) -> str:
        text = f"{self.title}: {self.seconds:.2f}s"
        if self.bytes and self.background:
            parts = " + ".join(
                f"{what} {secs:.2f}s" + (f" ({rate_text(self.bytes, secs)})" if secs > 0 else "")
                for what, secs in self.background.items()
            )
            text += f", {format_bytes(self.bytes)} moved in the background: {parts}"
        elif self.bytes:
            text += f", {format_bytes(self.bytes)}"
            if self.seconds > 0:
                text += f" ({rate_text(self.bytes, self.seconds)})"
        if self.detail:
            text += f" - {self.detail}"
        return text


@dataclass
class StageLog:
    """Every stage this rank ran, in order."""

    stages: list[StageFigures] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {s.name: s.as_json() for s in self.stages}


class NodeView(Protocol):
    """The other ranks of this node, as the job sees them (job/node_progress.py)."""

    expected: int  # the node's other ranks

    def others(self, key: str) -> tuple[int, int, int]:
        """(bytes done, bytes in all, ranks) of stage `key` on the node's other ranks."""
        ...


def _rate(nbytes: int | None, seconds: float) -> float | None:
    """GB/s, or None where there is nothing to divide."""
    return nbytes / seconds / 1e9 if nbytes and seconds > 0 else None


def _rounded(nbytes: int | None, seconds: float) -> float | None:
    rate = _rate(nbytes, seconds)
    return round(rate, 3) if rate is not None else None


def rate_text(nbytes: float, seconds: float) -> str:
    return f"{format_bytes(nbytes / seconds)}/s"


def format_bytes(n: float) -> str:
    """Decimal units, as disk and network figures are quoted (16.38 GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


class Reporter:
    """Plain reporting: one line when a stage starts (rank 0) and one when it ends (every rank);
    while a stage that moves bytes runs, rank 0 says how far it got every TICK_S."""

    TICK_S = 10.0  # how often the display looks at the counters (and, here, writes a line)

    def __init__(self, log: Any, *, primary: bool, quiet: bool = False) -> None:
        self._log = log  # callable(str)
        self.primary = primary
        self.quiet = quiet
        self.figures = StageLog()
        self.running: dict[str, StageFigures] = {}
        self.node: NodeView | None = None
        self._counters: dict[str, ByteCounter] = {}
        self._seen: dict[str, int] = {}
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_tick: dict[str, tuple[float, int]] = {}  # stage key -> (time, bytes done)

    def log(self, message: str) -> None:
        if not self.quiet:
            self._log(redact(message))

    def warn(self, message: str) -> None:
        """Warnings print even with --quiet."""
        self._log(redact(f"warning: {message}"))

    def error(self, message: str) -> None:
        """Something failed that the job goes on after (a serve push): even with --quiet."""
        self._log(redact(f"error: {message}"))

    def counter(self, name: str) -> ByteCounter:
        """The byte counter the next stage called `name` will use: for work that starts
        before its stage does."""
        with self._lock:
            return self._counters.setdefault(name, ByteCounter())

    @contextlib.contextmanager
    def stage(
        self, name: str, label: str, *, nbytes: int | None = None, node_wide: bool = False
    ) -> Iterator[StageFigures]:
        with self._lock:
            self._seen[name] = seq = self._seen.get(name, 0) + 1
            done = self._counters.pop(name, None) or ByteCounter()
        figures = StageFigures(
            name, bytes=nbytes, label=label, done=done, node_wide=node_wide, seq=seq
        )
        with self._lock:
            self.running[name] = figures
        self._started(figures)
        if nbytes is not None:
            self._start_ticker()
        ok = False
        try:
            yield figures
            ok = True
        finally:
            # (An end seen before the stage began - a connection that beat the watcher's
            # start - is a stage of no time, never a negative one.)
            ended = max(figures.ended_at or time.perf_counter(), figures.started_at)
            figures.seconds = ended - figures.started_at
            with self._lock:
                self.running.pop(name, None)
            if not ok:
                self._failed(figures)
        self.figures.stages.append(figures)
        self._finished(figures)

    def describe_running(self) -> str:
        """The innermost stage that runs now and what it waits on, for a deadline's message:
        "waiting for the inference server (http://...: connection refused, 12s of 13s)"."""
        with self._lock:
            running = list(self.running.values())
        if not running:
            return ""
        figures = running[-1]
        return f"{figures.label} ({figures.detail})" if figures.detail else figures.label

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2)

    # -- what a display does (this one: plain lines) ------------------------------------------

    def _started(self, figures: StageFigures) -> None:
        if self.primary:
            self.log(f"{figures.label}...")

    def _finished(self, figures: StageFigures) -> None:
        self.log(figures.summary())

    def _failed(self, figures: StageFigures) -> None:
        pass  # the error line says what happened

    def _tick(self) -> None:
        """Rank 0, in a log: how far each stage that moves bytes got, at what rate since the
        last line (its counter may have started before the stage: bytes read early are not
        bytes of this stage's time)."""
        if not self.primary or self.quiet:
            return
        now = time.perf_counter()
        for figures in self.running_stages():
            done, total, ranks = self.progress_of(figures)
            if not figures.done.live or total == 0:
                continue
            before = self._last_tick.get(figures.key)
            self._last_tick[figures.key] = (now, done)
            rate = ""
            if before is not None and done > before[1]:
                rate = f" ({rate_text(done - before[1], now - before[0])})"
            if total is None:  # a rank of the node has not said its share yet
                node = self.node.expected + 1 if self.node is not None else ranks
                self.log(f"{figures.label}: {format_bytes(done)} so far, {ranks} of {node} ranks")
                continue
            where = f" on {ranks} ranks" if ranks > 1 else ""
            self.log(f"{figures.label}: {format_bytes(done)} of {format_bytes(total)}{where}{rate}")

    # -- for displays ----------------------------------------------------------------------------

    def running_stages(self) -> list[StageFigures]:
        with self._lock:
            return list(self.running.values())

    def progress_of(self, figures: StageFigures) -> tuple[int, int | None, int]:
        """(bytes done, bytes in all, ranks counted) of a running stage: this rank's, plus
        the node's other ranks for a node-wide stage. The total is None until every rank of
        the node has said its share: a total that grew as they did would move the bar back."""
        done, total, ranks = figures.done_bytes(), figures.bytes or 0, 1
        if figures.node_wide and self.node is not None:
            other_done, other_total, others = self.node.others(figures.key)
            done, total, ranks = done + other_done, total + other_total, ranks + others
            if others < self.node.expected:
                return done, None, ranks
        return done, total, ranks

    def _start_ticker(self) -> None:
        with self._lock:
            if self._ticker is not None:
                return
            self._ticker = threading.Thread(target=self._run_ticker, name="ckptctl-progress")
            self._ticker.daemon = True
        self._ticker.start()

    def _run_ticker(self) -> None:
        while not self._stop.wait(self.TICK_S):
            # A display must never end the job: whatever goes wrong here is dropped.
            with contextlib.suppress(Exception):
                self._tick()


class RichReporter(Reporter):
    """A live view for a person at rank 0's terminal: a row per running stage (a bar with
    bytes, rate and ETA for a stage that moves bytes); a finished stage becomes a line."""

    TICK_S = 0.2

    def __init__(self, console: Any, *, quiet: bool = False) -> None:
        super().__init__(console.print, primary=True, quiet=quiet)
        self.console = console
        # The figures keep their width (each column pads its own); the description takes what
        # is left of the line and is cut (…) on a narrow terminal. (Rich would rather wrap
        # the figures.)
        self._description = Column(no_wrap=True, overflow="ellipsis")
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", table_column=self._description),
            _BarColumn(),
            _BytesColumn(table_column=Column(no_wrap=True)),
            _RateColumn(table_column=Column(no_wrap=True)),
            _TimeColumn(table_column=Column(no_wrap=True)),
            console=console,
            transient=True,  # finished stages are printed as lines; the live rows then go
            refresh_per_second=8,
        )
        self.progress.start()
        self._tasks: dict[str, Any] = {}

    def log(self, message: str) -> None:
        if not self.quiet:
            self.progress.console.print(log_line(message), markup=False, highlight=False)

    def warn(self, message: str) -> None:
        self.progress.console.print(log_line(f"warning: {message}"), style="yellow", markup=False)

    def error(self, message: str) -> None:
        self.progress.console.print(redact(f"error: {message}"), style="red", markup=False)

    def _started(self, figures: StageFigures) -> None:
        self._fit(self.running_stages())
        # escape(): paths, server messages and versions are text, never Rich markup.
        self._tasks[figures.name] = self.progress.add_task(
            escape(figures.label), total=None, figures=figures
        )
        self._tick()

    def _finished(self, figures: StageFigures) -> None:
        self._drop(figures)
        if not self.quiet:
            summary = log_line(figures.summary())
            self.progress.console.print(Text.assemble(("✓ ", "green"), summary))

    def _failed(self, figures: StageFigures) -> None:
        self._drop(figures)

    def _drop(self, figures: StageFigures) -> None:
        task = self._tasks.pop(figures.name, None)
        if task is not None:
            self.progress.remove_task(task)
            self.progress.refresh()  # (else the next line printed shows the stale row again)

    def _fit(self, running: list[StageFigures]) -> None:
        """The description's width: the line less the figures the running stages show
        (spinner, bar, bytes, rate, time and the gaps; without bytes, spinner and time)."""
        figures_width = 50 if any(f.bytes for f in running) else 12
        self._description.max_width = max(self.console.width - figures_width, 16)

    def _tick(self) -> None:
        running = self.running_stages()
        self._fit(running)
        for figures in running:
            task = self._tasks.get(figures.name)
            if task is None or not figures.bytes:
                continue
            done, total, ranks = self.progress_of(figures)
            label = figures.label + (f", {ranks} ranks" if ranks > 1 else "")
            live = figures.done.live or done > 0
            self.progress.update(
                task,
                total=total if live else None,
                completed=done,
                description=escape(label),
                nbytes=total,
                counting=live and total is None,  # the node's total is not known yet
            )

    def close(self) -> None:
        super().close()
        self.progress.stop()


def _is_bytes_task(task: Task) -> bool:
    figures = task.fields.get("figures")
    return figures is not None and bool(figures.bytes)


class _BarColumn(ProgressColumn):
    """A bar for a stage that moves bytes (pulsing until its bytes are counted), else none."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True))
        self._bar = BarColumn(bar_width=10)

    def render(self, task: Task) -> RenderableType:
        return self._bar.render(task) if _is_bytes_task(task) else Text("")


class _BytesColumn(ProgressColumn):
    """'1.20/16.38 GB' (decimal units, as disk and network figures are quoted)."""

    def render(self, task: Task) -> Text:
        if not _is_bytes_task(task):
            return Text("")
        if task.fields.get("counting"):
            return Text(
                f"{format_bytes(task.completed) + ' so far':>14}", style="progress.download"
            )
        total = task.fields.get("nbytes") or task.fields["figures"].bytes
        if task.total is None:
            return Text(f"{format_bytes(total):>14}", style="progress.download")
        number, unit = format_bytes(total).split()
        scale = float(total) / float(number) if float(number) else 1.0
        done = f"{task.completed / scale:.2f}" if unit != "B" else str(int(task.completed))
        return Text(f"{done + '/' + number + ' ' + unit:>14}", style="progress.download")


class _RateColumn(ProgressColumn):
    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        if not _is_bytes_task(task):
            return Text("")
        if task.total is None or not speed or task.finished:
            return Text(" " * 11)  # (all bytes done, the stage still busy: no rate to show)
        return Text(f"{format_bytes(speed) + '/s':>11}", style="progress.data.speed")


class _TimeColumn(ProgressColumn):
    """The ETA of a stage whose bytes are counted; the time it has taken otherwise."""

    def render(self, task: Task) -> Text:
        # Once every byte is done a stage may still be busy (pinning, the server's answer): the
        # time it has taken then, not an "eta 0:00" that stays.
        if (
            _is_bytes_task(task)
            and task.total is not None
            and not task.finished
            and task.time_remaining is not None
        ):
            return Text(f"{'eta ' + _clock(task.time_remaining):<9}", style="progress.remaining")
        return Text(f"{_clock(task.elapsed or 0):<9}", style="progress.elapsed")


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 60}:{seconds % 60:02d}"

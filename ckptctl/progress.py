"""Stage timing and its display: a Rich live view on rank 0's terminal, plain lines elsewhere.

The pipeline only calls `reporter.stage(...)`; which display (if any) is chosen by the CLI.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptctl.errors import redact


@dataclass
class StageFigures:
    name: str
    seconds: float = 0.0
    bytes: int | None = None
    detail: str = ""

    @property
    def gb_per_s(self) -> float | None:
        if not self.bytes or self.seconds <= 0:
            return None
        return self.bytes / self.seconds / 1e9

    def as_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"seconds": round(self.seconds, 4)}
        if self.bytes is not None:
            doc["bytes"] = self.bytes
            rate = self.gb_per_s
            doc["gb_per_s"] = round(rate, 3) if rate is not None else None
        if self.detail:
            doc["detail"] = self.detail
        return doc

    def summary(self) -> str:
        text = f"{self.name}: {self.seconds:.2f}s"
        if self.bytes:
            text += f", {self.bytes / 1e9:.2f} GB"
            if self.gb_per_s is not None:
                text += f" ({self.gb_per_s:.1f} GB/s)"
        if self.detail:
            text += f" - {self.detail}"
        return text


@dataclass
class StageLog:
    """Every stage this rank ran, in order."""

    stages: list[StageFigures] = field(default_factory=list)
    current: str = ""

    def as_json(self) -> dict[str, Any]:
        return {s.name: s.as_json() for s in self.stages}


class Reporter:
    """Plain reporting: one line when a stage starts (rank 0) and one when it ends (every rank)."""

    def __init__(self, log: Any, *, primary: bool, quiet: bool = False) -> None:
        self._log = log  # callable(str)
        self.primary = primary
        self.quiet = quiet
        self.figures = StageLog()

    def log(self, message: str) -> None:
        if not self.quiet:
            self._log(redact(message))

    def warn(self, message: str) -> None:
        """Warnings print even with --quiet."""
        self._log(redact(f"warning: {message}"))

    def _started(self, name: str, label: str) -> None:
        if self.primary:
            self.log(f"{label}...")

    def _finished(self, figures: StageFigures) -> None:
        self.log(figures.summary())

    @contextlib.contextmanager
    def stage(self, name: str, label: str, *, nbytes: int | None = None) -> Iterator[StageFigures]:
        figures = StageFigures(name, bytes=nbytes)
        self.figures.current = label
        self._started(name, label)
        start = time.perf_counter()
        try:
            yield figures
        finally:
            figures.seconds = time.perf_counter() - start
            self.figures.current = ""
        self.figures.stages.append(figures)
        self._finished(figures)

    def close(self) -> None:
        pass


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)


class RichReporter(Reporter):
    """A live view for a person at rank 0's terminal: a spinner per running stage, then its figures."""

    def __init__(self, console: Any, *, quiet: bool = False) -> None:
        super().__init__(console.print, primary=True, quiet=quiet)
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console = console
        self.progress = Progress(
            SpinnerColumn(finished_text="[green]✓[/green]"),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.progress.start()
        self._tasks: dict[str, Any] = {}

    def log(self, message: str) -> None:
        if not self.quiet:
            self.progress.console.print(redact(message), markup=False, highlight=False)

    def _started(self, name: str, label: str) -> None:
        # escape(): paths, server messages and versions are text, never Rich markup.
        self._tasks[name] = self.progress.add_task(escape(label), total=1)

    def _finished(self, figures: StageFigures) -> None:
        task = self._tasks.pop(figures.name, None)
        if task is not None:
            summary = redact(figures.summary())
            self.progress.update(task, completed=1, description=escape(summary))

    def warn(self, message: str) -> None:
        self.progress.console.print(redact(f"warning: {message}"), style="yellow", markup=False)

    def close(self) -> None:
        self.progress.stop()

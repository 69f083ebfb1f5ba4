"""`--log-format json`: every line this process writes on stderr as one JSON object, for log
collectors:

    {"time": "2026-12-01T20:41:07.512Z", "rank": 0, "level": "info", "stage": "update",
     "message": "update: 0.03s, 58.77 kB (1.88 MB/s)", "figures": {"wall_s": 0.03, ...}}

`level` is info, warning or error; `stage` the stage running (or that ended) when the line
was written, else null; `figures` a stage's figures on the line that ends it (what --json
gives per stage), else null. Two parts: `JsonReporter` writes the stage lines with their
figures, and `JsonLines` (sys.stderr from then on) turns every other line - the error line,
warnings, checkpoint-engine's log - into an object of its own. Only what Python writes is
wrapped: a C library writing to file descriptor 2 itself (NCCL) is not.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
import time
from typing import Any, TextIO

from ckptctl.errors import redact
from ckptctl.progress import Reporter, StageFigures

_RANK_PREFIX = re.compile(r"^\[rank \d+\] ")
_LEVELS = (("error: ", "error"), ("warning: ", "warning"))

_stage: list[str | None] = [None]  # the stage the next plain line belongs to


def _now() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def record(
    message: str,
    *,
    level: str = "info",
    stage: str | None = None,
    figures: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "time": _now(),
        "rank": int(os.environ.get("RANK", "0") or 0),
        "level": level,
        "stage": stage if stage is not None else _stage[0],
        "message": message,
        "figures": figures,
    }


class JsonLines(io.TextIOBase):
    """A text stream that writes each line given to it as one JSON object (`record`) to
    `raw`; a line already written as a JSON object (by `emit`) goes through as it is."""

    def __init__(self, raw: TextIO) -> None:
        super().__init__()
        self.raw = raw
        self._lock = threading.Lock()
        self._partial = ""

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
            for line in lines:
                self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        line = _RANK_PREFIX.sub("", line.rstrip("\r"))
        if not line.strip():
            return
        level = "info"
        for prefix, name in _LEVELS:
            if line.startswith(prefix):
                level, line = name, line[len(prefix) :]
        self._out(json.dumps(record(line, level=level)))

    def _out(self, doc: str) -> None:
        self.raw.write(doc + "\n")
        self.raw.flush()

    def emit(self, doc: dict[str, Any]) -> None:
        with self._lock:
            self._out(json.dumps(doc, default=str))

    def flush(self) -> None:
        with self._lock:
            if self._partial:
                self._line(self._partial)
                self._partial = ""
        self.raw.flush()

    def isatty(self) -> bool:
        return False  # (no live view, no colours)

    def fileno(self) -> int:
        return self.raw.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True


def use_json() -> JsonLines:
    """From now on, this process's stderr is JSON lines."""
    if isinstance(sys.stderr, JsonLines):
        return sys.stderr
    sys.stderr = stream = JsonLines(sys.stderr)
    return stream


def emit(doc: dict[str, Any]) -> None:
    if isinstance(sys.stderr, JsonLines):
        sys.stderr.emit(doc)
    else:  # (not switched to JSON lines: still one object a line)
        sys.stderr.write(json.dumps(doc, default=str) + "\n")


class JsonReporter(Reporter):
    """The job's stage lines as JSON objects: the stage's name in `stage`, its figures (those
    of --json) on the line that ends it."""

    def __init__(self, *, primary: bool, quiet: bool = False) -> None:
        super().__init__(self._info, primary=primary, quiet=quiet)

    def _info(self, message: str) -> None:
        emit(record(message))

    def warn(self, message: str) -> None:
        emit(record(redact(message), level="warning"))

    def error(self, message: str) -> None:
        emit(record(redact(message), level="error"))

    def _started(self, figures: StageFigures) -> None:
        _stage[0] = figures.name
        if self.primary and not self.quiet:
            emit(record(redact(f"{figures.label}..."), stage=figures.name))

    def _finished(self, figures: StageFigures) -> None:
        if not self.quiet:
            doc = record(redact(figures.summary()), stage=figures.name, figures=figures.as_json())
            emit(doc)
        _stage[0] = None

    def _failed(self, figures: StageFigures) -> None:
        _stage[0] = figures.name  # (the error line that follows belongs to it)


def active() -> bool:
    """Whether this process writes JSON lines (--log-format json)."""
    return isinstance(sys.stderr, JsonLines)

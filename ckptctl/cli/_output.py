"""How every command talks: results on stdout, logs and progress on stderr.

- `--json`: stdout holds exactly one JSON document (written by rank 0 only).
- logs: stderr, plain lines; other ranks prefix theirs with their rank.
- progress: Rich displays only on rank 0 and only when stderr is a terminal; Rich itself
  honours NO_COLOR / FORCE_COLOR / TTY_COMPATIBLE.
- `-q/--quiet`: no logs or progress; errors and warnings still print.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from rich.console import Console, ConsoleOptions, RenderableType
from rich.segment import Segment
from rich.text import Text

from ckptctl import results
from ckptctl.errors import log_line, terminal_text
from ckptctl.launch import LaunchInfo, launch_info


class TerminalConsole(Console):
    """A Rich console whose text never carries a terminal's control characters: names of files
    and tensors, paths and server words reach tables, logs and the live view as text (an ESC
    shows as `\\x1b`). Rich's own styling and cursor moves are separate segments, kept."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        # Before the layout, so that a table measures what it will show.
        return super().render_str(terminal_text(text, lines=True), **kwargs)

    def render(
        self, renderable: RenderableType, options: ConsoleOptions | None = None
    ) -> Iterable[Segment]:
        # Whatever reached Rich as a Text object, too.
        for segment in super().render(renderable, options):
            text = segment.text
            if segment.control or text.isprintable():
                yield segment
            else:
                yield Segment(terminal_text(text, lines=True), segment.style)


class Output:
    def __init__(
        self, *, json_mode: bool = False, quiet: bool = False, launch: LaunchInfo | None = None
    ) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.launch = launch or launch_info()
        # markup=False: paths, tensor names and server messages are text, never Rich markup
        # (a checkpoint in "runs[/x]" must not crash a table). Styled output uses Text objects.
        self.err = TerminalConsole(stderr=True, highlight=False, soft_wrap=True, markup=False)
        self.out = TerminalConsole(highlight=False, soft_wrap=True, markup=False)
        # Live displays only where a person is watching, and only once per job.
        self.interactive = self.err.is_terminal and self.launch.is_primary and not quiet
        # With --json, rank 0 owes exactly one document on stdout, success or not.
        results.expect(sys.stdout if json_mode and self.is_primary else None)

    @property
    def is_primary(self) -> bool:
        return self.launch.is_primary

    def _prefix(self) -> str:
        return f"[rank {self.launch.rank}] " if self.launch.world_size > 1 else ""

    def log(self, message: str) -> None:
        """A progress or diagnostic line on stderr (silenced by --quiet)."""
        if not self.quiet:
            self.err.print(f"{self._prefix()}{log_line(message)}", markup=False)

    def warn(self, message: str) -> None:
        self.err.print(
            f"{self._prefix()}warning: {log_line(message)}", style="yellow", markup=False
        )

    def result(self, doc: dict[str, Any], *, ok: bool = True) -> None:
        """The command's JSON result: exactly one document on stdout, from rank 0, in the
        envelope (results.py). ok=False: the command is about to fail (it raises next); the
        fields go out with its error and exit code."""
        if not self.is_primary:
            return
        if ok:
            results.write(doc)
        else:
            results.keep(doc)

    def show_rows(self, rows: Iterable[Iterable[str]]) -> None:
        """Result rows on stdout as tab-separated lines, for grep, cut and awk (rank 0, not
        with --json): each value one line, redacted and escaped (a tab or line break in a
        value shows as \\t or \\n, never as a column or row of its own)."""
        if self.is_primary and not self.json_mode:
            for row in rows:
                self.out.file.write("\t".join(log_line(value) for value in row) + "\n")
            self.out.file.flush()

    def show(self, renderable: Any, *, wrap: bool = False) -> None:
        """Human-readable results (tables, summaries) on stdout, from rank 0, not with --json.
        wrap: text wraps at the console's width (80 when stdout is not a terminal); by
        default a long line (a path) stays whole, for whoever greps the output. A str is one
        line: its line breaks are escaped with the rest (a path holding one adds no line)."""
        if self.is_primary and not self.json_mode:
            if isinstance(renderable, str):
                renderable = log_line(renderable)  # (a URL's password in `status`, say)
            self.out.print(renderable, soft_wrap=not wrap)

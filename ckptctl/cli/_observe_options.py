"""The options of ckptctl.observe: metrics of a serve job, a trace file, JSON log lines."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from ckptctl.cli._options import OUTPUT, SERVE_JOB, at_least
from ckptctl.cli._output import Output


class LogFormatChoice(str, Enum):
    text = "text"
    json = "json"


MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        "--metrics-port",
        metavar="PORT",
        callback=at_least(1, 65535),
        show_default=False,
        rich_help_panel=SERVE_JOB,
        help="Serve Prometheus metrics (pushes, their stages and bytes, the served version, the "
        "job's state) on this port, from global rank 0. Needs the metrics extra: pip install "
        "'ckptctl\\[metrics]'.",
    ),
]
MetricsHostOpt = Annotated[
    str,
    typer.Option(
        "--metrics-host",
        metavar="HOST",
        rich_help_panel=SERVE_JOB,
        help="Address the metrics listen on (0.0.0.0: every interface; they are not "
        "authenticated).",
    ),
]
TraceOpt = Annotated[
    Path | None,
    typer.Option(
        "--trace",
        metavar="FILE",
        show_default=False,
        rich_help_panel=OUTPUT,
        help="Write a timeline of the job's stages on every rank (Chrome trace-event JSON: "
        "open it in Perfetto or chrome://tracing). Replaces FILE only where it is a trace "
        "written before; refuses any other file.",
    ),
]
LogFormatOpt = Annotated[
    LogFormatChoice,
    typer.Option(
        "--log-format",
        metavar="FORMAT",
        rich_help_panel=OUTPUT,
        help="text, or json: one JSON object per log line on stderr (time, rank, stage, "
        "message, figures), for log collectors.",
    ),
]


def use_log_format(out: Output, log_format: LogFormatChoice) -> None:
    """--log-format json: stderr as JSON lines from here on, and no live view."""
    if log_format == LogFormatChoice.json:
        from ckptctl.observe import logs

        logs.use_json()
        out.interactive = False


def want_trace(out: Output, trace: Path | None) -> None:
    """--trace FILE: checked now (exit 2 where it cannot be written); the job writes it."""
    if trace is not None:
        from ckptctl.observe import timeline

        timeline.request(trace, primary=out.is_primary)

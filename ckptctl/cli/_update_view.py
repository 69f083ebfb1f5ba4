"""Showing a real update: the live stage view while it runs, and the summary at the end."""

from __future__ import annotations

from typing import Any

from ckptctl.cli._errors import debug_enabled
from ckptctl.cli._output import Output


def run_and_report(opts: Any, out: Output) -> None:
    """Run the update pipeline on this rank and print its result (rank 0)."""
    from ckptctl.pipeline.update import run_update
    from ckptctl.progress import Reporter, RichReporter

    reporter = (
        RichReporter(out.err, quiet=out.quiet)
        if out.interactive
        else Reporter(out.log, primary=out.is_primary, quiet=out.quiet)
    )
    try:
        summary = run_update(opts, reporter, debug=debug_enabled())
    finally:
        reporter.close()
    if out.json_mode:
        out.result(summary)
        return
    if out.is_primary:
        out.show(_summary_table(summary))


def _summary_table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(
        title=f"{summary['checkpoint_name']}: {summary['total_bytes'] / 1e9:.2f} GB, "
        f"{summary['tensors']} tensors, {summary['update_method']}, {summary['split']} split, "
        f"{summary['world_size']} ranks, done in {summary['wall_s']:.2f}s",
        title_justify="left",
    )
    stages = list(summary["ranks"][0]["stages"])
    table.add_column("rank", justify="right")
    for stage in stages:
        table.add_column(stage.replace("_", " "), justify="right")
    table.add_column("peak RSS", justify="right")
    for rank in summary["ranks"]:
        cells = [str(rank["rank"])]
        for stage in stages:
            fig = rank["stages"].get(stage)
            if fig is None:
                cells.append("-")
                continue
            cell = f"{fig['seconds']:.2f}s"
            if fig.get("gb_per_s"):
                cell += f" {fig['gb_per_s']:.1f} GB/s"
            cells.append(cell)
        cells.append(f"{rank['peak_rss_bytes'] / 1e9:.1f} GB")
        table.add_row(*cells)
    return table

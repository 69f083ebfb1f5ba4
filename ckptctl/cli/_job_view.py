"""Showing a GPU job (update, save-metas, join): the live stage view while it runs, the
summary at the end (rank 0), or exactly one JSON document with --json."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ckptctl import results
from ckptctl.cli._errors import debug_enabled
from ckptctl.cli._output import Output


def run_job_with_display(
    run: Callable[..., dict[str, Any]], opts: Any, out: Output
) -> dict[str, Any]:
    """Run one of the pipeline's jobs on this rank and print its result (rank 0)."""
    from ckptctl.progress import Reporter, RichReporter

    reporter = (
        RichReporter(out.err, quiet=out.quiet)
        if out.interactive
        else Reporter(out.log, primary=out.is_primary, quiet=out.quiet)
    )
    try:
        with results.protect_stdout():  # NCCL and CUDA write to fd 1 directly
            summary = run(opts, reporter, debug=debug_enabled())
    finally:
        reporter.close()
    if out.json_mode:
        out.result(summary)
    elif out.is_primary:
        # A job that reports per-rank stages gets the table; others (serve) one line.
        out.show(stage_table(summary) if summary.get("ranks") else _one_line(summary))
    results.leave_group_to_exit(0)  # a GPU job ends here, without the NCCL teardown (see there)
    return summary


def stage_table(summary: dict[str, Any]) -> Any:
    from rich.table import Table

    facts = [summary["checkpoint_name"]]
    if "total_bytes" in summary:
        facts.append(f"{summary['total_bytes'] / 1e9:.2f} GB, {summary['tensors']} tensors")
    for key in ("update_method", "split"):
        if key in summary:
            facts.append(f"{summary[key]}" + (" split" if key == "split" else ""))
    facts.append(f"{summary['world_size']} ranks")
    table = Table(title=", ".join(facts), title_justify="left")
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


def _one_line(summary: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in summary.items() if k != "ok")

"""Showing a GPU job (update, save-metas, join): the live stage view while it runs, the
summary at the end (rank 0), or exactly one JSON document with --json."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich import box

from ckptctl import results
from ckptctl.cli._errors import debug_enabled
from ckptctl.cli._output import Output


def run_job_with_display(
    run: Callable[..., dict[str, Any]], opts: Any, out: Output
) -> dict[str, Any]:
    """Run one of the pipeline's jobs on this rank and print its result (rank 0)."""
    from ckptctl.progress import Reporter, RichReporter

    if out.interactive:
        reporter: Reporter = RichReporter(out.err, quiet=out.quiet)
    else:
        # Another rank whose stderr is a terminal shares it with rank 0 (torchrun's ranks of a
        # node inherit one): its lines would tear rank 0's live view, so it keeps quiet there
        # (warnings and errors still show). In a log, every rank says what it did.
        beside_rank_0 = not out.is_primary and out.err.is_terminal
        reporter = Reporter(out.log, primary=out.is_primary, quiet=out.quiet or beside_rank_0)
    try:
        with results.protect_stdout():  # NCCL and CUDA write to fd 1 directly
            summary = run(opts, reporter, debug=debug_enabled())
    finally:
        reporter.close()
    if out.json_mode:
        out.result(summary)
    elif out.is_primary:
        # A job that reports per-rank stages gets the table; others (serve) one line.
        if summary.get("ranks"):
            out.show(stage_table(summary), wrap=True)  # (the table fits 80 columns)
        else:
            out.show(_one_line(summary))
    results.leave_group_to_exit(0)  # a GPU job ends here, without the NCCL teardown (see there)
    return summary


def stage_table(summary: dict[str, Any]) -> Any:
    """What the job did, in 80 columns: a line of facts, then a row per stage with its
    slowest rank's time and rate (the job waits for the slowest), and the fastest's time."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ckptctl.progress import format_bytes

    ranks = summary["ranks"]
    facts = [summary["checkpoint_name"]]
    if "total_bytes" in summary:
        count = summary.get("tensor_count")
        facts.append(format_bytes(summary["total_bytes"]) + (f", {count} tensors" if count else ""))
    if "update_method" in summary:
        facts.append(str(summary["update_method"]))
    if "split" in summary:
        facts.append(f"{summary['split']} split")
    facts.append(f"{summary['world_size']} rank(s)")
    if "wall_s" in summary:
        facts.append(f"{summary['wall_s']:.2f}s in all")

    several = len(ranks) > 1
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("stage")
    table.add_column("time", justify="right")
    table.add_column("rate", justify="right")
    if several:
        table.add_column("slowest", justify="right")
        table.add_column("fastest", justify="right")
    for stage in ranks[0]["stages"]:
        times = [(r["stages"][stage]["seconds"], r["rank"]) for r in ranks if stage in r["stages"]]
        seconds, slowest = max(times)
        fig = next(r["stages"][stage] for r in ranks if r["rank"] == slowest)
        moved = fig.get("bytes") and fig["seconds"] > 0
        rate = f"{format_bytes(fig['bytes'] / fig['seconds'])}/s" if moved else ""
        row = [stage.replace("_", " "), f"{seconds:.2f}s", rate]
        if several:
            row += [f"rank {slowest}", f"{min(times)[0]:.2f}s"]
        table.add_row(*row)
    rss, rss_rank = max((r["peak_rss_bytes"], r["rank"]) for r in ranks)
    table.add_section()
    peak = ["peak RSS", f"{rss / 1e9:.1f} GB", ""]
    table.add_row(*(peak + [f"rank {rss_rank}", ""] if several else peak))
    return Group(Text(", ".join(facts)), table)


def _one_line(summary: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in summary.items() if k != "ok")

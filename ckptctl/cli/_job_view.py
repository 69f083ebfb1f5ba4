"""Showing a GPU job (update, save-metas, join): the live stage view while it runs, the
summary at the end (rank 0), or exactly one JSON document with --json; and a serve job's push
log (`status --history`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rich import box

from ckptctl import results
from ckptctl.cli._errors import debug_enabled
from ckptctl.cli._output import Output
from ckptctl.errors import terminal_text


def run_job_with_display(
    run: Callable[..., dict[str, Any]], opts: Any, out: Output
) -> dict[str, Any]:
    """Run one of the pipeline's jobs on this rank and print its result (rank 0)."""
    from ckptctl.observe import logs
    from ckptctl.progress import Reporter, RichReporter

    if logs.active():  # --log-format json
        reporter: Reporter = logs.JsonReporter(primary=out.is_primary, quiet=out.quiet)
    elif out.interactive:
        reporter = RichReporter(out.err, quiet=out.quiet)
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
    """What the job did, in 80 columns: a line of facts, then a row per stage with its slowest
    rank's time and rate (the job waits for the slowest), that rank, and the fastest rank's
    time. A stage whose bytes moved in the background shows that work's rows under it."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    ranks = summary["ranks"]
    several = len(ranks) > 1
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("stage")
    table.add_column("time", justify="right")
    table.add_column("rate", justify="right")
    if several:
        table.add_column("slowest rank", justify="right")
        table.add_column("fastest time", justify="right")
    blank = ["", ""] if several else []
    for stage in ranks[0]["stages"]:
        times = [(r["stages"][stage]["seconds"], r["rank"]) for r in ranks if stage in r["stages"]]
        seconds, slowest = max(times)
        fig = next(r["stages"][stage] for r in ranks if r["rank"] == slowest)
        moved = fig.get("gb_per_s") is not None  # (null: the bytes moved outside its time)
        rate = _rate(fig.get("bytes"), fig["seconds"]) if moved else ""
        row = [stage.replace("_", " "), f"{seconds:.2f}s", rate]
        table.add_row(*row, *([f"rank {slowest}", f"{min(times)[0]:.2f}s"] if several else []))
        for what, part in (fig.get("background") or {}).items():
            secs = f"{part['seconds']:.2f}s"
            rate = _rate(fig.get("bytes"), part["seconds"])
            table.add_row(f"  {what}, in the background", secs, rate, *blank)
    rss, rss_rank = max((r["peak_rss_bytes"], r["rank"]) for r in ranks)
    table.add_section()
    peak = ["peak RSS", f"{rss / 1e9:.1f} GB", ""]
    table.add_row(*(peak + [f"rank {rss_rank}", ""] if several else peak))
    return Group(Text(terminal_text(", ".join(_facts(summary)))), table)


def _rate(nbytes: int | None, seconds: float) -> str:
    from ckptctl.progress import rate_text

    return rate_text(nbytes, seconds) if nbytes and seconds > 0 else ""


def _facts(summary: dict[str, Any]) -> list[str]:
    """The checkpoint (its path; its name only where one was given), size, method, ranks."""
    from ckptctl.defaults import DEFAULT_CHECKPOINT_NAME
    from ckptctl.progress import format_bytes

    name, path = summary.get("checkpoint_name"), summary.get("checkpoint_path")
    facts = [str(path or name)]
    if path and name and name != DEFAULT_CHECKPOINT_NAME:
        facts[0] += f" as {name}"
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
    return facts


HISTORY_COLUMNS = ("seq", "outcome", "weight_version", "checkpoint_path", "wall_s",
                   "total_bytes", "finished_at", "server_weights")  # fmt: skip


def history_rows(doc: dict[str, Any]) -> list[list[str]]:
    """`status --history` when stdout is no terminal: a header, then one row per push, oldest
    first, its values whole (a table wraps paths at 80 columns, and grep finds nothing)."""
    rows = [list(HISTORY_COLUMNS)]
    for p in doc.get("pushes") or []:
        values = {
            **p,
            "outcome": _outcome(p),
            "server_weights": p.get("server_weights") or "unchanged",
        }
        rows.append(["-" if values.get(c) is None else str(values[c]) for c in HISTORY_COLUMNS])
    return rows


def _outcome(push: dict[str, Any]) -> str:
    """`status --history`'s outcome (a stage, a restore, a rollback that failed: which it was)."""
    what = push.get("outcome") or "-"
    if push.get("action") not in (None, "push") and what != "rolled back":
        what += f" ({push['action']})"
    return what


def history_table(doc: dict[str, Any]) -> Any:
    """`status --history`: a row per push the job kept, oldest first, then how many ran."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from ckptctl.progress import format_bytes

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    # The short columns stay on one line; outcome, version and checkpoint wrap where narrow.
    for name, least in (
        ("#", 0), ("outcome", 10), ("version", 8), ("checkpoint", 8),
        ("time", 0), ("size", 0), ("when (UTC)", 0), ("server", 0),
    ):  # fmt: skip
        table.add_column(
            name,
            justify="right" if name in ("#", "time", "size") else "left",
            no_wrap=not least,
            min_width=least or None,
            overflow="fold",
        )
    for p in doc.get("pushes") or []:
        secs, when = p.get("wall_s"), p.get("finished_at")
        cells = (
            str(p.get("seq")),
            _outcome(p),
            str(p.get("weight_version") or "-"),
            str(p.get("checkpoint_path") or "-"),
            "-" if secs is None else f"{secs:.2f}s",
            format_bytes(p["total_bytes"]) if p.get("total_bytes") else "-",
            when[5:16].replace("T", " ") if when else "-",  # MM-DD hh:mm of its ISO end
            # None: the push never reached them, and the server kept what it held.
            p.get("server_weights") or "unchanged",
        )
        # A line break in a version or path is shown as \n, never a row of its own.
        table.add_row(*(terminal_text(str(cell)) for cell in cells))
    run, limit = doc.get("pushes_run") or 0, doc.get("history_limit")
    note = f"{run} command(s) run (pushes, stages, rollbacks), the last {limit} kept"
    return Group(table, Text(note)) if run else Text("no push yet")


def _one_line(summary: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in summary.items() if k != "ok")

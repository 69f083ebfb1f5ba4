"""Showing a split plan: a Rich table per rank plus a one-line summary, or the JSON document."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from ckptctl.checkpoint.plan import Plan
from ckptctl.cli._output import Output


def format_bytes(n: float) -> str:
    """Decimal units, as disk and network figures are quoted (16.38 GB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def deviation(plan: Plan, nbytes: int) -> float:
    """How far a rank is from an even share, as a fraction (+0.02 = 2% more than even)."""
    return nbytes / plan.even_bytes - 1 if plan.total_bytes else 0.0


def plan_table(plan: Plan) -> Table:
    table = Table(
        title=f"{plan.split} split of {plan.checkpoint.root} over {plan.world_size} rank(s)",
        title_justify="left",
    )
    table.add_column("rank", justify="right")
    table.add_column("files", justify="right")
    table.add_column("tensors", justify="right")
    table.add_column("bytes", justify="right")
    table.add_column("share", justify="right")
    table.add_column("vs even", justify="right")
    for r in plan.ranks:
        share = r.bytes / plan.total_bytes if plan.total_bytes else 0.0
        table.add_row(
            str(r.rank),
            str(len(r.files)),
            str(len(r.tensors)),
            format_bytes(r.bytes),
            f"{share:.1%}",
            f"{deviation(plan, r.bytes):+.1%}",
        )
    return table


def plan_summary(plan: Plan) -> str:
    ckpt = plan.checkpoint
    line = (
        f"{plan.split} split: {len(ckpt.tensors)} tensors in {len(ckpt.files)} file(s), "
        f"{format_bytes(plan.total_bytes)} over {plan.world_size} rank(s); largest rank "
        f"{format_bytes(plan.max_rank_bytes)} ({deviation(plan, plan.max_rank_bytes):+.1%} "
        f"vs even, lower bound {format_bytes(plan.lower_bound_bytes)})"
    )
    others = {k: v for k, v in plan.candidates.items() if k != plan.split}
    for name, largest in others.items():
        line += f"; a {name} split's largest rank: {format_bytes(largest)}"
    return line


def show_plan(out: Output, plan: Plan) -> None:
    """Rank 0 prints the plan: JSON with --json, otherwise the table and the summary."""
    if out.json_mode:
        out.result(plan.as_json())
        return
    out.show(Group(plan_table(plan), plan_summary(plan)))
    idle = [r.rank for r in plan.ranks if not r.tensors]
    if idle and out.is_primary:
        out.warn(
            f"{len(idle)} rank(s) get no tensors: the checkpoint has fewer {plan.split} than ranks"
        )
    if plan.checkpoint.ignored_files and out.is_primary:
        out.warn(
            f"{plan.checkpoint.index_file} does not name {len(plan.checkpoint.ignored_files)} "
            f".safetensors file(s) in the directory, which are ignored (e.g. "
            f"{plan.checkpoint.ignored_files[0]})"
        )

"""Showing a split plan: a Rich table per rank plus a one-line summary, or the JSON document."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from ckptctl.checkpoint.plan import Plan
from ckptctl.cli._output import Output
from ckptctl.job.groups import GroupPlan
from ckptctl.progress import format_bytes


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


def groups_table(groups: Sequence[GroupPlan]) -> Table:
    """Which ranks feed which server: one row per group (its leader is its first rank)."""
    table = Table(title="server groups", title_justify="left")
    table.add_column("group", justify="right")
    table.add_column("ranks", justify="right")
    table.add_column("node", justify="right")
    table.add_column("server (the first rank sends)", overflow="fold")
    for g in groups:
        ranks = f"{g.ranks[0]}-{g.ranks[-1]}" if len(g.ranks) > 1 else str(g.ranks[0])
        table.add_row(str(g.group), ranks, str(g.node), Text(g.address.describe()))
    return table


def plan_document(plan: Plan, groups: Sequence[GroupPlan]) -> dict[str, Any]:
    """The dry run's JSON: the plan (the contract's fields first) and the server groups."""
    doc = plan.as_json()
    # A count is tensor_count in every document (`tensors` is always a list of names).
    doc["tensor_count"] = doc.pop("total_tensors", len(plan.checkpoint.tensors))
    doc["groups"] = [g.as_json() for g in groups]
    return doc


def idle_reason(plan: Plan) -> str:
    """Why some ranks of `plan` hold nothing: too few pieces, or pieces too large."""
    unit = "file" if plan.split == "files" else "tensor"
    ckpt = plan.checkpoint
    sizes = list(ckpt.file_bytes.values()) if unit == "file" else [t.nbytes for t in ckpt.tensors]
    if len(sizes) < plan.world_size:
        return f"the checkpoint has fewer {unit}s ({len(sizes)}) than ranks ({plan.world_size})"
    return (
        f"the checkpoint's largest {unit} ({format_bytes(max(sizes))}) is more than an even "
        f"share ({format_bytes(int(plan.even_bytes))}): the rank that holds it is the longest "
        "whatever the split, and the rest fit on fewer ranks"
    )


def plan_warnings(plan: Plan) -> list[str]:
    """What a reader of the plan should know: idle ranks, ignored files."""
    warnings = []
    idle = [r.rank for r in plan.ranks if not r.tensors]
    if idle:
        warnings.append(f"{len(idle)} rank(s) get no tensors: {idle_reason(plan)}")
    ckpt = plan.checkpoint
    if ckpt.ignored_files:
        warnings.append(
            f"{ckpt.index_file} does not name {len(ckpt.ignored_files)} .safetensors file(s) "
            f"in the directory, which are ignored (e.g. {ckpt.ignored_files[0]})"
        )
    return warnings


def show_plan(out: Output, plan: Plan, groups: Sequence[GroupPlan]) -> None:
    """Rank 0 prints the plan: JSON with --json, otherwise the tables and the summary; the
    warnings go to stderr either way, and into the JSON document."""
    warnings = plan_warnings(plan)
    if out.json_mode:
        out.result({**plan_document(plan, groups), "warnings": warnings})
    else:
        out.show(Group(plan_table(plan), groups_table(groups), plan_summary(plan)))
    if out.is_primary:
        for warning in warnings:
            out.warn(warning)

"""`ckptctl inspect-metas`: what a metas file holds, and whether it matches a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli import _options as o
from ckptctl.cli._output import Output
from ckptctl.errors import OperationFailed, UsageError

if TYPE_CHECKING:
    from ckptctl.metas import Difference, MetasSummary

_SHOWN_DIFFERENCES = 20


def inspect_metas_command(
    file: Annotated[
        Path | None,
        typer.Argument(
            metavar="FILE",
            show_default=False,
            help="A metas file (ckptctl's JSON, or a legacy pickle with --allow-pickle); or "
            "name it with --load-metas-file, as update and join do.",
        ),
    ] = None,
    load_metas_file: Annotated[
        Path | None,
        typer.Option(
            "--load-metas-file",
            metavar="FILE",
            show_default=False,
            rich_help_panel=o.CHECKPOINT,
            help="The metas file, as update and join name it (instead of FILE).",
        ),
    ] = None,
    checkpoint_path: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint-path",
            metavar="DIR",
            rich_help_panel=o.CHECKPOINT,
            help="Also check the metas against this checkpoint's safetensors headers "
            "(names, dtypes, shapes, sizes); any difference is exit 1.",
        ),
    ] = None,
    allow_pickle: o.AllowPickleOpt = False,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Summarise a metas file: per owner rank, totals, dtypes, largest tensors. Needs no GPU."""
    from ckptctl.metas import compare_with_checkpoint, read_metas_file, summarize

    out = Output(json_mode=json_output, quiet=quiet)
    if (file is None) == (load_metas_file is None):
        raise UsageError("name one metas file: FILE, or --load-metas-file FILE")
    file = file or load_metas_file
    assert file is not None
    metas_file = read_metas_file(file, allow_pickle=allow_pickle)
    if metas_file.legacy_pickle:
        out.warn(
            f"{file} is a legacy pickle file: it has no checkpoint name, world size or checksum"
        )
    summary = summarize(metas_file)
    diffs: list[Difference] | None = None
    if checkpoint_path is not None:
        from ckptctl.checkpoint import read_checkpoint

        diffs = compare_with_checkpoint(metas_file.metas, read_checkpoint(checkpoint_path).tensors)

    if json_output:
        doc = summary.as_json()
        if diffs is not None:
            doc["check"] = {
                "checkpoint_path": str(checkpoint_path),
                "ok": not diffs,
                "differences": [d.as_json() for d in diffs],
            }
        out.result(doc, ok=not diffs)
    else:
        _show(out, summary)
        if diffs is not None:
            _show_differences(out, diffs, checkpoint_path)
    if diffs:
        raise OperationFailed(
            f"{file} does not match {checkpoint_path}: {len(diffs)} difference(s)"
        )


def _show(out: Output, summary: MetasSummary) -> None:
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from ckptctl.progress import format_bytes  # (it imports the live display: not at start-up)

    src = summary.source
    if src.legacy_pickle:
        out.show(
            Text.from_markup(f"[bold]{escape(str(src.path))}[/bold]  legacy pickle (no header)")
        )
    else:
        out.show(
            Text.from_markup(
                f"[bold]{escape(str(src.path))}[/bold]  "
                f"checkpoint [cyan]{escape(src.checkpoint_name or '')}[/cyan] · "
                f"world size {src.world_size} · written {src.created_at:%Y-%m-%d %H:%M:%S %Z} by "
                f"ckptctl {src.ckptctl_version}, checkpoint-engine {src.checkpoint_engine_version}"
            )
        )

    ranks = Table(title="Owner ranks", title_justify="left")
    for col in ("rank", "buffers", "parameters", "bytes"):
        ranks.add_column(col, justify="right")
    ranks.add_column("p2p store")
    ranks.add_column("RDMA device")
    for r in summary.ranks:
        ranks.add_row(
            str(r.rank),
            str(r.buffers),
            f"{r.parameters:,}",
            format_bytes(r.nbytes),
            Text(r.p2p_store_addr or "-"),
            Text(r.rdma_device or "-"),
        )
    ranks.add_section()
    ranks.add_row(
        "total",
        str(sum(r.buffers for r in summary.ranks)),
        f"{summary.total_parameters:,}",
        format_bytes(summary.total_bytes),
        "",
        "",
        style="bold",
    )
    out.show(ranks)

    dtypes = Table(title="Dtypes", title_justify="left")
    for col, justify in (("dtype", "left"), ("parameters", "right"), ("bytes", "right")):
        dtypes.add_column(col, justify=justify)  # type: ignore[arg-type]
    for dtype, (n, b) in summary.dtypes.items():
        dtypes.add_row(dtype, f"{n:,}", format_bytes(b))
    out.show(dtypes)

    if summary.largest:
        largest = Table(title="Largest tensors", title_justify="left")
        for col, justify in (
            ("name", "left"),
            ("rank", "right"),
            ("dtype", "left"),
            ("shape", "left"),
            ("bytes", "right"),
        ):
            largest.add_column(col, justify=justify)  # type: ignore[arg-type]
        for t in summary.largest:
            largest.add_row(
                Text(t.name), str(t.rank), t.dtype, str(list(t.shape)), format_bytes(t.nbytes)
            )
        out.show(largest)
    if not summary.p2p_ready:
        out.show(
            Text("not joinable over p2p: a rank has no p2p store address or RDMA device", "yellow")
        )
    if summary.duplicate_names:
        out.show(
            Text(f"{len(summary.duplicate_names)} tensor name(s) held by several ranks", "yellow")
        )


def _show_differences(out: Output, diffs: list[Difference], checkpoint_path: Path | None) -> None:
    from rich.markup import escape
    from rich.text import Text

    if not diffs:
        out.show(
            Text.from_markup(
                f"[green]matches {escape(str(checkpoint_path))}[/]: names, dtypes, shapes, sizes"
            )
        )
        return
    out.show(
        Text.from_markup(f"[red]{len(diffs)} difference(s) from {escape(str(checkpoint_path))}[/]:")
    )
    for d in diffs[:_SHOWN_DIFFERENCES]:
        out.show(Text(f"  {d.describe()}"))
    if len(diffs) > _SHOWN_DIFFERENCES:
        out.show(f"  ... and {len(diffs) - _SHOWN_DIFFERENCES} more (--json lists them all)")

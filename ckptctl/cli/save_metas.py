"""`ckptctl save-metas`: hold a registered checkpoint and publish its metas file for joiners."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptctl.cli._choices import RegisterModeChoice, SplitChoice
from ckptctl.cli._options import (
    CheckpointNameOpt,
    CheckpointPathOpt,
    JsonOpt,
    QuietOpt,
    ReadThreadsOpt,
    RegisterModeOpt,
    SplitOpt,
    TimeoutOpt,
    VerboseOpt,
)
from ckptctl.cli._output import Output


def save_metas_command(
    checkpoint_path: CheckpointPathOpt,
    metas_file: Annotated[
        Path,
        typer.Option(
            "--metas-file",
            "--save-metas-file",
            help="Where rank 0 writes the metas file (JSON, checksummed, written atomically).",
            show_default=False,
        ),
    ],
    checkpoint_name: CheckpointNameOpt = "my-checkpoint-iter-0",
    split: SplitOpt = SplitChoice.auto,
    sleep_time: Annotated[
        float | None,
        typer.Option(
            "--sleep-time",
            min=0,
            help="Serve the weights for this many seconds, then unregister and exit 0. "
            "Default: until SIGTERM or SIGINT (then the same, cleanly).",
            show_default=False,
        ),
    ] = None,
    timeout: TimeoutOpt = 600.0,
    register_mode: RegisterModeOpt = RegisterModeChoice.engine,
    read_threads: ReadThreadsOpt = None,
    verbose: VerboseOpt = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Register a checkpoint on every rank, write its metas file, and serve it to joiners.

    Needs one GPU per rank (torchrun). The file is joinable only where checkpoint-engine's p2p
    store runs (mooncake + RDMA); otherwise a warning says so. --timeout bounds the loading,
    not the serving. Example:
    [bold]torchrun --nproc-per-node 8 --no-python ckptctl save-metas --checkpoint-path DIR --metas-file metas.json[/bold]
    """
    from ckptctl.cli._job_view import run_job_with_display
    from ckptctl.pipeline.metas_jobs import SaveMetasOptions, run_save_metas

    out = Output(json_mode=json_output, quiet=quiet)
    opts = SaveMetasOptions(
        checkpoint_path=str(checkpoint_path),
        metas_file=str(metas_file),
        checkpoint_name=checkpoint_name,
        split=split.value,
        sleep_time=sleep_time,
        timeout=timeout,
        register_mode=register_mode.value,
        read_threads=read_threads,
        verbose=verbose,
    )
    run_job_with_display(run_save_metas, opts, out)

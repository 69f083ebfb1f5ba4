"""`ckptctl save-metas`: hold a registered checkpoint and publish its metas file for joiners."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptctl.cli import _options as o
from ckptctl.cli._output import Output
from ckptctl.defaults import DEFAULT_CHECKPOINT_NAME
from ckptctl.settings import SplitMode


def save_metas_command(
    checkpoint_path: o.CheckpointPathOpt,
    metas_file: Annotated[
        Path,
        typer.Option(
            "--save-metas-file",
            metavar="FILE",
            show_default=False,
            rich_help_panel=o.CHECKPOINT,
            help="Where rank 0 writes the metas file (JSON, checksummed, written atomically), "
            "as `update --save-metas-file` does. Its older name, --metas-file, works too.",
        ),
    ],
    checkpoint_name: o.CheckpointNameOpt = DEFAULT_CHECKPOINT_NAME,
    split: o.SplitOpt = SplitMode.auto,
    register_mode: o.RegisterModeOpt = o.RegisterModeChoice.direct,
    read_threads: o.ReadThreadsOpt = None,
    sleep_time: o.HoldTimeOpt = None,
    timeout: o.TimeoutOpt = 600,
    log_format: o.LogFormatOpt = o.LogFormatChoice.text,
    verbose: o.VerboseOpt = False,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Register a checkpoint on every rank, write its metas file, and serve it to joiners.

    Needs one GPU per rank (torchrun). The file is joinable only where checkpoint-engine's p2p
    store runs (mooncake + RDMA); otherwise a warning says so. --timeout bounds the loading,
    not the serving.
    """
    from ckptctl.cli._job_view import run_job_with_display
    from ckptctl.job.groups import ServerTargets
    from ckptctl.settings import RegisterMode
    from ckptctl.transfer.metas_jobs import SaveMetasOptions, run_save_metas
    from ckptctl.transfer.request import TransferRequest

    out = Output(json_mode=json_output, quiet=quiet)
    o.use_log_format(out, log_format)
    request = TransferRequest(
        ServerTargets(),  # (none: it holds the weights for joiners)
        checkpoint_path=str(checkpoint_path),
        checkpoint_name=checkpoint_name,
        split=split,
        register_mode=RegisterMode(register_mode.value),
        read_threads=read_threads,
        timeout=timeout,
    )
    opts = SaveMetasOptions(request, str(metas_file), sleep_time=sleep_time, verbose=verbose)
    run_job_with_display(run_save_metas, opts, out)

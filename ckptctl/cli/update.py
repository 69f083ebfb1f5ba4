"""`ckptctl update`: split a checkpoint across ranks, register it, push it to the server.

Only `--dry-run` is implemented here: it plans the split and prints it, with no GPU, no server
and no torchrun needed. The push itself is another module's work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptctl.cli._choices import EngineChoice, SplitChoice, UpdateMethodChoice
from ckptctl.cli._options import (
    DEFAULT_ENDPOINT,
    EndpointOpt,
    EngineOpt,
    JsonOpt,
    QuietOpt,
    TimeoutOpt,
    UdsOpt,
    WeightVersionOpt,
)
from ckptctl.cli._output import Output
from ckptctl.errors import OperationFailed, UsageError
from ckptctl.launch import LaunchInfo, launch_info


def resolve_world_size(launch: LaunchInfo, flag: int | None) -> int:
    """torchrun's WORLD_SIZE when there is one; otherwise --world-size (default 1)."""
    if launch.under_torchrun:
        if flag is not None and flag != launch.world_size:
            raise UsageError(
                f"--world-size {flag} conflicts with WORLD_SIZE={launch.world_size} set by "
                "torchrun; drop --world-size (torchrun's world is used)"
            )
        return launch.world_size
    return 1 if flag is None else flag


def update_command(
    checkpoint_path: Annotated[
        Path,
        typer.Option(
            "--checkpoint-path",
            help="Checkpoint directory: safetensors shards with model.safetensors.index.json, "
            "a single model.safetensors, or a directory of .safetensors files.",
            show_default=False,
        ),
    ],
    endpoint: EndpointOpt = DEFAULT_ENDPOINT,
    inference_parallel_size: Annotated[
        int,
        typer.Option(
            "--inference-parallel-size", min=1, help="GPUs of the inference server (its TP size)."
        ),
    ] = 8,
    checkpoint_name: Annotated[
        str, typer.Option("--checkpoint-name", help="Name the checkpoint is registered under.")
    ] = "my-checkpoint-iter-0",
    update_method: Annotated[
        UpdateMethodChoice,
        typer.Option("--update-method", help="How weights reach the server's GPUs."),
    ] = UpdateMethodChoice.broadcast,
    save_metas_file: Annotated[
        Path | None,
        typer.Option("--save-metas-file", help="Also write the gathered metas to this file."),
    ] = None,
    uds: UdsOpt = None,
    weight_version: WeightVersionOpt = None,
    sleep_time: Annotated[
        int,
        typer.Option("--sleep-time", min=0, help="Seconds to stay alive after the update."),
    ] = 0,
    split: Annotated[
        SplitChoice,
        typer.Option(
            "--split",
            help="files: whole files per rank; tensors: single tensors per rank; auto: "
            "whichever leaves the largest rank smaller (ties: files). Both balance bytes.",
        ),
    ] = SplitChoice.auto,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Only plan the split and print it: no GPU, no server, no torchrun needed.",
        ),
    ] = False,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            min=1,
            help="Ranks to plan for when not under torchrun (under torchrun: its WORLD_SIZE).",
            show_default=False,
        ),
    ] = None,
    engine: EngineOpt = EngineChoice.sglang,
    timeout: TimeoutOpt = 600.0,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Split a safetensors checkpoint across ranks and push it into the running server.

    Preview the split first, on any machine:
    [bold]ckptctl update --dry-run --checkpoint-path DIR --world-size 8[/bold]
    """
    from ckptctl.checkpoint import plan_split, read_checkpoint
    from ckptctl.cli._plan_view import show_plan

    launch = launch_info()
    out = Output(json_mode=json_output, quiet=quiet, launch=launch)
    world = resolve_world_size(launch, world_size)

    if not dry_run:
        raise OperationFailed(
            "ckptctl update without --dry-run is not implemented yet; "
            "run with --dry-run to see the plan"
        )

    checkpoint = read_checkpoint(checkpoint_path)
    plan = plan_split(checkpoint, world, split.value)
    show_plan(out, plan)

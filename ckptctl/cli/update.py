"""`ckptctl update`: split a checkpoint across ranks, register it, push it to the server.

`--dry-run` plans the split and prints it, with no GPU, no server and no torchrun needed.
Otherwise every rank runs the pipeline in `ckptctl.pipeline.update` and rank 0 reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptctl.cli._choices import EngineChoice, RegisterModeChoice, SplitChoice, UpdateMethodChoice
from ckptctl.cli._options import (
    ApiKeyOpt,
    CheckpointNameOpt,
    ConsumeShmOpt,
    EndpointsOpt,
    EngineOpt,
    InferenceParallelSizeOpt,
    JsonOpt,
    QuietOpt,
    ReadThreadsOpt,
    RegisterModeOpt,
    SplitOpt,
    TimeoutOpt,
    UdsListOpt,
    VerboseOpt,
    WeightVersionOpt,
)
from ckptctl.cli._output import Output
from ckptctl.errors import UsageError
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
        Path | None,
        typer.Option(
            "--checkpoint-path",
            help="Checkpoint directory: safetensors shards with model.safetensors.index.json, "
            "a single model.safetensors, or a directory of .safetensors files. Required unless "
            "--load-metas-file is given.",
            show_default=False,
        ),
    ] = None,
    endpoint: EndpointsOpt = None,
    inference_parallel_size: InferenceParallelSizeOpt = 8,
    checkpoint_name: CheckpointNameOpt = "my-checkpoint-iter-0",
    update_method: Annotated[
        UpdateMethodChoice,
        typer.Option("--update-method", help="How weights reach the server's GPUs."),
    ] = UpdateMethodChoice.broadcast,
    save_metas_file: Annotated[
        Path | None,
        typer.Option("--save-metas-file", help="Also write the gathered metas to this file."),
    ] = None,
    load_metas_file: Annotated[
        Path | None,
        typer.Option(
            "--load-metas-file",
            help="Join instead: pull the weights over p2p from the holders this metas file "
            "names (as `ckptctl join`); no checkpoint is read.",
            show_default=False,
        ),
    ] = None,
    allow_pickle: Annotated[
        bool,
        typer.Option(
            "--allow-pickle",
            help="With --load-metas-file: also read a legacy pickle metas file, through a "
            "restricted unpickler (checkpoint-engine's data models, torch dtypes and sizes only).",
        ),
    ] = False,
    uds: UdsListOpt = None,
    weight_version: WeightVersionOpt = None,
    sleep_time: Annotated[
        int,
        typer.Option("--sleep-time", min=0, help="Seconds to stay alive after the update."),
    ] = 0,
    split: SplitOpt = SplitChoice.auto,
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
            max=65536,
            help="Ranks to plan for when not under torchrun (under torchrun: its WORLD_SIZE).",
            show_default=False,
        ),
    ] = None,
    engine: EngineOpt = EngineChoice.sglang,
    timeout: TimeoutOpt = 600.0,
    api_key: ApiKeyOpt = None,
    bucket_size_gb: Annotated[
        float | None,
        typer.Option(
            "--bucket-size-gb",
            min=0.001,
            help="Largest transfer bucket in GiB (checkpoint-engine's PS_MAX_BUCKET_SIZE_GB, 8).",
            show_default=False,
        ),
    ] = None,
    mem_fraction: Annotated[
        float | None,
        typer.Option(
            "--mem-fraction",
            min=0.01,
            max=1.0,
            help="Share of free GPU memory the transfer buffers may use "
            "(checkpoint-engine's PS_MEM_FRACTION, 0.9).",
            show_default=False,
        ),
    ] = None,
    register_mode: RegisterModeOpt = RegisterModeChoice.engine,
    read_threads: ReadThreadsOpt = None,
    consume_shm_files: ConsumeShmOpt = False,
    verbose: VerboseOpt = False,
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

    if load_metas_file is not None and (dry_run or save_metas_file is not None):
        raise UsageError(
            "--load-metas-file (join) goes with neither --dry-run nor --save-metas-file"
        )
    if load_metas_file is None and checkpoint_path is None:
        raise UsageError("--checkpoint-path is required (or --load-metas-file, to join)")
    if load_metas_file is not None:  # the seed script's join mode: `update.py --load-metas-file F`
        from ckptctl.cli.join import join_command

        return join_command(
            load_metas_file=load_metas_file,
            endpoint=endpoint,
            uds=uds,
            inference_parallel_size=inference_parallel_size,
            checkpoint_name=checkpoint_name,
            engine=engine,
            weight_version=weight_version,
            allow_pickle=allow_pickle,
            timeout=timeout,
            api_key=api_key,
            verbose=verbose,
            json_output=json_output,
            quiet=quiet,
        )
    if not dry_run:
        if world_size is not None and not launch.under_torchrun:
            raise UsageError(
                "--world-size only goes with --dry-run: start one rank per GPU with torchrun"
            )
        from ckptctl.cli._job_view import run_job_with_display
        from ckptctl.pipeline.groups import ServerTargets

        servers = ServerTargets.from_flags(
            endpoints=endpoint,
            uds=uds,
            api_key=api_key,
            engine=engine.value,
            parallel_size=inference_parallel_size,
            weight_version=weight_version,
        )
        from ckptctl.pipeline.update import UpdateOptions, run_update

        opts = UpdateOptions(
            checkpoint_path=str(checkpoint_path),
            checkpoint_name=checkpoint_name,
            servers=servers,
            update_method=update_method.value,
            split=split.value,
            save_metas_file=str(save_metas_file) if save_metas_file else None,
            sleep_time=float(sleep_time),
            timeout=timeout,
            bucket_size_gb=bucket_size_gb,
            mem_fraction=mem_fraction,
            register_mode="consume" if consume_shm_files else register_mode.value,
            read_threads=read_threads,
            verbose=verbose,
        )
        run_job_with_display(run_update, opts, out)
        return

    assert checkpoint_path is not None
    checkpoint = read_checkpoint(checkpoint_path)
    plan = plan_split(checkpoint, world, split.value)
    show_plan(out, plan)

"""`ckptctl update`: split a checkpoint across ranks, register it, push it to the server.

`--dry-run` plans the split and prints it, with no GPU, no server and no torchrun needed.
Otherwise every rank runs the pipeline in `ckptctl.transfer.update` and rank 0 reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli import _options as o
from ckptctl.cli._output import Output
from ckptctl.defaults import DEFAULT_CHECKPOINT_NAME, DEFAULT_ENDPOINT
from ckptctl.errors import UsageError
from ckptctl.launch import LaunchInfo, launch_info
from ckptctl.settings import PauseMode, ServerKind, SplitMode, UpdateMethod

if TYPE_CHECKING:
    from ckptctl.transfer.request import TransferRequest


DRY_RUN_NODE_SIZE = 8  # ranks per node a dry run takes without --nproc-per-node


def resolve_world_size(launch: LaunchInfo, flag: int | None, default: int = 1) -> int:
    """torchrun's WORLD_SIZE when there is one; otherwise --world-size (or `default`)."""
    if launch.under_torchrun:
        if flag is not None and flag != launch.world_size:
            raise UsageError(
                f"--world-size {flag} conflicts with WORLD_SIZE={launch.world_size} set by "
                "torchrun; drop --world-size (torchrun's world is used)"
            )
        return launch.world_size
    return default if flag is None else flag


def update_command(
    checkpoint_path: o.CheckpointPathOrJoinOpt = None,
    checkpoint_name: o.CheckpointNameOpt = DEFAULT_CHECKPOINT_NAME,
    split: o.SplitOpt = SplitMode.auto,
    register_mode: o.RegisterModeOpt = o.RegisterModeChoice.direct,
    read_threads: o.ReadThreadsOpt = None,
    consume_shm_files: o.ConsumeShmOpt = False,
    save_metas_file: Annotated[
        Path | None,
        typer.Option(
            "--save-metas-file",
            metavar="FILE",
            rich_help_panel=o.CHECKPOINT,
            help="Also write the gathered metas to this file.",
        ),
    ] = None,
    load_metas_file: o.JoinFromMetasOpt = None,
    allow_pickle: o.AllowPickleOpt = False,
    endpoint: o.EndpointsOpt = [DEFAULT_ENDPOINT],  # noqa: B006 - Typer copies it; shown in --help
    uds: o.UdsListOpt = None,
    engine: o.EngineOpt = ServerKind.sglang,
    inference_parallel_size: o.InferenceParallelSizeOpt = 8,
    api_key: o.ApiKeyOpt = None,
    weight_version: o.WeightVersionOpt = None,
    pause: o.PauseOpt = PauseMode.none,
    update_method: Annotated[
        UpdateMethod,
        typer.Option(
            "--update-method",
            metavar="METHOD",
            rich_help_panel=o.TRANSFER,
            help="How weights reach the server's GPUs. broadcast: over NCCL from every "
            "rank; p2p: over RDMA (needs mooncake); all: both, one after the other.",
        ),
    ] = UpdateMethod.broadcast,
    bucket_size_gb: o.BucketSizeOpt = None,
    mem_fraction: o.MemFractionOpt = None,
    timeout: o.TimeoutOpt = 600,
    sleep_time: o.SleepTimeOpt = 0,
    verify: o.VerifyOpt = False,
    verify_round_trip: o.VerifyRoundTripOpt = False,
    reset_served_weights: o.ResetServedWeightsOpt = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            metavar=o.FLAG,
            rich_help_panel=o.DRY_RUN,
            help="Only check the flags, plan the split and the server groups, and print them.",
        ),
    ] = False,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            metavar="N",
            callback=o.at_least(1, 65536),
            show_default=False,
            rich_help_panel=o.DRY_RUN,
            help="Ranks to plan for (under torchrun: its WORLD_SIZE). Default: one server "
            "group, --inference-parallel-size ranks.",
        ),
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node",
            metavar="N",
            callback=o.at_least(1),
            show_default=False,
            rich_help_panel=o.DRY_RUN,
            help="Ranks per node, as torchrun's flag (under torchrun: its LOCAL_WORLD_SIZE). "
            f"Default: {DRY_RUN_NODE_SIZE}, or the world size if smaller.",
        ),
    ] = None,
    trace: o.TraceOpt = None,
    log_format: o.LogFormatOpt = o.LogFormatChoice.text,
    verbose: o.VerboseOpt = False,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Split a safetensors checkpoint across ranks and push it into the running server.

    One rank per GPU of the inference server(s), under torchrun. Check the flags and preview
    the split on any machine first, with --dry-run.
    """
    launch = launch_info()
    out = Output(json_mode=json_output, quiet=quiet, launch=launch)
    o.use_log_format(out, log_format)
    # A dry run on a laptop plans one server group by default: a world of 1 would refuse the
    # default --inference-parallel-size 8 before the checkpoint is even looked at.
    world = resolve_world_size(launch, world_size, inference_parallel_size if dry_run else 1)

    from ckptctl.settings import RegisterMode
    from ckptctl.transfer.request import check_update_flags, resolve

    ways = check_update_flags(
        checkpoint_path=checkpoint_path,
        load_metas_file=load_metas_file,
        save_metas_file=save_metas_file,
        dry_run=dry_run,
        verify=verify,
        round_trip=verify_round_trip,
        reset_confirmed=reset_served_weights,
        engine=engine,
        world_size=world_size,
        nproc_per_node=nproc_per_node,
        under_torchrun=launch.under_torchrun,
    )
    joining = load_metas_file is not None
    request = resolve(
        (endpoint, uds, api_key, engine, inference_parallel_size),
        weight_version=weight_version,
        checkpoint_path=None if joining else str(checkpoint_path),
        checkpoint_name=checkpoint_name,
        split=split,
        register_mode=RegisterMode(register_mode.value),
        consume=consume_shm_files and not joining,
        read_threads=read_threads,
        update_method=UpdateMethod.p2p if joining else update_method,
        verify=ways,
        timeout=timeout,
        pause=pause,
    )
    if load_metas_file is not None:  # the seed script's join mode: `update.py --load-metas-file F`
        from ckptctl.cli.join import run_join_job

        o.want_trace(out, trace)
        return run_join_job(out, load_metas_file, request, allow_pickle, verbose)
    if dry_run:
        if trace is not None:
            raise UsageError("--trace goes with an update, not --dry-run")
        if save_metas_file is not None and launch.rank == 0:  # (rank 0 writes it)
            from ckptctl.metas.fileformat import check_target

            check_target(save_metas_file, "--save-metas-file")
        world_given = world_size is not None or launch.under_torchrun
        plan_dry_run(out, launch, request, world, nproc_per_node)
        if not world_given:
            out.log(
                f"dry run: planned one server group of {world} rank(s) "
                f"(--inference-parallel-size {inference_parallel_size}); give --world-size N "
                "for another world"
            )
        return None

    from ckptctl.cli._job_view import run_job_with_display
    from ckptctl.transfer.update import UpdateOptions, run_update

    o.want_trace(out, trace)

    opts = UpdateOptions(
        request=request,
        save_metas_file=str(save_metas_file) if save_metas_file else None,
        sleep_time=float(sleep_time),
        bucket_size_gb=bucket_size_gb,
        mem_fraction=mem_fraction,
        verbose=verbose,
    )
    run_job_with_display(run_update, opts, out)
    return None


def plan_dry_run(
    out: Output,
    launch: LaunchInfo,
    request: TransferRequest,
    world: int,
    nproc_flag: int | None,
) -> None:
    """The dry run: every check the real run makes before it loads anything (flags, server
    groups, --consume-shm-files), then the split and the groups, printed."""
    from ckptctl.checkpoint import plan_split, read_checkpoint
    from ckptctl.checkpoint.consume import check_consumable
    from ckptctl.cli._plan_view import show_plan
    from ckptctl.settings import RegisterMode

    servers = request.servers
    per_node = resolve_nproc_per_node(launch, nproc_flag, world)
    try:
        groups = servers.plan(world, per_node)
    except UsageError as exc:
        node_count_matters = world % servers.parallel_size == 0  # (else: the TP size is wrong)
        if nproc_flag is not None or launch.under_torchrun or not node_count_matters:
            raise
        raise UsageError(
            f"{exc} (the dry run took {per_node} ranks per node: give --nproc-per-node "
            "for another layout)"
        ) from None
    assert request.checkpoint_path is not None
    checkpoint = read_checkpoint(request.checkpoint_path)
    plan = plan_split(checkpoint, world, request.split)
    if request.register_mode is RegisterMode.consume:
        check_consumable(plan)  # (imports torch: only for --consume-shm-files)
    show_plan(out, plan, groups)


def resolve_nproc_per_node(launch: LaunchInfo, flag: int | None, world: int) -> int:
    """torchrun's LOCAL_WORLD_SIZE when there is one; otherwise --nproc-per-node (default:
    nodes of 8 GPUs, the common node, or one node for a smaller world)."""
    if launch.under_torchrun:
        if flag is not None and flag != launch.local_world_size:
            raise UsageError(
                f"--nproc-per-node {flag} conflicts with LOCAL_WORLD_SIZE="
                f"{launch.local_world_size} set by torchrun; drop --nproc-per-node"
            )
        return launch.local_world_size
    if flag is not None and world % flag:
        raise UsageError(f"--nproc-per-node {flag} does not divide --world-size {world}")
    return min(world, DRY_RUN_NODE_SIZE) if flag is None else flag

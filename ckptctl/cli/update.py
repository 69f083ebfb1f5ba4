"""`ckptctl update`: split a checkpoint across ranks, register it, push it to the server.

`--dry-run` plans the split and prints it, with no GPU, no server and no torchrun needed.
Otherwise every rank runs the pipeline in `ckptctl.pipeline.update` and rank 0 reports.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckptctl.cli._choices import EngineChoice, RegisterModeChoice, SplitChoice, UpdateMethodChoice
from ckptctl.cli._options import (
    CHECKPOINT,
    DRY_RUN,
    FLAG,
    TRANSFER,
    AllowPickleOpt,
    ApiKeyOpt,
    BucketSizeOpt,
    CheckpointNameOpt,
    CheckpointPathOrJoinOpt,
    ConsumeShmOpt,
    EndpointsOpt,
    EngineOpt,
    HelpOpt,
    InferenceParallelSizeOpt,
    JoinFromMetasOpt,
    JsonOpt,
    MemFractionOpt,
    QuietOpt,
    ReadThreadsOpt,
    RegisterModeOpt,
    ResetServedWeightsOpt,
    SleepTimeOpt,
    SplitOpt,
    TimeoutOpt,
    UdsListOpt,
    VerboseOpt,
    VerifyOpt,
    VerifyRoundTripOpt,
    WeightVersionOpt,
    at_least,
)
from ckptctl.cli._output import Output
from ckptctl.defaults import DEFAULT_CHECKPOINT_NAME, DEFAULT_ENDPOINT
from ckptctl.errors import UsageError
from ckptctl.launch import LaunchInfo, launch_info

if TYPE_CHECKING:
    from ckptctl.pipeline.groups import ServerTargets


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
    checkpoint_path: CheckpointPathOrJoinOpt = None,
    checkpoint_name: CheckpointNameOpt = DEFAULT_CHECKPOINT_NAME,
    split: SplitOpt = SplitChoice.auto,
    register_mode: RegisterModeOpt = RegisterModeChoice.direct,
    read_threads: ReadThreadsOpt = None,
    consume_shm_files: ConsumeShmOpt = False,
    save_metas_file: Annotated[
        Path | None,
        typer.Option(
            "--save-metas-file",
            metavar="FILE",
            rich_help_panel=CHECKPOINT,
            help="Also write the gathered metas to this file.",
        ),
    ] = None,
    load_metas_file: JoinFromMetasOpt = None,
    allow_pickle: AllowPickleOpt = False,
    endpoint: EndpointsOpt = [DEFAULT_ENDPOINT],  # noqa: B006 - Typer copies it; shown in --help
    uds: UdsListOpt = None,
    engine: EngineOpt = EngineChoice.sglang,
    inference_parallel_size: InferenceParallelSizeOpt = 8,
    api_key: ApiKeyOpt = None,
    weight_version: WeightVersionOpt = None,
    update_method: Annotated[
        UpdateMethodChoice,
        typer.Option(
            "--update-method",
            metavar="METHOD",
            rich_help_panel=TRANSFER,
            help="How weights reach the server's GPUs. broadcast: over NCCL from every "
            "rank; p2p: over RDMA (needs mooncake); all: both, one after the other.",
        ),
    ] = UpdateMethodChoice.broadcast,
    bucket_size_gb: BucketSizeOpt = None,
    mem_fraction: MemFractionOpt = None,
    timeout: TimeoutOpt = 600,
    sleep_time: SleepTimeOpt = 0,
    verify: VerifyOpt = False,
    verify_round_trip: VerifyRoundTripOpt = False,
    reset_served_weights: ResetServedWeightsOpt = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            metavar=FLAG,
            rich_help_panel=DRY_RUN,
            help="Only check the flags, plan the split and the server groups, and print them.",
        ),
    ] = False,
    world_size: Annotated[
        int | None,
        typer.Option(
            "--world-size",
            metavar="N",
            callback=at_least(1, 65536),
            show_default=False,
            rich_help_panel=DRY_RUN,
            help="Ranks to plan for (under torchrun: its WORLD_SIZE). Default: one server "
            "group, --inference-parallel-size ranks.",
        ),
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node",
            metavar="N",
            callback=at_least(1),
            show_default=False,
            rich_help_panel=DRY_RUN,
            help="Ranks per node, as torchrun's flag (under torchrun: its LOCAL_WORLD_SIZE). "
            f"Default: {DRY_RUN_NODE_SIZE}, or the world size if smaller.",
        ),
    ] = None,
    verbose: VerboseOpt = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    show_help: HelpOpt = False,
) -> None:
    """Split a safetensors checkpoint across ranks and push it into the running server.

    One rank per GPU of the inference server(s), under torchrun. Check the flags and preview
    the split on any machine first, with --dry-run.
    """
    launch = launch_info()
    out = Output(json_mode=json_output, quiet=quiet, launch=launch)
    # A dry run on a laptop plans one server group by default: a world of 1 would refuse the
    # default --inference-parallel-size 8 before the checkpoint is even looked at.
    world = resolve_world_size(launch, world_size, inference_parallel_size if dry_run else 1)

    if load_metas_file is not None and (dry_run or save_metas_file is not None):
        raise UsageError(
            "--load-metas-file (join) goes with neither --dry-run nor --save-metas-file"
        )
    if load_metas_file is None and checkpoint_path is None:
        raise UsageError("--checkpoint-path is required (or --load-metas-file, to join)")
    from ckptctl.verify import requested

    verify_how = requested(
        verify=verify,
        round_trip=verify_round_trip,
        reset_confirmed=reset_served_weights,
        engine=engine.value,
    )
    if verify_how is not None and dry_run:
        raise UsageError("--verify and --verify-round-trip go with an update, not --dry-run")
    if verify_how == "round-trip" and load_metas_file is not None:
        raise UsageError("--verify-round-trip goes with an update from files, not a join")
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
            verify=verify,
            verbose=verbose,
            json_output=json_output,
            quiet=quiet,
        )
    assert checkpoint_path is not None
    if not dry_run and not launch.under_torchrun:
        for flag, value in (("--world-size", world_size), ("--nproc-per-node", nproc_per_node)):
            if value is not None:
                raise UsageError(
                    f"{flag} only goes with --dry-run: start one rank per GPU with torchrun"
                )
    from ckptctl.pipeline.groups import ServerTargets

    servers = ServerTargets.from_flags(
        endpoints=endpoint,
        uds=uds,
        api_key=api_key,
        engine=engine.value,
        parallel_size=inference_parallel_size,
        weight_version=weight_version,
    )
    mode = "consume" if consume_shm_files else register_mode.value
    if dry_run:
        world_given = world_size is not None or launch.under_torchrun
        plan_dry_run(
            out, launch, servers, checkpoint_path, split.value, mode, world, nproc_per_node
        )
        if not world_given:
            out.log(
                f"dry run: planned one server group of {world} rank(s) "
                f"(--inference-parallel-size {inference_parallel_size}); give --world-size N "
                "for another world"
            )
        return None

    from ckptctl.cli._job_view import run_job_with_display
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
        register_mode=mode,
        read_threads=read_threads,
        verify=verify_how,
        verbose=verbose,
    )
    run_job_with_display(run_update, opts, out)
    return None


def plan_dry_run(
    out: Output,
    launch: LaunchInfo,
    servers: ServerTargets,
    checkpoint_path: Path,
    split: str,
    register_mode: str,
    world: int,
    nproc_flag: int | None,
) -> None:
    """The dry run: every check the real run makes before it loads anything (flags, server
    groups, --consume-shm-files), then the split and the groups, printed."""
    from ckptctl.checkpoint import plan_split, read_checkpoint
    from ckptctl.checkpoint.consume import check_consumable, check_consume
    from ckptctl.cli._plan_view import show_plan

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
    split = check_consume(str(checkpoint_path), register_mode, split)
    checkpoint = read_checkpoint(checkpoint_path)
    plan = plan_split(checkpoint, world, split)  # type: ignore[arg-type]
    if register_mode == "consume":
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

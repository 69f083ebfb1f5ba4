"""`ckptctl join --load-metas-file F`: pull weights from running holders (p2p) into this node's
server."""

from __future__ import annotations

from ckptctl.cli._choices import EngineChoice
from ckptctl.cli._options import (
    AllowPickleOpt,
    ApiKeyOpt,
    CheckpointNameOpt,
    EndpointsOpt,
    EngineOpt,
    HelpOpt,
    InferenceParallelSizeOpt,
    JsonOpt,
    LoadMetasFileOpt,
    QuietOpt,
    TimeoutOpt,
    UdsListOpt,
    VerboseOpt,
    VerifyOpt,
    WeightVersionOpt,
)
from ckptctl.cli._output import Output
from ckptctl.defaults import DEFAULT_CHECKPOINT_NAME, DEFAULT_ENDPOINT


def join_command(
    load_metas_file: LoadMetasFileOpt,
    checkpoint_name: CheckpointNameOpt = DEFAULT_CHECKPOINT_NAME,
    allow_pickle: AllowPickleOpt = False,
    endpoint: EndpointsOpt = [DEFAULT_ENDPOINT],  # noqa: B006 - Typer copies it; shown in --help
    uds: UdsListOpt = None,
    engine: EngineOpt = EngineChoice.sglang,
    inference_parallel_size: InferenceParallelSizeOpt = 8,
    weight_version: WeightVersionOpt = None,
    timeout: TimeoutOpt = 600,
    api_key: ApiKeyOpt = None,
    verify: VerifyOpt = False,
    verbose: VerboseOpt = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    show_help: HelpOpt = False,
) -> None:
    """Take a checkpoint from running holders over p2p and push it into this node's server.

    Needs one GPU per rank (torchrun), mooncake and RDMA here, and a metas file with p2p store
    addresses. Whatever is missing is reported (exit 3) before the server is touched.
    """
    from ckptctl.cli._job_view import run_job_with_display
    from ckptctl.pipeline.groups import ServerTargets
    from ckptctl.pipeline.metas_jobs import JoinOptions, run_join
    from ckptctl.verify import requested

    out = Output(json_mode=json_output, quiet=quiet)
    wanted = requested(verify=verify, round_trip=False, reset_confirmed=False, engine=engine.value)
    opts = JoinOptions(
        load_metas_file=str(load_metas_file),
        checkpoint_name=checkpoint_name,
        servers=ServerTargets.from_flags(
            endpoints=endpoint,
            uds=uds,
            api_key=api_key,
            engine=engine.value,
            parallel_size=inference_parallel_size,
            weight_version=weight_version,
        ),
        allow_pickle=allow_pickle,
        timeout=timeout,
        verify=wanted is not None,
        verbose=verbose,
    )
    run_job_with_display(run_join, opts, out)

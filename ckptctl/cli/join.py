"""`ckptctl join --load-metas-file F`: pull weights from running holders (p2p) into this node's
server."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ckptctl.cli._observe_options import (
    LogFormatChoice,
    LogFormatOpt,
    TraceOpt,
    use_log_format,
    want_trace,
)
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
    PauseOpt,
    QuietOpt,
    TimeoutOpt,
    UdsListOpt,
    VerboseOpt,
    VerifyOpt,
    WeightVersionOpt,
)
from ckptctl.cli._output import Output
from ckptctl.defaults import DEFAULT_CHECKPOINT_NAME, DEFAULT_ENDPOINT
from ckptctl.settings import PauseMode, ServerKind

if TYPE_CHECKING:
    from ckptctl.transfer.request import TransferRequest


def join_command(
    load_metas_file: LoadMetasFileOpt,
    checkpoint_name: CheckpointNameOpt = DEFAULT_CHECKPOINT_NAME,
    allow_pickle: AllowPickleOpt = False,
    endpoint: EndpointsOpt = [DEFAULT_ENDPOINT],  # noqa: B006 - Typer copies it; shown in --help
    uds: UdsListOpt = None,
    engine: EngineOpt = ServerKind.sglang,
    inference_parallel_size: InferenceParallelSizeOpt = 8,
    weight_version: WeightVersionOpt = None,
    pause: PauseOpt = PauseMode.none,
    timeout: TimeoutOpt = 600,
    api_key: ApiKeyOpt = None,
    verify: VerifyOpt = False,
    trace: TraceOpt = None,
    log_format: LogFormatOpt = LogFormatChoice.text,
    verbose: VerboseOpt = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    show_help: HelpOpt = False,
) -> None:
    """Take a checkpoint from running holders over p2p and push it into this node's server.

    Needs one GPU per rank (torchrun), mooncake and RDMA here, and a metas file with p2p store
    addresses. Whatever is missing is reported (exit 3) before the server is touched.
    """
    from ckptctl.settings import UpdateMethod
    from ckptctl.transfer.request import resolve, verify_ways

    ways = verify_ways(verify=verify, round_trip=False, reset_confirmed=False, engine=engine)
    request = resolve(
        (endpoint, uds, api_key, engine, inference_parallel_size),
        weight_version=weight_version,
        checkpoint_name=checkpoint_name,
        update_method=UpdateMethod.p2p,  # over p2p, from the holders
        verify=ways,
        timeout=timeout,
        pause=pause,
    )
    out = Output(json_mode=json_output, quiet=quiet)
    use_log_format(out, log_format)
    want_trace(out, trace)
    run_join_job(out, load_metas_file, request, allow_pickle, verbose)


def run_join_job(
    out: Output, metas_file: Path, request: TransferRequest, allow_pickle: bool, verbose: bool
) -> None:
    """`join`, and `update --load-metas-file`: the job itself, on this rank."""
    from ckptctl.cli._job_view import run_job_with_display
    from ckptctl.transfer.metas_jobs import JoinOptions, run_join

    opts = JoinOptions(str(metas_file), request, allow_pickle=allow_pickle, verbose=verbose)
    run_job_with_display(run_join, opts, out)

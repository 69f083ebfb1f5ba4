"""`ckptctl join --load-metas-file F`: pull weights from running holders (p2p) into this node's
server."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ckptctl.cli import _options as o
from ckptctl.cli._output import Output
from ckptctl.defaults import DEFAULT_CHECKPOINT_NAME, DEFAULT_ENDPOINT
from ckptctl.settings import PauseMode, ServerKind

if TYPE_CHECKING:
    from ckptctl.transfer.request import TransferRequest


def join_command(
    load_metas_file: o.LoadMetasFileOpt,
    checkpoint_name: o.CheckpointNameOpt = DEFAULT_CHECKPOINT_NAME,
    allow_pickle: o.AllowPickleOpt = False,
    endpoint: o.EndpointsOpt = [DEFAULT_ENDPOINT],  # noqa: B006 - Typer copies it; shown in --help
    uds: o.UdsListOpt = None,
    engine: o.EngineOpt = ServerKind.sglang,
    inference_parallel_size: o.InferenceParallelSizeOpt = 8,
    weight_version: o.WeightVersionOpt = None,
    pause: o.PauseOpt = PauseMode.none,
    timeout: o.TimeoutOpt = 600,
    api_key: o.ApiKeyOpt = None,
    verify: o.VerifyOpt = False,
    trace: o.TraceOpt = None,
    log_format: o.LogFormatOpt = o.LogFormatChoice.text,
    verbose: o.VerboseOpt = False,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
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
    o.use_log_format(out, log_format)
    o.want_trace(out, trace)
    run_join_job(out, load_metas_file, request, allow_pickle, verbose)


def run_join_job(
    out: Output, metas_file: Path, request: TransferRequest, allow_pickle: bool, verbose: bool
) -> None:
    """`join`, and `update --load-metas-file`: the job itself, on this rank."""
    from ckptctl.cli._job_view import run_job_with_display
    from ckptctl.transfer.metas_jobs import JoinOptions, run_join

    opts = JoinOptions(str(metas_file), request, allow_pickle=allow_pickle, verbose=verbose)
    run_job_with_display(run_join, opts, out)

"""`ckptctl serve` (a long-lived job under torchrun) and its clients `push` and `status`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ckptctl.cli._choices import EngineChoice, RegisterModeChoice, SplitChoice
from ckptctl.cli._options import (
    ApiKeyOpt,
    ConsumeShmOpt,
    EndpointsOpt,
    EngineOpt,
    InferenceParallelSizeOpt,
    JsonOpt,
    QuietOpt,
    ReadThreadsOpt,
    RegisterModeOpt,
    SplitOpt,
    UdsListOpt,
    VerboseOpt,
    WeightVersionOpt,
)
from ckptctl.cli._output import Output
from ckptctl.errors import DeadlineExceeded, ExitCode, OperationFailed, UsageError

ControlSocketOpt = Annotated[
    str | None,
    typer.Option(
        "--control-socket",
        help="Unix socket of the serve job's control endpoint on this node "
        "[default: /tmp/ckptctl-serve-<uid>.sock].",
        show_default=False,
    ),
]


def _socket(path: str | None) -> str:
    from ckptctl.pipeline.serve import DEFAULT_CONTROL_SOCKET

    return path or DEFAULT_CONTROL_SOCKET


def serve_command(
    endpoint: EndpointsOpt = None,
    uds: UdsListOpt = None,
    inference_parallel_size: InferenceParallelSizeOpt = 8,
    engine: EngineOpt = EngineChoice.sglang,
    api_key: ApiKeyOpt = None,
    control_socket: ControlSocketOpt = None,
    split: SplitOpt = SplitChoice.auto,
    register_mode: RegisterModeOpt = RegisterModeChoice.direct,
    read_threads: ReadThreadsOpt = None,
    push_timeout: Annotated[
        float, typer.Option("--push-timeout", min=1.0, help="Seconds one push may take.")
    ] = 600.0,
    verbose: VerboseOpt = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Keep a parameter server up on every rank and push checkpoints on command.

    Start it under torchrun like `update`; then, on the node, `ckptctl push --checkpoint-path
    DIR` pushes a checkpoint into the server(s), `ckptctl status` reports, and SIGTERM/SIGINT
    (or `POST /stop` on the control socket) ends it cleanly. A push that fails before the
    server's workers connect (bad checkpoint, server down or refusing) leaves the job serving;
    one that fails after they connected ends it.
    """
    from ckptctl.cli._job_view import run_job_with_display
    from ckptctl.pipeline.groups import ServerTargets
    from ckptctl.pipeline.serve import ServeOptions, run_serve

    out = Output(json_mode=json_output, quiet=quiet)
    opts = ServeOptions(
        servers=ServerTargets.from_flags(
            endpoints=endpoint,
            uds=uds,
            api_key=api_key,
            engine=engine.value,
            parallel_size=inference_parallel_size,
            weight_version=None,
        ),
        control_socket=_socket(control_socket),
        split=split.value,
        register_mode=register_mode.value,
        read_threads=read_threads,
        push_timeout=push_timeout,
        verbose=verbose,
    )
    run_job_with_display(run_serve, opts, out)


def _call(path: str, method: str, route: str, body: dict[str, Any] | None, timeout: float) -> Any:
    import httpx

    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=timeout) as client:
            response = client.request(method, f"http://serve{route}", json=body)
    except httpx.TimeoutException:
        raise DeadlineExceeded(
            f"the serve job on {path} did not answer within {timeout:g}s"
        ) from None
    except httpx.HTTPError:
        raise OperationFailed(
            f"no serve job answers on {path}: start one with `torchrun ... ckptctl serve`"
        ) from None
    doc = response.json()
    if response.status_code != 200:
        raise UsageError(f"the serve job refused: {doc.get('error', response.text)}")
    return doc


def push_command(
    checkpoint_path: Annotated[
        Path,
        typer.Option("--checkpoint-path", help="Checkpoint directory to push.", show_default=False),
    ],
    weight_version: WeightVersionOpt = None,
    checkpoint_name: Annotated[
        str | None, typer.Option("--checkpoint-name", help="Name to register it under.")
    ] = None,
    control_socket: ControlSocketOpt = None,
    consume_shm_files: ConsumeShmOpt = False,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1.0, help="Seconds to wait for the push (exit 4).")
    ] = 900.0,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Push a checkpoint through a running `ckptctl serve` job on this node."""
    out = Output(json_mode=json_output, quiet=quiet)
    doc = _call(
        _socket(control_socket),
        "POST",
        "/push",
        {
            "checkpoint_path": str(checkpoint_path.resolve()),
            "weight_version": weight_version,
            "checkpoint_name": checkpoint_name,
            "consume_shm_files": consume_shm_files,
        },
        timeout,
    )
    if json_output:
        out.result(doc)
    if not doc.get("ok"):
        code = int(doc.get("exit_code") or ExitCode.FAILED)
        error = doc.get("error") or "the push failed"
        if code == ExitCode.INVALID_INPUT:
            from ckptctl.errors import InvalidInput

            raise InvalidInput(error)
        raise (DeadlineExceeded if code == ExitCode.TIMEOUT else OperationFailed)(error)
    out.log(f"pushed {checkpoint_path} (command {doc['seq']})")


def status_command(
    control_socket: ControlSocketOpt = None,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Show what a running `ckptctl serve` job on this node holds and did last."""
    out = Output(json_mode=json_output, quiet=quiet)
    doc = _call(_socket(control_socket), "GET", "/status", None, 10.0)
    if json_output:
        out.result(doc)
        return
    last = doc.get("last") or {}
    out.show(
        f"{doc['state']}, {doc['world_size']} rank(s), {doc['commands']} command(s); "
        f"registered: {doc.get('registered') or '-'}; last: "
        + ("-" if not last else ("ok" if last.get("ok") else f"failed: {last.get('error')}"))
    )

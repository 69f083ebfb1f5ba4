"""`ckptctl serve` (a long-lived job under torchrun) and its clients `push`, `status`, `stop`.

The clients talk to the job's control socket on this node (ckptctl.pipeline.serve.control):
`--control-socket PATH`, else the socket of the job that feeds `--endpoint`/`--uds`, else the
only serve job of this user on the node.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer

from ckptctl.cli._choices import EngineChoice, RegisterModeChoice, SplitChoice
from ckptctl.cli._options import (
    SERVE_JOB,
    WAITING,
    ApiKeyOpt,
    BucketSizeOpt,
    CheckpointPathOpt,
    ConsumeShmOpt,
    ControlSocketOpt,
    EndpointsOpt,
    EngineOpt,
    HelpOpt,
    InferenceParallelSizeOpt,
    JsonOpt,
    MemFractionOpt,
    PushTimeoutOpt,
    QuietOpt,
    ReadThreadsOpt,
    RegisterModeOpt,
    SplitOpt,
    UdsListOpt,
    VerboseOpt,
    VerifyOpt,
    WeightVersionOpt,
    at_least,
)
from ckptctl.cli._output import Output
from ckptctl.defaults import CONTROL_SOCKET_ENV, ENDPOINT_ENV, UDS_ENV
from ckptctl.errors import (
    redact,
)


def _which_job(name: str, metavar: str, envvar: str, help: str) -> Any:
    """A client's flag that says which serve job on this node to talk to."""
    return typer.Option(
        name,
        metavar=metavar,
        envvar=envvar,
        show_envvar=True,
        show_default=False,
        rich_help_panel=SERVE_JOB,
        help=help,
    )


JobSocketOpt = Annotated[
    str | None,
    _which_job(
        "--control-socket",
        "PATH",
        CONTROL_SOCKET_ENV,
        "The serve job's control socket. Default: that of the job feeding --endpoint, or "
        "your only serve job on this node.",
    ),
]
FindEndpointOpt = Annotated[
    list[str] | None,
    _which_job(
        "--endpoint",
        "URL",
        ENDPOINT_ENV,
        "Talk to the serve job that feeds this server (where several run here).",
    ),
]
FindUdsOpt = Annotated[
    list[str] | None,
    _which_job(
        "--uds",
        "PATH",
        UDS_ENV,
        "Talk to the serve job that feeds the server on this Unix socket.",
    ),
]
WaitOpt = Annotated[
    float,
    typer.Option(
        "--wait",
        metavar="SECONDS",
        callback=at_least(0),
        rich_help_panel=WAITING,
        help="Wait up to this many seconds for the serve job to answer (it starts for a while "
        "after `serve &`); exit 4 if it does not.",
    ),
]


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
    push_timeout: PushTimeoutOpt = 600,
    bucket_size_gb: BucketSizeOpt = None,
    mem_fraction: MemFractionOpt = None,
    verbose: VerboseOpt = False,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    show_help: HelpOpt = False,
) -> None:
    """Keep a parameter server up on every rank and push checkpoints on command.

    Start it under torchrun like `update`; then, on the node, `ckptctl push --checkpoint-path
    DIR` pushes a checkpoint into the server(s), `ckptctl status` reports, and `ckptctl stop`
    (or SIGTERM/SIGINT to any rank) ends it cleanly. Commands come only from your own user,
    through the control socket; a push that fails leaves the job serving, unless its transfer
    broke off in a way only ending the job can clear.
    """
    from ckptctl.cli._job_view import run_job_with_display
    from ckptctl.pipeline.groups import ServerTargets
    from ckptctl.pipeline.serve.run import ServeOptions, run_serve

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
        control_socket=control_socket,
        split=split.value,
        register_mode=register_mode.value,
        read_threads=read_threads,
        push_timeout=push_timeout,
        bucket_size_gb=bucket_size_gb,
        mem_fraction=mem_fraction,
        verbose=verbose,
    )
    run_job_with_display(run_serve, opts, out)


def push_command(
    checkpoint_path: CheckpointPathOpt,
    weight_version: WeightVersionOpt = None,
    checkpoint_name: Annotated[
        str | None,
        typer.Option(
            "--checkpoint-name",
            metavar="NAME",
            rich_help_panel="Checkpoint",
            help="Name to register it under (default: push-N).",
        ),
    ] = None,
    consume_shm_files: ConsumeShmOpt = False,
    verify: VerifyOpt = False,
    control_socket: JobSocketOpt = None,
    endpoint: FindEndpointOpt = None,
    uds: FindUdsOpt = None,
    wait: WaitOpt = 0,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            callback=at_least(1),
            rich_help_panel=WAITING,
            help="Seconds to wait for the push's answer (exit 4); the serve job bounds each "
            "push by its own --push-timeout.",
        ),
    ] = 900,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    show_help: HelpOpt = False,
) -> None:
    """Push a checkpoint through a running `ckptctl serve` job on this node."""
    from ckptctl import client

    out = Output(json_mode=json_output, quiet=quiet)
    doc = client.push(
        checkpoint_path,
        weight_version=weight_version,
        checkpoint_name=checkpoint_name,
        consume_shm_files=consume_shm_files,
        verify=verify,
        control_socket=control_socket,
        endpoint=endpoint or (),
        uds=uds or (),
        wait=wait,
        timeout=timeout,
        check=False,
    )
    if json_output:
        out.result(doc)
    client.raise_if_failed(doc)
    out.log(
        f"pushed {checkpoint_path} (push {doc['seq']}, {doc.get('seconds') or 0:.2f}s; "
        f"server weights: {doc.get('server_weights')}"
        + (f"; verified: {doc['verified']})" if doc.get("verified") else ")")
    )


def status_command(
    control_socket: JobSocketOpt = None,
    endpoint: FindEndpointOpt = None,
    uds: FindUdsOpt = None,
    wait: WaitOpt = 0,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    show_help: HelpOpt = False,
) -> None:
    """Show what a running `ckptctl serve` job on this node holds and did last."""
    from ckptctl import client

    out = Output(json_mode=json_output, quiet=quiet)
    doc = client.status(
        control_socket=control_socket, endpoint=endpoint or (), uds=uds or (), wait=wait
    )
    if json_output:
        out.result({**doc, "exit_code": 0, "error": None})
        return
    out.show("\n".join(describe_status(doc, doc["control_socket"])))


def stop_command(
    control_socket: JobSocketOpt = None,
    endpoint: FindEndpointOpt = None,
    uds: FindUdsOpt = None,
    wait: Annotated[
        float,
        typer.Option(
            "--wait",
            metavar="SECONDS",
            callback=at_least(0),
            rich_help_panel=WAITING,
            help="Wait up to this many seconds until the job has stopped serving; exit 4 if not.",
        ),
    ] = 0,
    json_output: JsonOpt = False,
    quiet: QuietOpt = False,
    show_help: HelpOpt = False,
) -> None:
    """Stop a running `ckptctl serve` job on this node: every rank ends cleanly.

    A push under way finishes first; pushes still waiting fail.
    """
    from ckptctl import client

    out = Output(json_mode=json_output, quiet=quiet)
    path = client.stop(
        control_socket=control_socket, endpoint=endpoint or (), uds=uds or (), wait=wait
    )
    if json_output:
        out.result(
            {
                "ok": True,
                "exit_code": 0,
                "error": None,
                "control_socket": path,
                "stopped": bool(wait),
            }
        )
    else:
        out.log(f"{'stopped' if wait else 'stopping'} the serve job on {path}")


def _ago(stamp: str | None) -> str:
    import calendar

    if not stamp:
        return ""
    try:
        then = calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return stamp
    return f"{stamp} ({max(time.time() - then, 0):.0f}s ago)"


def describe_status(doc: dict[str, Any], path: str) -> list[str]:
    """The human view of `status`: the job, the server's weights, the last push."""
    rank = doc.get("rank", 0)
    lines = [
        f"serve job: {doc.get('state')}, {doc.get('world_size')} rank(s), "
        f"{doc.get('commands')} push(es) done, {doc.get('queued') or 0} waiting; "
        f"control socket {path}"
        + (
            ""
            if doc.get("takes_push", True)
            else f" (rank {rank}'s node: push on {doc.get('push_host')})"
        )
    ]
    targets = doc.get("targets") or []
    if targets:
        lines.append(f"servers: {redact(', '.join(targets))}")
    weights = doc.get("weights") or {}
    state = doc.get("server_weights")
    if state is None:
        lines.append("server weights: not pushed yet (the server's own)")
    else:
        what = (
            f"push {weights.get('seq')}: {weights.get('checkpoint_path')}"
            + (
                f", weight version {weights['weight_version']}"
                if weights.get("weight_version")
                else ""
            )
            + f", at {_ago(weights.get('pushed_at'))}"
            if weights
            else "-"
        )
        if state == "whole":
            lines.append(f"server weights: whole, from {what}")
        else:
            lines.append(
                "server weights: PARTIAL - a push broke off after the server's workers "
                f"connected; push a whole checkpoint again (last whole set: {what})"
            )
    last = doc.get("last")
    if last:
        head = f"last push {last.get('seq')}: {last.get('checkpoint_path')}"
        if last.get("ok"):
            size = last.get("total_bytes") or 0
            secs = float(last.get("seconds") or 0)
            rate = f", {size / secs / 1e9:.2f} GB/s" if size and secs > 0 else ""
            lines.append(
                f"{head}: ok in {secs:.2f}s ({size / 1e9:.2f} GB{rate}), at {_ago(last.get('finished_at'))}"
            )
        else:
            lines.append(f"{head}: failed (exit {last.get('exit_code')}): {last.get('error')}")
    if doc.get("registered"):
        lines.append(f"registered: {doc['registered']}")
    return lines

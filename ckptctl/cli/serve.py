"""`ckptctl serve` (a long-lived job under torchrun) and its clients `push`, `status`, `stop`.

The clients talk to the job's control socket on this node (ckptctl.serve.control_client):
`--control-socket PATH`, else the socket of the job that feeds `--endpoint`/`--uds`, else the
only serve job of this user on the node.
"""

from __future__ import annotations

import functools
import time
from typing import Annotated, Any

import typer

from ckptctl.cli import _options as o
from ckptctl.cli._output import Output
from ckptctl.defaults import DEFAULT_ENDPOINT, PUSH_LOG_SIZE
from ckptctl.errors import CkptctlError, UsageError, log_line, redact
from ckptctl.settings import PauseMode, ServerKind, Setting, SplitMode


def serve_command(
    endpoint: o.EndpointsOpt = [DEFAULT_ENDPOINT],  # noqa: B006 - Typer copies it; shown in --help
    uds: o.UdsListOpt = None,
    inference_parallel_size: o.InferenceParallelSizeOpt = 8,
    engine: o.EngineOpt = ServerKind.sglang,
    api_key: o.ApiKeyOpt = None,
    pause: o.PauseOpt = PauseMode.none,
    control_socket: o.ControlSocketOpt = None,
    split: o.SplitOpt = SplitMode.auto,
    register_mode: o.RegisterModeOpt = o.RegisterModeChoice.direct,
    read_threads: o.ReadThreadsOpt = None,
    push_timeout: o.PushTimeoutOpt = 600,
    server_wait: Annotated[
        float,
        typer.Option(
            "--server-wait",
            metavar="SECONDS",
            callback=o.at_least(0),
            rich_help_panel=o.WAITING,
            help="How long a push waits for a server that does not answer (down, restarting) "
            "before it fails with exit 1; the job goes on. The first push waits "
            "--server-start-wait instead.",
        ),
    ] = 30,
    server_start_wait: Annotated[
        float,
        typer.Option(
            "--server-start-wait",
            metavar="SECONDS",
            callback=o.at_least(0),
            rich_help_panel=o.WAITING,
            help="How long the first push waits for a server that is starting (loading its "
            "model, capturing CUDA graphs) before it fails with exit 1; a wrong --endpoint "
            "shows here. At most --push-timeout.",
        ),
    ] = 300,
    no_restore: Annotated[
        bool,
        typer.Option(
            "--no-restore",
            metavar=o.FLAG,
            rich_help_panel=o.TRANSFER,
            help="After a push that failed once the server had begun taking its weights, do "
            "not push the last whole checkpoint again (the server is left partly updated).",
        ),
    ] = False,
    bucket_size_gb: o.BucketSizeOpt = None,
    mem_fraction: o.MemFractionOpt = None,
    drop_page_cache: Annotated[
        bool,
        typer.Option(
            "--drop-page-cache",
            metavar=o.FLAG,
            rich_help_panel="Checkpoint",
            help="Drop each pushed checkpoint's pages from the page cache once read into "
            "pinned memory (else the node holds it twice). Needs --register-mode direct.",
        ),
    ] = False,
    metrics_port: o.MetricsPortOpt = None,
    metrics_host: o.MetricsHostOpt = "127.0.0.1",
    log_format: o.LogFormatOpt = o.LogFormatChoice.text,
    verbose: o.VerboseOpt = False,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Keep a parameter server up on every rank and push checkpoints on command.

    Start it under torchrun like `update`; then, on the node, `ckptctl push --checkpoint-path
    DIR` pushes a checkpoint into the server(s), `ckptctl status` reports, and `ckptctl stop`
    (or SIGTERM/SIGINT to any rank) ends it within seconds, cancelling a push under way; a
    second signal ends it at once. Commands come only from your own user, through the control
    socket. A push that fails leaves the job serving; one that fails after the server began
    taking its weights is followed by a push of the last whole checkpoint (its files
    unchanged), so that the server ends whole on the previous version.
    """
    from ckptctl.cli._job_view import run_job_with_display
    from ckptctl.serve.run import run_serve
    from ckptctl.serve.state import ServeOptions
    from ckptctl.settings import RegisterMode
    from ckptctl.transfer.request import resolve

    if metrics_port is not None:
        from ckptctl.observe.metrics import missing_package

        if missing_package():
            raise UsageError(str(missing_package()))
    request = resolve(
        (endpoint, uds, api_key, engine, inference_parallel_size),
        split=split,
        register_mode=RegisterMode(register_mode.value),
        read_threads=read_threads,
        timeout=push_timeout,
        timeout_setting=Setting.push_timeout,
        drop_page_cache=drop_page_cache,
        pause=pause,
    )
    out = Output(json_mode=json_output, quiet=quiet)
    o.use_log_format(out, log_format)
    opts = ServeOptions(
        request=request,
        control_socket=control_socket,
        server_wait=server_wait,
        server_start_wait=server_start_wait,
        restore=not no_restore,
        bucket_size_gb=bucket_size_gb,
        mem_fraction=mem_fraction,
        verbose=verbose,
        drop_page_cache=drop_page_cache,
        metrics=(metrics_host, metrics_port) if metrics_port is not None else None,
    )
    run_job_with_display(run_serve, opts, out)


AllowLayoutChangeOpt = Annotated[
    bool,
    typer.Option(
        "--allow-layout-change",
        metavar=o.FLAG,
        rich_help_panel="Checkpoint",
        help="Take it even if its tensor names, dtypes or shapes differ from those the job "
        "served last (refused with exit 3 otherwise, before anything is sent).",
    ),
]


def push_command(
    checkpoint_path: o.CheckpointPathOpt,
    weight_version: o.WeightVersionOpt = None,
    checkpoint_name: o.PushNameOpt = None,
    consume_shm_files: o.ConsumeShmOpt = False,
    verify: o.VerifyOpt = False,
    allow_layout_change: AllowLayoutChangeOpt = False,
    pause: o.PushPauseOpt = None,
    control_socket: o.JobSocketOpt = None,
    endpoint: o.FindEndpointOpt = None,
    uds: o.FindUdsOpt = None,
    wait: o.WaitOpt = 0,
    timeout: o.ClientTimeoutOpt = 900,
    trace: o.TraceOpt = None,
    log_format: o.LogFormatOpt = o.LogFormatChoice.text,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Push a checkpoint through a running `ckptctl serve` job on this node.

    While it runs, the job's progress shows on stderr (its stage, bytes and rate; a line every
    10 s when stderr is not a terminal). Ctrl-C cancels the push: the job ends its transfer
    and, if the server had begun taking the weights, pushes the last whole checkpoint again.
    """
    from ckptctl import client

    run_command(
        functools.partial(
            client.push,
            checkpoint_path,
            weight_version=weight_version,
            checkpoint_name=checkpoint_name,
            consume_shm_files=consume_shm_files,
            verify=verify,
            allow_layout_change=allow_layout_change,
            trace=trace,
            pause=pause,
        ),
        _client_output(json_output, quiet, log_format),
        _which_job_kwargs(control_socket, endpoint, uds, wait),
        timeout,
    )


def stage_command(
    checkpoint_path: o.CheckpointPathOpt,
    allow_layout_change: AllowLayoutChangeOpt = False,
    control_socket: o.JobSocketOpt = None,
    endpoint: o.FindEndpointOpt = None,
    uds: o.FindUdsOpt = None,
    wait: o.WaitOpt = 0,
    timeout: o.ClientTimeoutOpt = 900,
    log_format: o.LogFormatOpt = o.LogFormatChoice.text,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Read a checkpoint ahead, for the next push of it to send without reading it.

    The job plans it and starts reading it into a second set of pinned host buffers (one more
    share of pinned memory on each rank) while the server keeps its weights, and answers at
    once; `status` shows how far the read got. The next `push` of the same path, if its files
    have not changed since, takes the buffers; a push of another checkpoint drops them.
    Needs serve --register-mode direct (the default).
    """
    from ckptctl import client

    run_command(
        functools.partial(client.stage, checkpoint_path, allow_layout_change=allow_layout_change),
        _client_output(json_output, quiet, log_format),
        _which_job_kwargs(control_socket, endpoint, uds, wait),
        timeout,
    )


def rollback_command(
    control_socket: o.JobSocketOpt = None,
    endpoint: o.FindEndpointOpt = None,
    uds: o.FindUdsOpt = None,
    wait: o.WaitOpt = 0,
    timeout: o.ClientTimeoutOpt = 900,
    log_format: o.LogFormatOpt = o.LogFormatChoice.text,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Push the whole checkpoint before the last one again, with its weight version.

    Refused with exit 3 when the job has pushed fewer than two whole checkpoints, or when that
    checkpoint's files changed since it was pushed (sizes, mtimes and ctimes, headers).
    """
    from ckptctl import client

    run_command(
        client.rollback,
        _client_output(json_output, quiet, log_format),
        _which_job_kwargs(control_socket, endpoint, uds, wait),
        timeout,
    )


def _client_output(json_output: bool, quiet: bool, log_format: o.LogFormatChoice) -> Output:
    """A client command's output; --log-format json: its progress and error lines on stderr
    as JSON objects, as the job's own are."""
    out = Output(json_mode=json_output, quiet=quiet)
    o.use_log_format(out, log_format)
    return out


def _which_job_kwargs(
    control_socket: str | None, endpoint: list[str] | None, uds: list[str] | None, wait: float
) -> dict[str, Any]:
    """The client's arguments that find the job, its messages naming the CLI's flags."""
    from ckptctl.serve.control_client import FLAGS

    return {
        "control_socket": control_socket,
        "endpoint": endpoint or (),
        "uds": uds or (),
        "wait": wait,
        "names": FLAGS,
    }


def run_command(send: Any, out: Output, job: dict[str, Any], timeout: float) -> None:
    """Find the job, send it a push, stage or rollback (`send`: ckptctl.client's, its own
    arguments bound) with a push id of its own, show its progress while it runs, cancel it on
    Ctrl-C, then report its answer (stdout: the result)."""
    import secrets

    from ckptctl import client
    from ckptctl.errors import Interrupted
    from ckptctl.serve.control_client import FLAGS

    started = time.monotonic()
    path = client.find_job(**job | {"wait": min(job["wait"], timeout)})
    push_id = secrets.token_hex(8)
    progress = PushProgress(out)
    try:
        doc = send(
            control_socket=path,
            timeout=max(timeout - (time.monotonic() - started), 0.1),
            check=False,
            names=FLAGS,
            on_progress=progress.show,
            push_id=push_id,
        )
    except (KeyboardInterrupt, Interrupted):
        progress.clear()
        doc = _cancel(out, path, push_id)
    progress.clear()
    if out.json_mode:
        out.result(doc, ok=bool(doc.get("ok")))
    trace = doc.get("trace") or {}
    if trace.get("error"):
        out.warn(f"no trace written: {trace['error']}")
    elif trace:
        out.log(f"trace: {trace['path']} ({trace.get('events')} events)")
    client.raise_if_failed(doc)
    if doc.get("action") == "stage":
        from ckptctl.progress import format_bytes

        out.show(
            f"staged {doc.get('checkpoint_path')} (command {doc['seq']}: reading "
            f"{format_bytes(doc.get('total_bytes') or 0)} ahead; the server's weights are "
            "unchanged until it is pushed)"
        )
        return
    verified = f"; verified: {doc['verified']}" if doc.get("verified") else ""
    if any(r.get("staged") for r in doc.get("ranks") or []):
        verified += "; read ahead by stage"
    what = "rolled back to push {restores}".format(**doc) if doc.get("restores") else "pushed"
    out.show(
        f"{what} {doc.get('checkpoint_path')} (push {doc['seq']}, {doc.get('wall_s') or 0:.2f}s; "
        f"server weights: {doc.get('server_weights')}{verified})"
    )


def _cancel(out: Output, path: str, push_id: str) -> dict[str, Any]:
    """Ctrl-C on `push`: the job gives the push up; its answer, once the job has one."""
    from ckptctl import client
    from ckptctl.errors import ExitCode

    out.log("interrupted: cancelling the push in the serve job...")
    try:
        answer = client.cancel(push_id, control_socket=path)
        if answer.get("cancel") == "cancelled":
            return {**answer, "ok": False, "exit_code": int(ExitCode.INTERRUPTED),
                    "error": f"push {answer.get('seq')} cancelled before it started: the "
                    "server's weights are unchanged"}  # fmt: skip
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            doc = client.status(control_socket=path)
            for last in (doc.get("last") or {}, doc.get("last_refused") or {}):
                if last.get("push_id") == push_id:  # its answer: cancelled, or over before that
                    return _says_the_weights(dict(last))
            time.sleep(0.2)
    except CkptctlError as exc:
        reason = f" ({exc})"
    else:
        reason = f": it did not end within {CANCEL_WAIT_S:g}s"
    return {"ok": False, "exit_code": int(ExitCode.INTERRUPTED),
            "error": f"interrupted; the push may still be ending in the serve job{reason} "
            f"(see ckptctl status --control-socket {path})"}  # fmt: skip


CANCEL_WAIT_S = 20.0  # a cancelled push's transfer ends, then the server is restored


def _says_the_weights(answer: dict[str, Any]) -> dict[str, Any]:
    """A push cancelled before any bucket reached the server (server_weights null) says that
    the server kept its weights; one cancelled later says so already (restored, or partial)."""
    error = str(answer.get("error") or "")
    if not answer.get("ok") and answer.get("server_weights") is None and "weights" not in error:
        answer["error"] = f"{error}; the server's weights are unchanged"
    return answer


class PushProgress:
    """What the job says of the push under way, on stderr: one line redrawn on a terminal;
    elsewhere a line when the stage changes or every PushProgress.EVERY_S seconds."""

    EVERY_S = 10.0

    def __init__(self, out: Output) -> None:
        self.out = out
        self._shown = ("", 0.0)
        self._drawn = False

    def show(self, running: dict[str, Any]) -> None:
        if self.out.quiet or self.out.json_mode and not self.out.err.is_terminal:
            return
        line = describe_running(running)
        if self.out.err.is_terminal:
            width = max(self.out.err.width - 1, 20)
            self.out.err.file.write("\r\x1b[2K" + log_line(line)[:width])
            self.out.err.file.flush()
            self._drawn = True
            return
        stage, when = self._shown
        now = time.monotonic()
        if running.get("stage") != stage or now - when >= self.EVERY_S:
            self._shown = (str(running.get("stage")), now)
            self.out.log(line)

    def clear(self) -> None:
        if self._drawn:
            self.out.err.file.write("\r\x1b[2K")
            self.out.err.file.flush()
            self._drawn = False


def describe_running(running: dict[str, Any]) -> str:
    """One line for the command under way, as `status` reports it."""
    from ckptctl.progress import format_bytes

    head = f"{running.get('action') or 'push'} {running.get('seq')}"
    label = running.get("label")
    if not label:
        return f"{head}: starting"
    text = f"{head}: {label}"
    if running.get("bytes"):
        text += (
            f", {format_bytes(running.get('bytes_done') or 0)} of {format_bytes(running['bytes'])}"
        )
        if running.get("bytes_per_s"):
            text += (
                f" ({format_bytes(running['bytes_per_s'])}/s, eta {running.get('eta_s', 0):.0f}s)"
            )
    if running.get("detail"):
        text += f" - {running['detail']}"
    return text


def status_command(
    control_socket: o.JobSocketOpt = None,
    endpoint: o.FindEndpointOpt = None,
    uds: o.FindUdsOpt = None,
    wait: o.WaitOpt = 0,
    timeout: o.ClientTimeoutOpt = 30,
    history: Annotated[
        bool,
        typer.Option(
            "--history",
            metavar=o.FLAG,
            rich_help_panel=o.OUTPUT,
            help="List the job's pushes instead, oldest first: number, checkpoint, weight "
            "version, outcome, seconds, bytes, when, and the server's weights after it. The job "
            f"keeps its last {PUSH_LOG_SIZE} pushes; with --json, `pushes` beside the status.",
        ),
    ] = False,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Show what a running `ckptctl serve` job on this node holds and did last (--history:
    every push it ran)."""
    from ckptctl import client

    out = Output(json_mode=json_output, quiet=quiet)
    which = _which_job_kwargs(control_socket, endpoint, uds, wait)
    doc = client.status(**which, timeout=timeout, history=history)
    if json_output:
        out.result(doc)
    elif history and not out.out.is_terminal:  # (piped: a line per push, values whole)
        from ckptctl.cli._job_view import history_rows

        out.show_rows(history_rows(doc))
    elif history:
        from ckptctl.cli._job_view import history_table

        out.show(history_table(doc), wrap=True)
    else:
        for line in describe_status(doc, doc["control_socket"]):
            out.show(line)  # (each a line of its own: a path's line break is shown as \n)


def stop_command(
    control_socket: o.JobSocketOpt = None,
    endpoint: o.FindEndpointOpt = None,
    uds: o.FindUdsOpt = None,
    wait: o.WaitOpt = 0,
    timeout: o.ClientTimeoutOpt = 30,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Stop a running `ckptctl serve` job on this node, and wait until every rank has ended
    (within seconds; exit 4 if it still answers at --timeout).

    A push under way is cancelled (its transfer ended, the server restored to the last whole
    checkpoint where it can be within the job's last seconds); pushes still waiting fail.
    """
    from ckptctl import client

    out = Output(json_mode=json_output, quiet=quiet)
    doc = client.stop(**_which_job_kwargs(control_socket, endpoint, uds, wait), timeout=timeout)
    if json_output:
        out.result(doc)
    else:
        out.show(f"stopped: the serve job on {doc['control_socket']}")


def _runs(doc: dict[str, Any]) -> str:
    """The commands the job ran (pushes, stages, rollbacks): how many ended ok, how many failed."""
    done, failed = int(doc.get("commands") or 0), int(doc.get("failed") or 0)
    return f"{done} command(s) run: {done - failed} ok, {failed} failed"


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
    from ckptctl.progress import format_bytes
    from ckptctl.results import outcome

    rank = doc.get("rank", 0)
    lines = [
        f"serve job: {doc.get('state')}, {doc.get('world_size')} rank(s), "
        f"{_runs(doc)}, "
        f"{doc.get('queued') or 0} waiting; "
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
    paused = doc.get("paused")
    if paused:
        how = "LEFT PAUSED (its resume failed)" if paused.get("resume_failed") else "paused"
        lines.append(
            f"generation {how} ({paused.get('mode')}) since {_ago(paused.get('since'))}: "
            + redact(", ".join(paused.get("servers") or []))
        )
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
    running = doc.get("running")
    if running:
        lines.append(f"now: {describe_running(running)}")
    # The last command that ran, and after it the last one refused before sending, if later.
    last, refused = doc.get("last"), doc.get("last_refused")
    if refused and last and int(refused.get("seq") or 0) < int(last.get("seq") or 0):
        refused = None
    for shown in (last, refused):
        if not shown:
            continue
        head = (
            f"last {shown.get('action') or 'push'} {shown.get('seq')}: "
            f"{shown.get('checkpoint_path')}"
        )
        if shown.get("ok"):
            size = shown.get("total_bytes") or 0
            secs = float(shown.get("wall_s") or shown.get("seconds") or 0)
            moved = size and secs > 0 and shown.get("action") != "stage"  # (a stage only plans)
            rate = f", {format_bytes(size / secs)}/s" if moved else ""
            lines.append(
                f"{head}: ok in {secs:.2f}s ({format_bytes(size)}{rate}), "
                f"at {_ago(shown.get('finished_at'))}"
            )
        else:
            how = outcome(shown)  # (as --history says it: cancelled, refused before sending...)
            how = "failed, restored" if how == "restored" else how
            lines.append(f"{head}: {how} (exit {shown.get('exit_code')}): {shown.get('error')}")
    staged = doc.get("staged")
    if staged:
        read = (
            f"failed: {staged['error']}"
            if staged.get("error")
            else "read"
            if staged.get("read")
            else f"{format_bytes(staged.get('bytes_read', 0))} of "
            f"{format_bytes(staged.get('share_bytes', 0))} read"
        )
        lines.append(
            f"staged for the next push: {staged.get('checkpoint_path')} (stage "
            f"{staged.get('seq')}; rank {rank}'s share {read})"
        )
    if doc.get("registered"):
        lines.append(f"registered: {doc['registered']}")
    if doc.get("served_tensors"):
        lines.append(
            f"served layout: {doc['served_tensors']} tensors (a push of other names, dtypes or "
            "shapes is refused without --allow-layout-change)"
        )
    return lines

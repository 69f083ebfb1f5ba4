"""`ckptctl wait-ready`: block until the inference server is up (for shell scripts)."""

from __future__ import annotations

import contextlib
from typing import Annotated

import typer

from ckptctl.cli import _options as o
from ckptctl.cli._errors import raise_if_interrupted
from ckptctl.cli._output import Output
from ckptctl.defaults import DEFAULT_ENDPOINT
from ckptctl.errors import DeadlineExceeded, redact
from ckptctl.settings import ReadyCondition, ServerKind

# Without a terminal, a line at least this often while nothing changes, so that a log shows
# the wait is alive (one attempt takes at most --attempt-timeout, so at most that long if more).
HEARTBEAT_S = 10.0


def wait_ready_command(
    endpoint: o.EndpointOpt = DEFAULT_ENDPOINT,
    uds: o.UdsOpt = None,
    engine: o.EngineOpt = ServerKind.sglang,
    api_key: o.ApiKeyOpt = None,
    for_: Annotated[
        ReadyCondition,
        typer.Option(
            "--for",
            metavar="STATE",
            rich_help_panel=o.WAITING,
            help="listening: the server answers HTTP at all (SGLang's 503 while it waits for "
            "its first weights counts); healthy: its health endpoint answers 200.",
        ),
    ] = ReadyCondition.listening,
    weight_version: Annotated[
        str | None,
        typer.Option(
            "--weight-version",
            metavar="VERSION",
            rich_help_panel=o.WAITING,
            help="Also wait until the server reports this weight version (SGLang only).",
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            callback=o.at_least(0),
            rich_help_panel=o.WAITING,
            help="Give up after this many seconds (exit 4).",
        ),
    ] = 300,
    interval: Annotated[
        float,
        typer.Option(
            "--interval",
            metavar="SECONDS",
            callback=o.at_least(0.01),
            rich_help_panel=o.WAITING,
            help="Seconds between attempts.",
        ),
    ] = 0.5,
    attempt_timeout: Annotated[
        float,
        typer.Option(
            "--attempt-timeout",
            metavar="SECONDS",
            callback=o.at_least(0.05),
            rich_help_panel=o.WAITING,
            help="Seconds one attempt may wait for an answer.",
        ),
    ] = 5,
    json_output: o.JsonOpt = False,
    quiet: o.QuietOpt = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Wait until the inference server answers (or is healthy, or serves a weight version).

    A server that answers 404 where SGLang and vLLM answer is neither: that ends the wait at
    once (exit 1), not at --timeout.
    """
    from rich.text import Text

    from ckptctl.inference_server import ServerAddress, check_endpoint
    from ckptctl.job.groups import check_weight_version
    from ckptctl.readiness import Prober, wait_ready

    out = Output(json_mode=json_output, quiet=quiet)
    check_weight_version(engine, weight_version)
    address = ServerAddress(endpoint=check_endpoint(endpoint), uds=uds, api_key=api_key)
    goal = f"{for_.value}" + (f" with weight version {weight_version!r}" if weight_version else "")
    out.log(f"waiting up to {timeout:g}s (--timeout) for {address.describe()} to be {goal}")

    last_status: list[str] = []
    last_line_at = [0.0]  # elapsed seconds when the last plain line was written
    status_ctx = (
        out.err.status(Text(f"waiting for {address.describe()}"), spinner="dots")
        if out.interactive
        else contextlib.nullcontext()
    )

    def on_attempt(probe, attempts: int, elapsed: float) -> None:
        raise_if_interrupted()
        if status_ctx is not None and out.interactive:
            status_ctx.update(  # type: ignore[union-attr]
                # Text(): what the server says is shown as is, never read as Rich markup.
                Text(
                    redact(
                        f"waiting for {address.describe()} to be {goal} · {elapsed:.1f}s · "
                        f"{count(attempts)} · last: {probe.status}"
                    )
                )
            )
        elif not last_status or last_status[-1] != probe.status:
            # Without a terminal: one line per change of state, not one per poll...
            out.log(f"{elapsed:6.1f}s  {probe.status}")
            last_line_at[0] = elapsed
        elif elapsed - last_line_at[0] >= HEARTBEAT_S:
            # ...and one every HEARTBEAT_S while nothing changes.
            out.log(f"{elapsed:6.1f}s  still waiting ({count(attempts)}): {probe.status}")
            last_line_at[0] = elapsed
        last_status.append(probe.status)

    prober = Prober(address, engine, for_, weight_version)
    try:
        with status_ctx:
            result = wait_ready(
                prober,
                timeout=timeout,
                interval=interval,
                attempt_timeout=attempt_timeout,
                on_attempt=on_attempt,
            )
    finally:
        prober.close()

    if json_output:
        out.result(result.as_json(), ok=result.ready)  # not ready: the timeout error follows
    if not result.ready:
        raise DeadlineExceeded(
            f"{address.describe()} was not {goal} within {timeout:g}s "
            f"({count(result.attempts)}, last: {result.last_status}); "
            f"{_what_to_do(result.last_status, for_, weight_version)}"
        )
    out.show(  # the result: stdout, like every command's
        f"{address.describe()} is {goal} after {result.elapsed_s:.1f}s "
        f"({count(result.attempts)}; it answered {result.last_status})"
    )


def count(attempts: int) -> str:
    return f"{attempts} attempt" + ("" if attempts == 1 else "s")


def _what_to_do(last_status: str, for_: ReadyCondition, weight_version: str | None) -> str:
    """The advice that fits how the wait ended: a server that answers is running."""
    if last_status.startswith("weight version"):
        return (
            f"it serves another weight version: push {weight_version!r} to it, or raise --timeout"
        )
    if last_status.startswith("HTTP ") and for_ is ReadyCondition.healthy:
        return (
            "the server is running but not healthy: SGLang answers 503 until it has weights "
            "(push some, or wait with --for listening); else see its log, or raise --timeout"
        )
    if last_status.startswith(("HTTP ", "/", "no weight-version")):
        return "the server answers, but not as asked: see its log, or raise --timeout"
    return "check that the server is running, or raise --timeout"

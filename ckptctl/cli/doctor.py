"""`ckptctl doctor`: check what a first run needs, one line per check (ckptctl/doctor.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from ckptctl.cli import _options as o
from ckptctl.cli._output import Output
from ckptctl.errors import OperationFailed, redact
from ckptctl.settings import PauseMode

STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red"}


def doctor_command(
    endpoint: o.CheckEndpointsOpt = None,
    uds: o.UdsListOpt = None,
    api_key: o.ApiKeyOpt = None,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            metavar="SECONDS",
            callback=o.at_least(0.1),
            rich_help_panel=o.SERVER,
            help="Give up on the servers' answers after this many seconds in all: a server "
            "that does not answer fails its check (each --endpoint has an equal share).",
        ),
    ] = 30,
    pause: Annotated[
        PauseMode | None,
        typer.Option(
            "--pause",
            metavar="MODE",
            rich_help_panel=o.SERVER,
            show_default=False,
            help="Also ask each server whether it offers this --pause mode (its version and "
            "routes, without pausing it).",
        ),
    ] = None,
    json_output: o.JsonOpt = False,
    quiet: Annotated[
        bool,
        typer.Option(
            "--quiet",
            "-q",
            metavar=o.FLAG,
            rich_help_panel=o.OUTPUT,
            help="Only the checks that warn or fail, with their fixes (none: no output).",
        ),
    ] = False,
    show_help: o.HelpOpt = False,
) -> None:
    """Check what a first run needs (CUDA, the GPUs, checkpoint-engine, torchrun, limits,
    /dev/shm, RDMA, the servers) and say what to fix.

    One line per check on stdout: ok, warn or fail, with the fix on the next line. Each GPU
    torch sees is listed with its UUID, checkpoint-engine's version is checked against the
    range ckptctl was written for, and each --endpoint (the same list update takes) is asked
    whether it answers like SGLang or vLLM and which weights-checker actions it offers.

    A check fails where update, serve or join cannot run without it (CUDA, checkpoint-engine,
    torchrun, each server given); the others only warn (RDMA and ulimit -l matter for p2p
    only, the weights checker for --verify only). Exit 0 when no check fails, 1 otherwise.
    Asking a weights checker without compare_checksum for its actions makes the server hash
    its weights once, as --verify does.
    """
    from rich.text import Text

    from ckptctl import doctor

    out = Output(json_mode=json_output)
    addresses = doctor.server_addresses(endpoint, uds, api_key)  # bad flags: exit 2 first
    if pause is not None and not addresses:
        from ckptctl.errors import UsageError

        raise UsageError("--pause asks the servers whether they offer it: give --endpoint URL")
    report = doctor.run(addresses, timeout=timeout, pause=None if pause is None else pause.value)
    if json_output:
        out.result(report.as_json(), ok=not report.failed)
    else:
        column = max(len(c.name) for c in report.checks) + 2
        for check in report.checks:
            if quiet and check.status == "ok":
                continue
            line = Text()
            line.append(f"{check.status:<6}", style=STYLES[check.status])
            line.append(f"{check.name:<{column}}{redact(check.detail)}")
            if check.fix:
                line.append(f"\n{'':<6}{'':<{column}}fix: {redact(check.fix)}")
            out.show(line)
        if not report.failed and not quiet:
            out.show(report.summary())
    if report.failed:
        raise OperationFailed(report.summary())

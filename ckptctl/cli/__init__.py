"""The `ckptctl` command line: one module per command, all registered here.

Commands parse flags, call the library (`ckptctl.*`) and print; torch and checkpoint-engine are
imported only inside the commands that need them, so `ckptctl --help` starts fast.
"""

from __future__ import annotations

import typer

from ckptctl import __version__
from ckptctl.cli import join, metas, save_metas, serve, update, wait_ready
from ckptctl.cli._errors import (
    handle_errors,
    install_signal_handlers,
    restore_default_signal_handlers,
)

EXIT_CODES_HELP = (
    "Exit codes: 0 success · 1 operation failed · 2 usage error · "
    "3 invalid input (checkpoint or metas file) · 4 timed out · 130 interrupted."
)

app = typer.Typer(
    name="ckptctl",
    help="Push safetensors checkpoints into a running SGLang or vLLM server over CUDA IPC "
    "(with checkpoint-engine), without restarting it.",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"ckptctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Show the version."
    ),
) -> None:
    """Push safetensors checkpoints into a running SGLang or vLLM server over CUDA IPC."""


# Pipeline order: wait for the server, plan/push (update), share metas, join.
app.command("wait-ready", epilog=EXIT_CODES_HELP)(handle_errors(wait_ready.wait_ready_command))
app.command("update", epilog=EXIT_CODES_HELP)(handle_errors(update.update_command))
app.command("save-metas", epilog=EXIT_CODES_HELP)(handle_errors(save_metas.save_metas_command))
app.command("join", epilog=EXIT_CODES_HELP)(handle_errors(join.join_command))
app.command("inspect-metas", epilog=EXIT_CODES_HELP)(handle_errors(metas.inspect_metas_command))
app.command("serve", epilog=EXIT_CODES_HELP)(handle_errors(serve.serve_command))
app.command("push", epilog=EXIT_CODES_HELP)(handle_errors(serve.push_command))
app.command("status", epilog=EXIT_CODES_HELP)(handle_errors(serve.status_command))
app.command("stop", epilog=EXIT_CODES_HELP)(handle_errors(serve.stop_command))


def main() -> None:
    """Console-script entry point (`ckptctl`, `python -m ckptctl`, `torchrun -m ckptctl`)."""
    install_signal_handlers()
    try:
        app(prog_name="ckptctl")
    finally:
        # The command is over: a late signal (torchrun tearing down) just ends the process,
        # rather than raising into interpreter shutdown.
        restore_default_signal_handlers()

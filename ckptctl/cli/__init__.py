"""The `ckptctl` command line: one module per command, all registered here.

Commands parse flags, call the library (`ckptctl.*`) and print; torch and checkpoint-engine are
imported only inside the commands that need them, so `ckptctl --help` starts fast.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ckptctl import __version__, results
from ckptctl.cli import _completion, join, metas, save_metas, serve, update, wait_ready
from ckptctl.cli._errors import (
    handle_errors,
    install_signal_handlers,
    restore_default_signal_handlers,
)
from ckptctl.cli._options import FLAG
from ckptctl.cli._usage import describe
from ckptctl.errors import ExitCode, UsageError, print_error
from ckptctl.launch import launch_info

EXIT_CODES_HELP = (
    "Exit codes: 0 success · 1 operation failed · 2 usage error · "
    "3 invalid input (checkpoint or metas file) · 4 timed out · 130 interrupted."
)

# Shown at the end of each command's --help, before the exit codes. Lines stay under 78
# columns: the help is read at 80.
EXAMPLES: dict[str, list[str]] = {
    "wait-ready": [
        "ckptctl wait-ready --timeout 600 && torchrun ... ckptctl update ...",
        "ckptctl wait-ready --for healthy --weight-version step-7 --timeout 60",
    ],
    "update": [
        "ckptctl update --dry-run --checkpoint-path DIR --world-size 8",
        "torchrun --nproc-per-node 8 --no-python ckptctl update \\",
        "    --checkpoint-path DIR --inference-parallel-size 8 --weight-version step-7",
        "torchrun --nproc-per-node 8 --no-python ckptctl update --checkpoint-path DIR \\",
        "    --inference-parallel-size 4 --endpoint URL1 --endpoint URL2",
    ],
    "save-metas": [
        "torchrun --nproc-per-node 8 --no-python ckptctl save-metas \\",
        "    --checkpoint-path DIR --metas-file metas.json",
    ],
    "join": [
        "torchrun --nproc-per-node 8 --no-python ckptctl join \\",
        "    --load-metas-file metas.json --inference-parallel-size 8",
    ],
    "inspect-metas": [
        "ckptctl inspect-metas metas.json",
        "ckptctl inspect-metas metas.json --checkpoint-path DIR --json",
    ],
    "serve": [
        "torchrun --nproc-per-node 8 --no-python ckptctl serve \\",
        "    --inference-parallel-size 8 &",
        "ckptctl push --wait 600 --checkpoint-path DIR --weight-version step-7",
    ],
    "push": [
        "ckptctl push --wait 600 --checkpoint-path DIR --weight-version step-7",
        "ckptctl push --endpoint URL --checkpoint-path DIR --json",
    ],
    "status": ["ckptctl status", "ckptctl status --endpoint URL --json"],
    "stop": ["ckptctl stop --wait 60"],
}


def epilog(command: str | None = None) -> str:
    """Examples (where there are any) and the exit codes, as Rich markup."""
    lines = EXAMPLES.get(command or "", [])
    if not lines:
        return EXIT_CODES_HELP
    shown = "\n".join(f"  [bold]{escape(line)}[/bold]" for line in lines)
    return f"Examples:\n{shown}\n\n{EXIT_CODES_HELP}"


app = typer.Typer(
    name="ckptctl",
    help="Push safetensors checkpoints into a running SGLang or vLLM server over CUDA IPC "
    "(with checkpoint-engine), without restarting it.",
    epilog=epilog(),
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
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            metavar=FLAG,
            callback=_version_callback,
            is_eager=True,
            help="Show the version.",
        ),
    ] = False,
) -> None:
    """Push safetensors checkpoints into a running SGLang or vLLM server over CUDA IPC."""


# Pipeline order: wait for the server, plan/push (update), share metas, join.
COMMANDS: dict[str, Callable[..., None]] = {
    "wait-ready": wait_ready.wait_ready_command,
    "update": update.update_command,
    "save-metas": save_metas.save_metas_command,
    "join": join.join_command,
    "inspect-metas": metas.inspect_metas_command,
    "serve": serve.serve_command,
    "push": serve.push_command,
    "status": serve.status_command,
    "stop": serve.stop_command,
}


def reflowed(doc: str | None) -> str:
    """A docstring as help text: Typer keeps its line breaks, which were made for the source
    at 100 columns; each paragraph becomes one line, for Rich to wrap at the terminal's width."""
    paragraphs = inspect.cleandoc(doc or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


for _name, _command in COMMANDS.items():
    # A command that declares _options.HelpOpt shows its own --help (no "<bool>" label).
    _own_help = "show_help" in inspect.signature(_command).parameters
    app.command(
        _name, help=reflowed(_command.__doc__), epilog=epilog(_name), add_help_option=not _own_help
    )(handle_errors(_command))


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`ckptctl`, `python -m ckptctl`, `torchrun -m ckptctl`)."""
    install_signal_handlers()
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    finally:
        # The command is over: a late signal (torchrun tearing down) just ends the process,
        # rather than raising into interpreter shutdown.
        restore_default_signal_handlers()
    sys.exit(code)


def run(args: list[str]) -> int:
    """Run one command line; returns the exit code.

    Typer is run with standalone_mode=False, so that a flag error found while parsing (before
    any command runs) comes back here as an exception: it gets the one error line and, with
    --json, the failure document every other outcome gets.
    """
    if not args:  # `ckptctl` alone: the overview, as a usage error
        app(["--help"], prog_name="ckptctl", standalone_mode=False)
        return int(ExitCode.USAGE)
    if args[0] in _completion.OPTIONS or args[0].startswith(
        tuple(f"{o}=" for o in _completion.OPTIONS)
    ):
        return _shell_completion(args)
    return _run_typer(args)


def _run_typer(args: list[str]) -> int:
    try:
        returned = app(args, prog_name="ckptctl", standalone_mode=False)
    except typer.TyperException as exc:  # a bad flag, value or command name
        code = int(getattr(exc, "exit_code", ExitCode.USAGE))
        _usage_failure(args, code, describe(exc.format_message(), _command_args(args)))
        return code
    except typer.Abort:
        _usage_failure(args, int(ExitCode.FAILED), "aborted")
        return int(ExitCode.FAILED)
    # A command that ended with typer.Exit returns its code; one that returned, None.
    return returned if isinstance(returned, int) else 0


def _shell_completion(args: list[str]) -> int:
    """`--install-completion SHELL` / `--show-completion SHELL` for the shell named (without
    one, Typer's options detect the shell they run in)."""
    try:
        asked = _completion.requested(args)
    except UsageError as exc:
        _usage_failure(args, int(ExitCode.USAGE), str(exc))
        return int(ExitCode.USAGE)
    if asked is None:
        return _run_typer(args)
    option, shell = asked
    text = _completion.script(shell, lambda: app([], prog_name="ckptctl"))
    if option == "--show-completion":
        sys.stdout.write(text)
        return 0
    try:
        path, how = _completion.install(shell, text, Path.home())
    except OSError as exc:
        print_error(f"could not install {shell} completion: {exc}")
        return int(ExitCode.FAILED)
    sys.stderr.write(f"{shell} completion installed in {path} ({how})\n")
    return 0


def _command_args(args: list[str]) -> list[str]:
    """The command line up to `--` (after it, nothing is a flag)."""
    return args[: args.index("--")] if "--" in args else args


def _usage_failure(args: list[str], code: int, message: str) -> None:
    """One line on stderr; with --json, the failure document on stdout (rank 0 only)."""
    command = next((a for a in args if a in COMMANDS), None)
    where = f"ckptctl {command}" if command else "ckptctl"
    line = f"{message} (see {where} --help)"
    print_error(line)
    if "--json" in _command_args(args) and launch_info().is_primary:
        results.expect(sys.stdout)
        results.write_failure(code, line)

"""The Typer application: every command registered, with its help (ckptctl.cli.run comes here
for every command line that ckptctl.cli._fast does not take)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from ckptctl import __version__, results
from ckptctl.cli import _completion, doctor, join, metas, save_metas, serve, update, wait_ready
from ckptctl.cli._errors import handle_errors
from ckptctl.cli._help import epilog, panel_of, with_short_help
from ckptctl.cli._options import FLAG, show_help
from ckptctl.cli._usage import describe
from ckptctl.errors import ExitCode, UsageError, print_error
from ckptctl.launch import launch_info

app = typer.Typer(
    name="ckptctl",
    help="Push safetensors checkpoints into a running SGLang or vLLM server over CUDA IPC "
    "(with checkpoint-engine), without restarting it.",
    epilog=epilog(),
    no_args_is_help=True,
    add_help_option=False,  # (its own, in _root: no "<bool>" label)
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
    show_help: Annotated[
        bool,
        typer.Option(
            "--help",
            "-h",
            metavar=FLAG,
            is_eager=True,
            expose_value=False,
            callback=show_help,
            help="Show this message and exit (COMMAND -h: a command's main options).",
        ),
    ] = False,
) -> None:
    """Push safetensors checkpoints into a running SGLang or vLLM server over CUDA IPC."""


# In the overview's order (_help.PANELS): one-shot, the resident job, metas files and p2p.
COMMANDS: dict[str, Callable[..., None]] = {
    "doctor": doctor.doctor_command,
    "wait-ready": wait_ready.wait_ready_command,
    "update": update.update_command,
    "serve": serve.serve_command,
    "push": serve.push_command,
    "stage": serve.stage_command,
    "rollback": serve.rollback_command,
    "status": serve.status_command,
    "stop": serve.stop_command,
    "save-metas": save_metas.save_metas_command,
    "join": join.join_command,
    "inspect-metas": metas.inspect_metas_command,
}


def reflowed(doc: str | None) -> str:
    """A docstring as help text: Typer keeps its line breaks, which were made for the source
    at 100 columns; each paragraph becomes one line, for Rich to wrap at the terminal's width."""
    paragraphs = inspect.cleandoc(doc or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


for _name, _command in COMMANDS.items():
    # A command that declares _options.HelpOpt shows its own --help (no "<bool>" label); every
    # command takes -h, the short form.
    _own_help = "show_help" in inspect.signature(_command).parameters
    app.command(
        _name,
        help=reflowed(_command.__doc__),
        epilog=epilog(_name),
        add_help_option=not _own_help,
        rich_help_panel=panel_of(_name),
    )(with_short_help(_name, handle_errors(_command)))


def run(args: list[str]) -> int:
    """Run one command line; returns the exit code.

    Typer is run with standalone_mode=False, so that a flag error found while parsing (before
    any command runs) comes back here as an exception: it gets the one error line and, with
    --json, the failure document every other outcome gets.
    """
    if not args:  # `ckptctl` alone: the overview, as a usage error
        app(["--help"], prog_name="ckptctl", standalone_mode=False)
        return int(ExitCode.USAGE)
    if args[0].partition("=")[0] in _completion.OPTIONS:
        return _shell_completion(args)
    return _run_typer(args)


# Older names a command still takes for a flag (Typer would list both names in one column):
# the flag's help says so in a line. save-metas's --metas-file is the CLI contract's name.
ALIASES = {"save-metas": {"--metas-file": "--save-metas-file"}}


def _unaliased(args: list[str]) -> list[str]:
    command = next((a for a in args if a in COMMANDS), None)
    aliases = ALIASES.get(command or "", {})
    if not aliases:
        return args
    end = args.index("--") if "--" in args else len(args)
    out = []
    for arg in args[:end]:
        name, eq, value = arg.partition("=")
        out.append(aliases.get(name, name) + eq + value if name in aliases else arg)
    return out + args[end:]


def _run_typer(args: list[str]) -> int:
    args = _unaliased(args)
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


def _json_logs(args: list[str]) -> bool:
    """Whether the command line asks for --log-format json (however it was spelled)."""
    pairs = zip(args, [*args[1:], ""], strict=True)
    return any(a == "--log-format=json" or (a, b) == ("--log-format", "json") for a, b in pairs)


def _usage_failure(args: list[str], code: int, message: str) -> None:
    """One line on stderr; with --json, the failure document on stdout (rank 0 only)."""
    command = next((a for a in args if a in COMMANDS), None)
    where = f"ckptctl {command}" if command else "ckptctl"
    line = f"{message} (see {where} --help)"
    if _json_logs(_command_args(args)):
        from ckptctl.observe import logs

        logs.use_json()  # (the command never ran to switch: its error line is JSON all the same)
    print_error(line)
    if "--json" in _command_args(args) and launch_info().is_primary:
        results.expect(sys.stdout)
        results.write_failure(code, line)

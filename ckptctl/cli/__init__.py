"""The `ckptctl` command line: one module per command, registered in _app.

Commands parse flags, call the library (`ckptctl.*`) and print; torch and checkpoint-engine are
imported only inside the commands that need them, so `ckptctl --help` starts fast. The serve
job's clients (`push`, `status`, `stop`, `rollback`) start faster still: a plain command line
of theirs is read by _fast, without building the Typer application (its help, its validators).
"""

from __future__ import annotations

import sys
from typing import Any

# What ckptctl.cli offered when it held the application itself (tests and tools import them).
_FROM_APP = ("app", "COMMANDS", "ALIASES", "reflowed")


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point (`ckptctl`, `python -m ckptctl`, `torchrun -m ckptctl`)."""
    args = sys.argv[1:] if argv is None else argv
    code: int | None = None
    try:
        from ckptctl.cli._errors import install_signal_handlers, restore_default_signal_handlers

        install_signal_handlers()
        try:
            code = run(args)
        finally:
            # The command is over: a late signal (torchrun tearing down) just ends the process,
            # rather than raising into interpreter shutdown.
            restore_default_signal_handlers()
    except KeyboardInterrupt:  # Ctrl-C while the CLI was still importing: no command to catch it
        if code is None:  # (one a moment after the command ended keeps the command's code)
            code = _interrupted_early(args)
    sys.exit(code)


def _interrupted_early(args: list[str]) -> int:
    """Exit 130 with one line (and with --json its document, as a usage error has one)."""
    from ckptctl import results
    from ckptctl.errors import ExitCode, print_error
    from ckptctl.launch import launch_info

    print_error("interrupted")
    if "--json" in args and launch_info().is_primary:
        if not results.expected():  # (no command had started to owe one)
            results.expect(sys.stdout)
        results.write_failure(int(ExitCode.INTERRUPTED), "interrupted")
    return int(ExitCode.INTERRUPTED)


def run(args: list[str]) -> int:
    """Run one command line; returns the exit code."""
    from ckptctl.cli import _fast

    code = _fast.run(args)
    if code is None:
        from ckptctl.cli import _app

        code = _app.run(args)
    return code


def __getattr__(name: str) -> Any:
    if name in _FROM_APP:
        from ckptctl.cli import _app

        return getattr(_app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
    from ckptctl.cli._errors import install_signal_handlers, restore_default_signal_handlers

    install_signal_handlers()
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    finally:
        # The command is over: a late signal (torchrun tearing down) just ends the process,
        # rather than raising into interpreter shutdown.
        restore_default_signal_handlers()
    sys.exit(code)


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

"""Turning failures into one line on stderr and the documented exit code."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import typer

from ckptctl import results
from ckptctl.errors import (
    CkptctlError,
    ExitCode,
    Interrupted,
    print_error,
    redact,
    terminal_text,
)

F = TypeVar("F", bound=Callable[..., Any])

DEBUG_ENV = "CKPTCTL_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip() not in ("", "0", "false", "no")


_signals_received: list[int] = []


def _raise_interrupted(signum: int, _frame: Any) -> None:
    _signals_received.append(signum)
    raise Interrupted(f"interrupted by {signal.Signals(signum).name}")


def raise_if_interrupted() -> None:
    """Raise again for a signal whose exception some library code caught and dropped (it is
    raised wherever the main thread happens to be, a broad `except` in a dependency included)."""
    if _signals_received:
        raise Interrupted(f"interrupted by {signal.Signals(_signals_received[0]).name}")


def install_signal_handlers() -> None:
    """SIGTERM (torchrun tearing a job down) ends a command like Ctrl-C: exit 130, cleanly."""
    with contextlib.suppress(ValueError):  # ValueError: not the main thread (a test runner)
        signal.signal(signal.SIGTERM, _raise_interrupted)


def restore_default_signal_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(ValueError):
            signal.signal(sig, signal.SIG_DFL)


def handle_errors(func: F) -> F:
    """Wrap a command: CkptctlError → one stderr line + its exit code; bugs → exit 1."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except typer.Exit:
            raise
        except CkptctlError as exc:
            if debug_enabled():
                if exc.debug_traceback:
                    sys.stderr.write(terminal_text(redact(exc.debug_traceback), lines=True))
                _print_traceback()
            _fail(exc.exit_code, str(exc))
        except KeyboardInterrupt:
            _fail(ExitCode.INTERRUPTED, "interrupted")
        except Exception as exc:  # noqa: BLE001 - the last line of defence: never a bare traceback
            if debug_enabled():
                _print_traceback()
            hint = "" if debug_enabled() else f" (set {DEBUG_ENV}=1 for the traceback)"
            _fail(ExitCode.FAILED, f"internal error: {type(exc).__name__}: {exc}{hint}")

    return wrapper  # type: ignore[return-value]


def _print_traceback() -> None:
    """The traceback (CKPTCTL_DEBUG=1), without secrets: it may hold a URL with a password."""
    sys.stderr.write(terminal_text(redact(traceback.format_exc()), lines=True))


def _fail(code: int, message: str) -> NoReturn:
    print_error(message)
    results.write_failure(code, message)
    results.leave_group_to_exit(code)  # a GPU job: no NCCL teardown to wait for (see there)
    raise typer.Exit(int(code)) from None

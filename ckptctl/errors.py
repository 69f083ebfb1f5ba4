"""Errors that end a command, each carrying its documented exit code.

The CLI layer turns a `CkptctlError` into one line on stderr and its exit code; anything else
is a bug and is reported as an internal error (the traceback is shown with CKPTCTL_DEBUG=1).
"""

from __future__ import annotations

import os
import sys
from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the operation failed: the server refused or broke off, a rank failed
    USAGE = 2  # a bad or missing flag
    INVALID_INPUT = 3  # a checkpoint or metas file that is missing, malformed or unsafe
    TIMEOUT = 4  # the server was not ready in time, or a step ran past --timeout
    INTERRUPTED = 130


class CkptctlError(Exception):
    """Base class: `str(err)` is the one line the user sees."""

    exit_code: ExitCode = ExitCode.FAILED
    # The traceback of what caused it, as text, where the cause itself must not be kept
    # (it would hold GPU buffers alive: parameter_server.drop_frames); shown by CKPTCTL_DEBUG.
    debug_traceback: str | None = None


class OperationFailed(CkptctlError):
    exit_code = ExitCode.FAILED


class UsageError(CkptctlError):
    exit_code = ExitCode.USAGE


class InvalidInput(CkptctlError):
    exit_code = ExitCode.INVALID_INPUT


class DeadlineExceeded(CkptctlError):
    exit_code = ExitCode.TIMEOUT


class Interrupted(CkptctlError):
    exit_code = ExitCode.INTERRUPTED


def print_error(message: str, *, label: str = "error") -> None:
    """Write the one error line to stderr, with the rank in front inside a multi-rank job
    (`label="warning"` for a warning from where no reporter is at hand)."""
    world = os.environ.get("WORLD_SIZE", "1")
    prefix = f"[rank {os.environ.get('RANK', '0')}] " if world not in ("", "1") else ""
    # A plain write, not Rich: the error must get out even if Rich itself is the problem.
    sys.stderr.write(f"{prefix}{label}: {message}\n")
    sys.stderr.flush()

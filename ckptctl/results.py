"""The one JSON document a `--json` command writes on stdout - also when it fails.

Every document has one shape, the envelope: `{"ok": true|false, "exit_code": N, "error":
null|"<the one-line message>"}` followed by the command's own fields. On success the command
writes its result (`write`). When it ends without one (an error, a timeout, a watchdog ending
the rank from another thread, a usage error caught before the command ran), `write_failure`
writes the envelope of the failure instead, with whatever fields the command kept for it
(`keep`: a wait-ready that timed out still says how long it waited), so `--json > out.json`
never leaves an empty or half-written file. Only rank 0 writes; `_emit` is the one place that
writes.

GPU jobs also keep native libraries off stdout: NCCL (with NCCL_DEBUG) and CUDA print to file
descriptor 1 directly. `protect_stdout` points fd 1 at stderr while the job runs and keeps the
real stdout for the result. Once it is written, `leave_group_to_exit` ends a GPU job's process
without the NCCL teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from ckptctl.errors import ExitCode, redact_doc

_stream: TextIO | None = None  # where the result goes; None: this command prints no JSON
_written = False
_kept: dict[str, Any] = {}  # fields for the failure document, should the command fail

ENVELOPE = ("ok", "exit_code", "error")


def expect(stream: TextIO | None) -> None:
    """Called when a command starts: a JSON result is owed on `stream` (None: none is)."""
    global _stream, _written
    _stream, _written = stream, False
    _kept.clear()


def expected() -> bool:
    """A command said where its result goes (it may have gone out already)."""
    return _stream is not None


def utc(when: float | None = None) -> str:
    """A result's timestamp: `when` (time.time(); default: now) as 2026-01-31T12:00:00Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when))


def envelope(fields: dict[str, Any], *, code: int = 0, error: str | None = None) -> dict[str, Any]:
    """`fields` in the envelope: ok, exit_code and error first, then the command's own."""
    doc: dict[str, Any] = {"ok": int(code) == 0, "exit_code": int(code), "error": error}
    doc.update((k, v) for k, v in fields.items() if k not in ENVELOPE)
    return doc


def write(doc: dict[str, Any]) -> None:
    """The command's result. A result that says it failed (`"ok": false`, a serve job's answer)
    keeps its exit code and error; any other is a success."""
    if doc.get("ok", True) is False:
        code = int(doc.get("exit_code") or 1)
        _emit(envelope(doc, code=code, error=str(doc.get("error") or f"failed (exit {code})")))
    else:
        _emit(envelope(doc))


def keep(fields: dict[str, Any]) -> None:
    """Fields that belong in the failure document too, if the command goes on to fail."""
    _kept.update(fields)


def write_failure(code: int, message: str) -> None:
    """The failure document (with the kept fields), unless a result already went out. An
    update that broke off after the server's workers connected says so in its message,
    wherever it failed (this rank, another rank through the job's store): then the document
    says it too."""
    from ckptctl.errors import PARTIAL_WEIGHTS_NOTE

    fields = dict(_kept)
    if PARTIAL_WEIGHTS_NOTE in message:
        fields["server_weights"] = "partial"
    # A failure is never "ok": whatever code reached here, the document says it failed.
    _emit(envelope(fields, code=int(code) or 1, error=message))


def _emit(doc: dict[str, Any]) -> None:
    global _written
    if _stream is None or _written:
        return
    # Secrets (an API key a server echoed, a URL's password) never reach the document.
    _stream.write(json.dumps(redact_doc(doc), separators=(",", ":")) + "\n")
    _stream.flush()
    _written = True


@contextlib.contextmanager
def protect_stdout() -> Iterator[None]:
    """While the block runs, fd 1 goes to stderr; the JSON result still reaches the real stdout."""
    global _stream
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured (tests): nothing native to fear
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    os.dup2(sys.stderr.fileno(), fd)
    real = os.fdopen(os.dup(saved), "w")
    previous = _stream
    if _stream is not None:
        _stream = real
    try:
        yield
    finally:
        sys.stdout.flush()
        real.flush()
        os.dup2(saved, fd)
        os.close(saved)
        real.close()
        if previous is not None:
            _stream = previous


def leave_group_to_exit(code: int) -> None:
    """End the process now if this job left its NCCL process group alive; else return.

    The group is kept from one update to the next (ParameterServerSession.ensure_group) and
    not destroyed at the end: destroying an NCCL communicator waits for its proxy thread's
    next poll tick (bench/README.md), and by the time this is called our buffers are
    unregistered and the results printed. The process's exit releases the rest.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available():
        return
    # A group whose build started (still running, or failed halfway) is left the same way: an
    # interpreter shutdown under NCCL's threads may hang or abort (process_group.py).
    builder = sys.modules.get("ckptctl.job.process_group")
    if not torch.distributed.is_initialized() and not getattr(builder, "started", False):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


REFUSED = "refused before sending"


def outcome(result: dict[str, Any]) -> str:
    """How a push ended, in one word or phrase: ok, rolled back (a rollback that succeeded),
    restored (it failed mid-transfer and the last whole push was pushed again), cancelled,
    refused before sending (exit 3: nothing was sent), or failed."""
    if result.get("ok"):
        return "rolled back" if result.get("action") == "rollback" else "ok"
    if result.get("server_weights") == "whole" and not result.get("whole_but_paused"):
        return "restored"  # (whole_but_paused: it went in, but a server stays paused: failed)
    code = result.get("exit_code")
    if code == ExitCode.INTERRUPTED:
        return "cancelled"
    if code == ExitCode.INVALID_INPUT and result.get("server_weights") is None:
        return REFUSED
    return "failed"

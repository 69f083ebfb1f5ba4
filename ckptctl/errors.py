"""Errors that end a command, each carrying its documented exit code.

The CLI layer turns a `CkptctlError` into one line on stderr and its exit code; anything else
is a bug and is reported as an internal error (the traceback is shown with CKPTCTL_DEBUG=1).
"""

from __future__ import annotations

import base64
import os
import re
import sys
from enum import IntEnum
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the operation failed: the server refused or broke off, a rank failed
    USAGE = 2  # a bad or missing flag
    INVALID_INPUT = 3  # a checkpoint or metas file that is missing, malformed or unsafe
    TIMEOUT = 4  # the server was not ready in time, or a step ran past --timeout
    INTERRUPTED = 130


# Said in an error line whenever an update broke off after the server's workers connected:
# SGLang's own words for that state are "partially updated. Please discard the whole weights".
# A failure's JSON document then carries "server_weights": "partial" (results.py).
PARTIAL_WEIGHTS_NOTE = "the server may now hold partly updated weights"


class CkptctlError(Exception):
    """Base class: `str(err)` is the one line the user sees."""

    exit_code: ExitCode = ExitCode.FAILED
    # The traceback of what caused it, as text, where the cause itself must not be kept
    # (it would hold GPU buffers alive: ce/session.drop_frames); shown by CKPTCTL_DEBUG.
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


def error_for(code: int, message: str) -> CkptctlError:
    """The error that exits with `code` (a failure reported as a code: a push's answer, an
    abort notice); any code without a class of its own is a failure (1)."""
    kinds: tuple[type[CkptctlError], ...] = (InvalidInput, DeadlineExceeded, Interrupted)
    kind = next((k for k in kinds if k.exit_code == code), OperationFailed)
    return kind(message)


# -- secrets: registered once, taken out of everything ckptctl prints -----------------------------

REDACTED = "***"
# Shorter values are taken out only where they are recognisably secrets (the patterns below):
# replacing every "ab" in a message would garble it.
MIN_SECRET_CHARS = 4
MIN_QUERY_SECRET_CHARS = 8
_secrets: set[str] = set()
_PATTERNS = (
    # A password in a URL: scheme://user:password@host. The user info ends at the authority's
    # last "@", as urlsplit and httpx read it: a password (or user name) may hold an "@".
    (re.compile(r"(?<=://)([^/?#\s:]*):[^/?#\s]*@"), rf"\1:{REDACTED}@"),
    # The values of a URL's query (?api_key=...): a query is where a pasted URL keeps its key.
    (re.compile(r"(?<=://)([^\s?#'\"]*\?)([^\s#'\")]*)"), lambda m: m[1] + _query_values(m[2])),
    # A credential after its scheme, e.g. a server echoing our Authorization header.
    (re.compile(r"\b(Bearer|Basic)(\s+)[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE), rf"\1\2{REDACTED}"),
)


def _query_values(query: str) -> str:
    """A URL query with every value replaced: `a=1&key=s3cret` -> `a=***&key=***`."""
    return re.sub(r"=[^&;]*", f"={REDACTED}", query)


def register_secret(value: str | None) -> None:
    """Never print `value` (an API key, a password): `redact` replaces it wherever it shows."""
    if value and len(value) >= MIN_SECRET_CHARS:
        _secrets.add(value)


def register_url_secrets(url: str) -> None:
    """The password of a URL's user info, as written, decoded, and as HTTP Basic auth sends it;
    the longer values of its query, as written and decoded (quoted outside the URL; a short
    value such as `json` would garble every message it occurs in, and in a URL `redact` takes
    out every query value anyway)."""
    try:
        parts = urlsplit(url)
        user, password = parts.username, parts.password
    except ValueError:
        return
    for _name, value in parse_qsl(parts.query):
        if len(value) >= MIN_QUERY_SECRET_CHARS:
            register_secret(value)
            register_secret(quote(value, safe=""))
    if password:
        register_secret(password)
        register_secret(unquote(password))
        basic = f"{unquote(user or '')}:{unquote(password)}".encode()
        register_secret(base64.b64encode(basic).decode("ascii"))


def redact(text: str) -> str:
    """`text` without registered secrets, URL passwords or bearer tokens."""
    for secret in sorted(_secrets, key=len, reverse=True):  # (a copy: safe across threads)
        if secret in text:
            text = text.replace(secret, REDACTED)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def redact_doc(value: Any) -> Any:
    """A JSON-able document with `redact` applied to every string in it (keys included)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_doc(k): redact_doc(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_doc(v) for v in value]
    return value


def terminal_text(text: str, *, lines: bool = False) -> str:
    """`text` as a terminal may show it: every character that is not printable (ESC and the
    other C0/C1 controls, bidirectional overrides, line breaks unless `lines`) written as its
    Python escape, `\\x1b`. A shard named `model<ESC>]0;PWNED<ESC>\\.safetensors` would
    otherwise retitle the window, or clear the screen, of whoever reads the message."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() or (lines and c == "\n") else c.encode("unicode_escape").decode()
        for c in text
    )


def log_line(text: str) -> str:
    """`text` as one line of a log or terminal: secrets redacted, every control character
    escaped, line breaks too (a weight version or folder name holding "\nerror: ..." would
    otherwise add a line of its own to the log)."""
    return terminal_text(redact(text))


def print_error(message: str, *, label: str = "error") -> None:
    """Write the one error line to stderr, with the rank in front inside a multi-rank job
    (`label="warning"` for a warning from where no reporter is at hand)."""
    world = os.environ.get("WORLD_SIZE", "1")
    prefix = f"[rank {os.environ.get('RANK', '0')}] " if world not in ("", "1") else ""
    # A plain write, not Rich: the error must get out even if Rich itself is the problem.
    sys.stderr.write(f"{prefix}{label}: {log_line(message)}\n")
    sys.stderr.flush()

"""The small HTTP that ckptctl's own endpoints speak (the serve job's control socket, its
metrics port): one request per connection, read with bounds - headers up to 16 KiB, a body up
to 64 KiB (Content-Length only: 400 for a malformed length, 413 beyond the cap), the whole
request within its deadline (408 after) - and answered in JSON. Whoever reaches such an
endpoint may be hostile: nothing is read without a bound, nothing waits without a deadline.
"""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any

MAX_HEADER_BYTES = 16 * 1024
MAX_BODY_BYTES = 64 * 1024
REQUEST_DEADLINE_S = 10.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Content Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def send_json(conn: socket.socket, status: int, doc: dict[str, Any]) -> None:
    body = json.dumps(doc).encode()
    head = (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    conn.settimeout(REQUEST_DEADLINE_S)  # a client that never reads cannot hold us
    conn.sendall(head.encode() + body)


def discard_rest(conn: socket.socket) -> None:
    """After an early answer: closing with the client's bytes unread would reset the
    connection before the answer arrives. Let it finish sending (1 s, 1 MiB at most) and
    throw that away, unparsed."""
    conn.shutdown(socket.SHUT_WR)
    deadline, left = time.monotonic() + 1.0, 1 << 20
    while left > 0 and time.monotonic() < deadline:
        conn.settimeout(max(deadline - time.monotonic(), 0.01))
        chunk = conn.recv(65536)
        if not chunk:
            return
        left -= len(chunk)


def _recv(conn: socket.socket, deadline: float, what: str) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise HttpError(408, f"the {what} took longer than {REQUEST_DEADLINE_S:g}s")
    conn.settimeout(left)
    try:
        return conn.recv(65536)
    except TimeoutError:
        raise HttpError(408, f"the {what} took longer than {REQUEST_DEADLINE_S:g}s") from None


def read_request(conn: socket.socket, deadline: float) -> tuple[str, str, bytes] | None:
    """(method, path, body) of one request, or None when the client left without one."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        if len(buf) > MAX_HEADER_BYTES:
            raise HttpError(431, f"the request's headers exceed {MAX_HEADER_BYTES} bytes")
        chunk = _recv(conn, deadline, "request")
        if not chunk:
            return None
        buf += chunk
    head, _, rest = buf.partition(b"\r\n\r\n")
    method, path, length = parse_head(head)
    body = rest
    while len(body) < length:
        chunk = _recv(conn, deadline, "request body")
        if not chunk:
            return None
        body += chunk
    return method, path, body[:length]


def parse_head(head: bytes) -> tuple[str, str, int]:
    """(method, path, the body's length) of a request's head (what comes before its blank
    line), checked as read_request checks it."""
    if len(head) > MAX_HEADER_BYTES:
        raise HttpError(431, f"the request's headers exceed {MAX_HEADER_BYTES} bytes")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "not an HTTP/1.x request line")
    method, target = parts[0], parts[1]
    headers: dict[str, list[str]] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, "a malformed header line")
        headers.setdefault(name.lower(), []).append(value.strip())
    if "transfer-encoding" in headers:
        raise HttpError(501, "only bodies with a Content-Length are accepted")
    lengths = headers.get("content-length", ["0"])
    if len(set(lengths)) != 1 or not re.fullmatch(r"[0-9]{1,18}", lengths[0]):
        raise HttpError(400, "Content-Length is not a number")
    length = int(lengths[0])
    if length > MAX_BODY_BYTES:
        raise HttpError(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
    return method, target.split("?", 1)[0], length


def parse_body(body: bytes) -> Any:
    if not body.strip():
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise HttpError(400, "the body is not JSON") from None

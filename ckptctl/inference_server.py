"""Talking to the inference server over HTTP (TCP or a Unix socket): what each engine answers.

Only httpx is imported here, so `wait-ready` starts fast. The answers each engine and version
gives are summarised in docs of the project (SGLang 0.5.4–0.5.23, vLLM dev mode).
"""

from __future__ import annotations

import html
import json
import os
import re
from dataclasses import dataclass
from typing import Any

import httpx

from ckptctl.bounded_http import (
    MAX_RESPONSE_BYTES,
    EncodedResponse,
    ResponseTooLarge,
    bounded_client,
)
from ckptctl.defaults import API_KEY_ENV, DEFAULT_ENDPOINT
from ckptctl.errors import redact, register_secret, register_url_secrets
from ckptctl.settings import ServerKind


@dataclass(frozen=True)
class ServerContract:
    """The endpoints of one kind of server that ckptctl uses."""

    name: ServerKind
    listening_path: str  # any HTTP answer here means the server is up
    health_path: str  # 200 here means healthy
    # Where the current weight version can be read, tried in order (newest SGLang first).
    weight_version_paths: tuple[str, ...]


CONTRACTS: dict[ServerKind, ServerContract] = {
    # SGLang 0.5.23 answers /ping with 503 until its first weights arrive: still "listening".
    ServerKind.sglang: ServerContract(
        ServerKind.sglang,
        "/ping",
        "/health",
        ("/model_info", "/get_weight_version", "/get_model_info"),
    ),
    # vLLM's /health ignores weights entirely; it has no weight version to read back.
    ServerKind.vllm: ServerContract(ServerKind.vllm, "/health", "/health", ()),
}


_TOKEN = re.compile(r"[\x21-\x7e]+")  # what an Authorization header's token may hold


@dataclass(frozen=True)
class ServerAddress:
    endpoint: str = DEFAULT_ENDPOINT
    uds: str | None = None
    api_key: str | None = None  # sent as a Bearer token; never printed

    def __post_init__(self) -> None:
        # From here on, nothing ckptctl prints shows the key or the endpoint's password.
        register_secret(self.api_key)
        register_url_secrets(self.endpoint)
        if self.api_key and not _TOKEN.fullmatch(self.api_key):
            from ckptctl.errors import UsageError

            # (A line break in it failed every request; a non-ASCII one ended in a traceback.)
            raise UsageError(
                "the API key (--api-key or CKPTCTL_API_KEY) must be printable ASCII without "
                "spaces or line breaks, as an HTTP Bearer token is"
            )

    def describe(self) -> str:
        """The endpoint for messages, without the password of its user info."""
        endpoint = redact(self.endpoint)
        return f"{endpoint} (via Unix socket {self.uds})" if self.uds else endpoint


def check_endpoint(endpoint: str) -> str:
    """The endpoint if it is an http(s) URL with a host; else a usage error (exit 2) at once,
    rather than polling a URL that can never answer until the timeout runs out."""
    from urllib.parse import urlsplit

    from ckptctl.errors import UsageError

    try:
        parts = urlsplit(endpoint)
        host = parts.hostname
        httpx.URL(endpoint)
    except (httpx.InvalidURL, TypeError, ValueError):
        parts, host = None, None
    try:
        port_ok = parts is None or parts.port != 0  # (urlsplit reads the port only when asked)
    except ValueError:
        port_ok = False
    if not port_ok:
        raise UsageError(f"--endpoint {endpoint!r}: its port is not a number from 1 to 65535")
    urls = len(endpoint.split())
    if urls > 1:  # (a list where one server goes: no URL holds a space)
        import os

        from ckptctl.defaults import ENDPOINT_ENV

        source = f" (from {ENDPOINT_ENV})" if os.environ.get(ENDPOINT_ENV) == endpoint else ""
        raise UsageError(
            f"--endpoint {endpoint!r}{source} is {urls} URLs where one server goes: give this "
            "command one --endpoint URL (run it once per server)"
        )
    if parts is None or parts.scheme not in ("http", "https") or not host:
        raise UsageError(
            f"--endpoint {endpoint!r} is not an http(s) URL with a host; "
            "write it like http://localhost:19730"
        )
    if parts.path.rstrip("/").endswith("/v1"):
        from ckptctl.errors import print_error
        from ckptctl.launch import launch_info

        if launch_info().is_primary:
            # The OpenAI-compatible base URL, pasted from a client's settings: the update routes
            # hang off the server's root, so every call would answer 404.
            path = parts.path.rstrip("/")[: -len("/v1")] or ("/" if parts.query else "")
            root = parts._replace(path=path).geturl()
            print_error(
                f"--endpoint {endpoint} ends in /v1, the OpenAI API's base URL; ckptctl calls "
                f"the server's own routes: drop the /v1 ({root})",
                label="warning",
            )
    return endpoint


def auth_headers(address: ServerAddress) -> dict[str, str]:
    """The API key as a Bearer token, for the calls that need it (none without a key)."""
    return {"Authorization": f"Bearer {address.api_key}"} if address.api_key else {}


def make_client(
    address: ServerAddress,
    timeout: float,
    *,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
    send_key: bool = True,
) -> httpx.Client:
    """An httpx client for `address`: each request ends within `timeout` seconds in all, and
    reads at most `max_response_bytes` of answer (bounded_http.py: a server may trickle or
    flood). send_key=False: the key goes only with requests given `auth_headers` (readiness
    probes go without: SGLang checks no key on /health, and any answer on /ping will do)."""
    client = bounded_client(
        address.endpoint,
        timeout=timeout,
        uds=address.uds,
        headers=auth_headers(address) if send_key else {},
        max_response_bytes=max_response_bytes,
    )
    if address.api_key:
        # httpx turns a URL's user:password into Basic auth, replacing the Bearer header: the
        # API key asked for explicitly goes out instead (a no-op Auth keeps the header as set).
        client.auth = httpx.Auth()
    return client


def describe_failure(exc: BaseException, address: ServerAddress, timeout: float) -> str:
    """A short, key-free description of why a request got no (usable) HTTP answer."""
    if isinstance(exc, ResponseTooLarge):
        limit = f"{exc.limit >> 20} MiB" if exc.limit % (1 << 20) == 0 else f"{exc.limit} bytes"
        return f"answered more than {limit}, more than any answer it should give"
    if isinstance(exc, EncodedResponse):
        return (
            f"answered compressed (Content-Encoding: {exc.encoding}), which ckptctl does not read"
        )
    if address.uds and isinstance(exc, httpx.ConnectError) and not os.path.exists(address.uds):
        return f"no Unix socket at {address.uds}"
    if isinstance(exc, httpx.ConnectTimeout):
        return f"connect timed out after {timeout:g}s"
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout:g}s"
    if isinstance(exc, httpx.ConnectError):
        return "connection refused" if "refused" in str(exc).lower() else "cannot connect"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "connection closed without a valid HTTP answer"
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return "connection reset"
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return f"bad endpoint URL {address.endpoint!r}"
    return type(exc).__name__


# The most values an answer may hold for its size: one per 16 bytes, plus a few thousand
# (a checksum answer's entries take 30 bytes and more). Python spends 50-100 bytes on each
# value it parses (`[[],[],...]` takes 20 times its bytes); bounded so, an answer takes a few
# times its size.
BYTES_PER_VALUE = 16
SPARE_VALUES = 4096


def parse_json_object(response: httpx.Response) -> dict[str, Any] | None:
    """The body as a JSON object, or None when it is not one (garbage, HTML, a list...), nests
    deeper than the parser goes (RecursionError), or packs more values than BYTES_PER_VALUE
    allows (counted from its commas and brackets, before anything is built)."""
    content = response.content
    values = content.count(b",") + content.count(b"[") + content.count(b"{")
    if values > len(content) // BYTES_PER_VALUE + SPARE_VALUES:
        return None
    try:
        doc = json.loads(content)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


MESSAGE_CHARS = 300  # the most of a server's words that one error line carries
_HIDDEN_HTML = re.compile(r"<(script|style)\b.*?</\1\s*>", re.IGNORECASE | re.DOTALL)
_TAG = re.compile(r"<[^>]*>")
# Terminal escape sequences (CSI, OSC), then any C0/C1 control left: what a server says never
# moves the cursor, recolours the terminal or retitles its window.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def one_line(text: str, limit: int = MESSAGE_CHARS) -> str:
    """A server's text made fit for one line of ours: tags of an HTML page dropped, control
    characters and line breaks made spaces, secrets redacted, at most `limit` characters."""
    if text.lstrip()[:1] == "<":
        text = html.unescape(_TAG.sub(" ", _HIDDEN_HTML.sub(" ", text)))
    text = " ".join(_CONTROL.sub(" ", _ESCAPES.sub("", text)).split())
    text = redact(text)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def server_message(response: httpx.Response, limit: int = MESSAGE_CHARS) -> str:
    """What the server said, for error lines: its `message` (SGLang), `detail`/`error`, or its
    text; always one bounded line (an HTML error page shows as its words)."""
    doc = parse_json_object(response)
    if doc is not None:
        for key in ("message", "detail", "error"):
            value = doc.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return one_line(value if isinstance(value, str) else json.dumps(value), limit)
    text = one_line(response.text, limit)
    if not text:
        return "(empty body)"
    return f"(an HTML page) {text}" if response.text.lstrip()[:1] == "<" else text


# -- pushing an update ----------------------------------------------------------------------------

VLLM_DEV_MODE_HINT = (
    "start vLLM with VLLM_SERVER_DEV_MODE=1 and "
    "--worker-extension-cls checkpoint_engine.worker.VllmColocateWorkerExtension"
)


def update_request(
    engine: ServerKind,
    handles: dict[str, str],
    *,
    weight_version: str | None,
    timeout: float,
    flush_cache: bool = True,
) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of the request that makes the server pull the weights over IPC.
    flush_cache=False where SGLang would refuse the flush (a pause that holds requests:
    server_pause.flush_cache)."""
    if engine == "vllm":
        body: dict[str, Any] = {
            "method": "update_weights_from_ipc",
            "args": [handles],
            "timeout": timeout,
        }
        return "/collective_rpc", body
    body = {"zmq_handles": handles, "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return "/update_weights_from_ipc", body


class UpdateRefused(Exception):
    """The server answered, and not with success. `str()` carries its message."""


def push_update(
    address: ServerAddress,
    engine: ServerKind,
    handles: dict[str, str],
    *,
    weight_version: str | None,
    timeout: float,
    flush_cache: bool = True,
) -> str:
    """POST the update; return the server's message. Blocks until the transfer is over.

    Success is HTTP 200 *and*, for SGLang, `"success": true`. Raises `UpdateRefused` when the
    server said no, `httpx.HTTPError` when it could not be reached or did not answer in time.
    """
    path, body = update_request(
        engine, handles, weight_version=weight_version, timeout=timeout, flush_cache=flush_cache
    )
    with make_client(address, timeout=timeout) as client:
        response = client.post(path, json=body)
    code = response.status_code
    if code in (401, 403):
        raise UpdateRefused(
            f"HTTP {code}: the server refused the API key; pass --api-key or set {API_KEY_ENV}"
        )
    if engine == "vllm":
        if code == 404:
            raise UpdateRefused(f"HTTP 404 on {path}: {VLLM_DEV_MODE_HINT}")
        if code != 200:
            raise UpdateRefused(f"HTTP {code}: {server_message(response)}")
        return "collective_rpc update_weights_from_ipc done"
    doc = parse_json_object(response)
    if code == 200 and doc is not None and doc.get("success") is True:
        return one_line(str(doc.get("message", "")))
    if code == 404:
        raise UpdateRefused(
            f"HTTP 404 on {path}: the server has no IPC update endpoint "
            "(SGLang >= 0.5.4 is needed, or pass --engine vllm)"
        )
    return_doc = "" if doc is not None else " (the answer was not JSON)"
    raise UpdateRefused(f"HTTP {code}: {server_message(response)}{return_doc}")

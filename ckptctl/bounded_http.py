"""HTTP exchanges with a total deadline and a cap on the answer: for servers we do not trust.

httpx's timeouts are per operation: each read may wait `timeout` seconds, so a server that
sends one byte a second (of its headers or of its body) keeps an exchange going for ever,
and one that streams an endless body fills memory. Here every exchange has a deadline for the
whole of it (connect, send, headers, body: each socket operation waits at most what is left;
`deadline(seconds)` bounds several requests together) and a cap on the body
(`bounded_client`; a Content-Length above it is refused before anything is read; h11 already
caps the headers at 100 kB).

Running past the deadline raises httpx.ReadTimeout (or ConnectTimeout/WriteTimeout), so callers
catch httpx.TimeoutException as before; an oversized answer raises `ResponseTooLarge`, an
httpx.TransportError. An untrusted Unix socket raises `UntrustedSocket`, not an httpx error:
waiting will not make the socket anyone else's.

Not bounded: name resolution (getaddrinfo) for a host name that is not in /etc/hosts.

    with bounded_client("http://serve", uds=path, timeout=5.0) as client:
        response = client.get("/status")     # at most 5 s in all, at most 1 MiB
"""

from __future__ import annotations

import contextlib
import math
import time
import typing
from collections.abc import Collection, Iterator
from contextvars import ContextVar

import httpcore
import httpx

from ckptctl.unix_peers import check_peer, check_socket_owner, server_uids

MAX_RESPONSE_BYTES = 1 << 20  # every answer ckptctl reads is a few hundred bytes of JSON

# The absolute time.monotonic() by which the current exchange must be over (inf: none).
# A context variable, so that threads (and the clients they share) each keep their own.
_deadline: ContextVar[float] = ContextVar("ckptctl_http_deadline", default=math.inf)


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Every HTTP exchange inside the block ends within `seconds` from now, all together
    (an inner deadline only shortens an outer one)."""
    token = _deadline.set(min(_deadline.get(), time.monotonic() + max(seconds, 0.0)))
    try:
        yield
    finally:
        _deadline.reset(token)


class ResponseTooLarge(httpx.TransportError):
    """The server sent (or announced) more than the answer we accept."""

    def __init__(self, limit: int, request: httpx.Request | None = None) -> None:
        super().__init__(f"the answer is larger than {limit} bytes", request=request)
        self.limit = limit


class EncodedResponse(httpx.TransportError):
    """The server compressed its answer. The cap counts bytes on the wire, and httpx would
    decode them without one: a few kB of gzip inside gzip decode to gigabytes. SGLang and vLLM
    never compress; we ask for plain answers and read nothing else."""

    def __init__(self, encoding: str, request: httpx.Request | None = None) -> None:
        super().__init__(
            f"the answer is compressed (Content-Encoding: {encoding})", request=request
        )
        self.encoding = encoding


def _left(timeout: float | None, expired: type[Exception]) -> float | None:
    """The timeout for one socket operation: the operation's own, clipped to the deadline."""
    end = _deadline.get()
    if end == math.inf:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise expired("the exchange ran past its deadline")
    return left if timeout is None else min(timeout, left)


class _DeadlineStream(httpcore.NetworkStream):
    """A socket whose every operation waits at most until the current deadline."""

    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        # (sendall with a timeout bounds the whole buffer, not each send.)
        self._stream.write(buffer, _left(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: typing.Any,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        # The ssl module bounds the whole handshake by the socket's timeout.
        tls = self._stream.start_tls(
            ssl_context, server_hostname, _left(timeout, httpcore.ConnectTimeout)
        )
        return _DeadlineStream(tls)

    def get_extra_info(self, info: str) -> typing.Any:
        return self._stream.get_extra_info(info)


class _DeadlineBackend(httpcore.NetworkBackend):
    def __init__(self, trusted_uids: Collection[int]) -> None:
        self._backend = httpcore.SyncBackend()
        self._trusted_uids = trusted_uids

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Any = None,
    ) -> httpcore.NetworkStream:
        wait = _left(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(
            self._backend.connect_tcp(host, port, wait, local_address, socket_options)
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: typing.Any = None
    ) -> httpcore.NetworkStream:
        # Whoever listens there gets the API key and the IPC handles: it must be a user we
        # trust, checked before anything is sent (unix_peers.py).
        check_socket_owner(path, self._trusted_uids)
        wait = _left(timeout, httpcore.ConnectTimeout)
        stream = self._backend.connect_unix_socket(path, wait, socket_options)
        try:
            check_peer(stream.get_extra_info("socket"), path, self._trusted_uids)
        except BaseException:
            stream.close()
            raise
        return _DeadlineStream(stream)

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


# httpcore's exceptions and the httpx ones callers catch (httpx's own transport maps them the
# same way, in a private helper).
_EXCEPTIONS: tuple[tuple[type[Exception], type[httpx.TransportError]], ...] = (
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ReadTimeout, httpx.ReadTimeout),
    (httpcore.WriteTimeout, httpx.WriteTimeout),
    (httpcore.PoolTimeout, httpx.PoolTimeout),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.UnsupportedProtocol, httpx.UnsupportedProtocol),
    (httpcore.ProxyError, httpx.ProxyError),
)


@contextlib.contextmanager
def _as_httpx_errors(request: httpx.Request, end: float) -> Iterator[None]:
    """Run the block under the request's deadline, with httpcore's errors as httpx's."""
    token = _deadline.set(end)
    try:
        yield
    except Exception as exc:
        for theirs, ours in _EXCEPTIONS:
            if isinstance(exc, theirs):
                raise ours(str(exc), request=request) from exc
        raise
    finally:
        _deadline.reset(token)


def _total(request: httpx.Request) -> float | None:
    """The request's timeout, taken as the total for the exchange (None: unbounded)."""
    timeouts = request.extensions.get("timeout") or {}
    values = [v for v in timeouts.values() if v is not None]
    return max(values) if values else None


class _CappedBody(httpx.SyncByteStream):
    """The body, read under the request's deadline and cut off at the cap."""

    def __init__(
        self, chunks: typing.Iterable[bytes], request: httpx.Request, end: float, limit: int
    ) -> None:
        self._chunks = chunks
        self._request = request
        self._end = end
        self._limit = limit

    def __iter__(self) -> Iterator[bytes]:
        seen = 0
        chunks = iter(self._chunks)
        while True:
            # The deadline is set around each read only, never across the yield.
            with _as_httpx_errors(self._request, self._end):
                chunk = next(chunks, None)
            if chunk is None:
                return
            seen += len(chunk)
            if seen > self._limit:
                raise ResponseTooLarge(self._limit, self._request)
            yield chunk

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            with _as_httpx_errors(self._request, self._end):
                close()


class BoundedTransport(httpx.BaseTransport):
    """httpx transport over httpcore with a deadline per exchange and a capped body."""

    def __init__(
        self,
        *,
        uds: str | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        trusted_uids: Collection[int] | None = None,
    ) -> None:
        self._limit = max_response_bytes
        backend = _DeadlineBackend(server_uids() if trusted_uids is None else trusted_uids)
        # (ssl_context None: httpcore builds its default, certifi's roots, when https is used.)
        self._pool = httpcore.ConnectionPool(uds=uds, network_backend=backend)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.SyncByteStream)
        total = _total(request)
        end = min(_deadline.get(), math.inf if total is None else time.monotonic() + total)
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _as_httpx_errors(request, end):
            answer = self._pool.handle_request(core_request)
        body = _CappedBody(answer.stream, request, end, self._limit)  # type: ignore[arg-type]
        response = httpx.Response(
            status_code=answer.status,
            headers=answer.headers,
            stream=body,
            extensions=answer.extensions,
        )
        length = response.headers.get("content-length", "")
        if length.strip().isdigit() and int(length) > self._limit:
            body.close()
            raise ResponseTooLarge(self._limit, request)
        encoding = response.headers.get("content-encoding", "").strip().lower()
        if encoding not in ("", "identity"):
            body.close()
            raise EncodedResponse(encoding[:100], request)
        return response

    def close(self) -> None:
        self._pool.close()


def bounded_client(
    base_url: str,
    *,
    timeout: float,
    uds: str | None = None,
    headers: dict[str, str] | None = None,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
    trusted_uids: Collection[int] | None = None,
) -> httpx.Client:
    """An httpx client whose every request ends within `timeout` seconds in all and reads at
    most `max_response_bytes` of answer. `trust_env=False`: proxy settings never reroute a
    loopback or Unix-socket call. Over `uds`, it sends nothing to a socket or a listening
    process of a uid outside `trusted_uids` (default: this user and root) and raises
    `UntrustedSocket` (exit 1) instead."""
    return httpx.Client(
        base_url=base_url,
        # Plain answers only (EncodedResponse): httpx would ask for gzip and brotli by default.
        headers={"Accept-Encoding": "identity", **(headers or {})},
        timeout=timeout,
        transport=BoundedTransport(
            uds=uds, max_response_bytes=max_response_bytes, trusted_uids=trusted_uids
        ),
        trust_env=False,
    )

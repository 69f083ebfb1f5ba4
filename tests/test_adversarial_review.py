"""What an adversarial review of the security work found (issue 14 follow-up), each a test that
failed before its fix: a compressed answer that decodes past the answer cap, an endpoint's
password in `status`, a consumed file's folder that other users can write to, an API key that
cannot be a Bearer token."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import zlib
from pathlib import Path

import pytest
from conftest import run_script

from ckptctl.errors import InvalidInput, UsageError
from ckptctl.inference_server import ServerAddress


def _gzip(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


def _bomb_server(decoded_bytes: int) -> tuple[socket.socket, int, list[bytes]]:
    """Answers every request with a small body that decodes to `decoded_bytes` (gzip in gzip);
    records each request's head."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    inner = b"".join(c.compress(b"\0" * (1 << 20)) for _ in range(decoded_bytes >> 20)) + c.flush()
    body = _gzip(inner)
    assert len(body) < 64 * 1024  # far below the 1 MiB cap on an answer
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    heads: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                buf = b""
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
                heads.append(buf)
                head = (
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    f"Content-Encoding: gzip, gzip\r\nContent-Length: {len(body)}\r\n\r\n"
                )
                with contextlib.suppress(OSError):  # (the client may hang up first)
                    conn.sendall(head.encode() + body)

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1], heads


def test_a_compressed_answer_is_never_decoded() -> None:
    """A few kB that decode to 256 MiB: before, wait-ready decoded all of it (2.1 GB RSS for a
    1 GiB bomb) and called the server ready. Now it asks for plain answers and reads nothing
    else: the server is never ready, and the wait ends at its deadline."""
    srv, port, heads = _bomb_server(256 << 20)
    try:
        r = run_script(
            "wait-ready", "--endpoint", f"http://127.0.0.1:{port}", "--timeout", "3", "--json"
        )
    finally:
        srv.close()
    assert r.returncode == 4, r.stdout + r.stderr
    assert "compressed" in r.stderr
    assert heads and all(b"accept-encoding: identity" in h.lower() for h in heads)


def test_status_never_prints_an_endpoint_password() -> None:
    from ckptctl.cli.serve import describe_status

    ServerAddress("http://admin:hunter2pw@127.0.0.1:1")  # what serve registers at start-up
    text = "\n".join(
        describe_status({"targets": ["http://admin:hunter2pw@127.0.0.1:1"]}, "/x.sock")
    )
    assert "hunter2pw" not in text and "127.0.0.1:1" in text


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_consume_refuses_a_folder_others_can_write() -> None:
    """A 0777 folder on the way lets another user swap a subfolder for a symlink between the
    check and checkpoint-engine's os.remove (which resolves the path again)."""
    from ckptctl.checkpoint.consume import check_in_shm

    base = Path(tempfile.mkdtemp(prefix="ckptctl-adv-", dir="/dev/shm"))
    try:
        (base / "sub").mkdir()
        f = base / "sub" / "a.safetensors"
        f.write_bytes(b"x")
        check_in_shm(str(f))  # private folders: fine
        os.chmod(base, 0o777)  # what mkdir gives under umask 000
        with pytest.raises(InvalidInput, match="writable by other users"):
            check_in_shm(str(f))
        os.chmod(base, 0o1777)  # sticky, like /dev/shm itself: others cannot rename our folder
        check_in_shm(str(f))
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("key", ["ab\ncd", "key with space", "ключ"])
def test_an_api_key_that_cannot_be_a_bearer_token_is_a_usage_error(key: str) -> None:
    with pytest.raises(UsageError, match="printable ASCII"):
        ServerAddress("http://127.0.0.1:1", api_key=key)
    r = run_script("wait-ready", "--timeout", "1", env={"CKPTCTL_API_KEY": key})
    assert r.returncode == 2 and "printable ASCII" in r.stderr

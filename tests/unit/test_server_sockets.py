"""The inference server's Unix socket (`--uds`) gets the API key and the IPC handles: ckptctl
sends nothing until it knows the socket file and the process listening on it belong to the
user or to root. A squatter of another uid on the path gets not a byte.

Another real uid needs root (a squatter that drops to `nobody`); without root, the same checks
run against a real socket of our own with the trusted uids injected (`trusted_uids=`): a file
socket for the owner check, an abstract one (no file) for the peer check."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from conftest import invoke
from fake_server import Behaviour, FakeServer

from ckptctl.bounded_http import bounded_client
from ckptctl.inference_server import ServerAddress, push_update
from ckptctl.unix_peers import UntrustedSocket, check_peer

NOBODY = 65534
SECRET = "sk-squatted-key-4242"
as_root = pytest.mark.skipif(os.getuid() != 0, reason="another uid needs root")

# Binds argv[1] (as root), gives the file to uid argv[2] and the process to uid argv[3], then
# listens (the peer credentials a client reads are the listener's at listen()); after "ready",
# one line per connection with how many bytes it received before the client hung up (or 2 s
# of silence). (A process started as `nobody` could not run this interpreter.)
SQUATTER = textwrap.dedent("""
    import os, socket, sys
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(sys.argv[1])
    os.chown(sys.argv[1], int(sys.argv[2]), int(sys.argv[2]))
    os.setgid(int(sys.argv[3]))
    os.setuid(int(sys.argv[3]))
    srv.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.settimeout(2)
        got = b""
        try:
            while chunk := conn.recv(65536):
                got += chunk
        except OSError:
            pass
        print(f"received {len(got)}", flush=True)
        conn.close()
""")


@contextmanager
def squatter(path: str, *, file_uid: int, process_uid: int) -> Iterator[subprocess.Popen[str]]:
    """SQUATTER on `path`; yields once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SQUATTER, path, str(file_uid), str(process_uid)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        yield proc
    finally:
        proc.kill()


SENTINEL = b"end-of-test-sentinel"


def _connections(proc: subprocess.Popen[str], path: str) -> list[str]:
    """What the squatter reported for each connection made so far: it serves them in order,
    so once it reports a sentinel connection of ours, every earlier one is in."""
    with socket.socket(socket.AF_UNIX) as probe:
        probe.connect(path)
        probe.sendall(SENTINEL)
    assert proc.stdout is not None
    lines = []
    while (line := proc.stdout.readline().strip()) != f"received {len(SENTINEL)}":
        assert line, "the squatter ended"
        lines.append(line)
    return lines


# -- another real uid (root only) ---------------------------------------------------------------


@as_root
@pytest.mark.parametrize("owner", ["squatter", "root"])
def test_wait_ready_sends_nothing_to_a_squatter_of_another_uid(short_tmp: Path, owner: str) -> None:
    """owner "squatter": the socket file is another uid's, refused before connecting; "root":
    the file was handed to root (trusted), but the process listening is another uid's,
    refused once connected, before the request."""
    path = str(short_tmp / "sglang.sock")
    file_uid = NOBODY if owner == "squatter" else 0
    with squatter(path, file_uid=file_uid, process_uid=NOBODY) as proc:
        r = invoke("wait-ready", "--uds", path, "--timeout", "5", env={"CKPTCTL_API_KEY": SECRET})
        seen = _connections(proc, path)
    assert r.exit_code == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "refusing to send it anything" in lines[0], r.stderr
    assert f"uid {NOBODY}" in lines[0]
    assert SECRET not in r.stdout + r.stderr
    assert seen == ([] if owner == "squatter" else ["received 0"])


@as_root
def test_an_update_request_sends_no_handles_to_a_squatter_of_another_uid(short_tmp: Path) -> None:
    path = str(short_tmp / "sglang.sock")
    with squatter(path, file_uid=0, process_uid=NOBODY) as proc:
        address = ServerAddress("http://localhost", uds=path, api_key=SECRET)
        with pytest.raises(UntrustedSocket, match=f"runs as uid {NOBODY}"):
            push_update(address, "sglang", {"GPU-0": "ipc://@x"}, weight_version=None, timeout=5)
        assert _connections(proc, path) == ["received 0"]


# -- the same checks without root: trusted uids injected ----------------------------------------


@pytest.mark.parametrize(
    ("kind", "refusal"),
    [
        ("file", "the Unix socket .* belongs to uid"),
        ("abstract", "the process listening on @ckptctl-.* runs as uid"),
    ],
)
def test_a_socket_of_an_untrusted_uid_gets_no_request(
    short_tmp: Path, kind: str, refusal: str
) -> None:
    """A file socket is refused on its owner, before connecting; an abstract one (a name
    starting with NUL, no file to check) on the uid of the process listening, read from the
    connection, before the request."""
    path = str(short_tmp / "sglang.sock") if kind == "file" else f"\0ckptctl-{short_tmp.name}"
    stranger = frozenset({os.getuid() + 4242})
    with FakeServer(Behaviour(), uds=path) as s:
        with bounded_client("http://localhost", uds=path, timeout=5) as client:
            assert client.get("/ping").status_code in (200, 503)  # ours: talked to
        s.behaviour.requests.clear()
        refusing = bounded_client("http://localhost", uds=path, timeout=5, trusted_uids=stranger)
        with refusing, pytest.raises(UntrustedSocket, match=f"{refusal} {os.getuid()}"):
            refusing.get("/ping", headers={"Authorization": f"Bearer {SECRET}"})
        assert s.behaviour.requests == []


def test_a_listener_of_an_untrusted_uid_is_refused_on_a_real_connection(short_tmp: Path) -> None:
    """check_peer reads the listening process's uid from the connection itself."""
    path = str(short_tmp / "peer.sock")
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen(1)
        with socket.socket(socket.AF_UNIX) as conn:
            conn.connect(path)
            check_peer(conn, path, {os.getuid()})  # ourselves: fine
            with pytest.raises(UntrustedSocket, match=f"runs as uid {os.getuid()}"):
                check_peer(conn, path, {os.getuid() + 4242})


def test_a_missing_socket_is_still_waited_for(short_tmp: Path) -> None:
    """The owner check leaves a path with nothing there yet to the connect: a server that
    has not created its socket is polled, not refused."""
    path = str(short_tmp / "later.sock")
    client = bounded_client("http://localhost", uds=path, timeout=1)
    with client, pytest.raises(httpx.ConnectError):
        client.get("/ping")


def test_the_server_may_run_as_this_user_or_as_root() -> None:
    from ckptctl.unix_peers import server_uids

    assert server_uids() == {os.getuid(), 0}

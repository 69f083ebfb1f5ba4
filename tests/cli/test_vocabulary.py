"""One vocabulary (CLI contract): the Python client's messages name its arguments, the CLI's its
flags; results go to stdout. Real Unix sockets, real subprocesses of the CLI."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptctl import client
from ckptctl.errors import DeadlineExceeded


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def mute_socket(short_tmp: Path) -> Iterator[str]:
    """A socket of ours that takes connections and never answers."""
    path = str(short_tmp / "mute.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(8)
    try:
        yield path
    finally:
        sock.close()


def test_the_client_speaks_of_arguments(short_tmp: Path) -> None:
    missing = str(short_tmp / "nope.sock")
    with pytest.raises(client.NotAnswering) as raised:
        client.status(control_socket=missing)
    assert "wait=SECONDS" in str(raised.value) and "--" not in str(raised.value)
    with pytest.raises(client.NotAnswering) as raised:
        client.stop(control_socket=missing)
    assert "--" not in str(raised.value)


def test_a_client_timeout_names_the_argument_and_the_cli_the_flag(mute_socket: str) -> None:
    with pytest.raises(DeadlineExceeded) as raised:
        client.push("/nonexistent", control_socket=mute_socket, timeout=0.3)
    assert "(raise timeout=)" in str(raised.value) and "--" not in str(raised.value)
    r = _cli("push", "--checkpoint-path", "/nonexistent", "--control-socket", mute_socket,
             "--timeout", "1")  # fmt: skip
    assert r.returncode == 4, r.stderr
    assert "(raise --timeout)" in r.stderr and "timeout=" not in r.stderr


def test_the_cli_speaks_of_flags(short_tmp: Path) -> None:
    missing = str(short_tmp / "nope.sock")
    for command in ("status", "stop", "push"):
        args = ["--checkpoint-path", str(short_tmp)] if command == "push" else []
        r = _cli(command, *args, "--control-socket", missing, "--json")
        assert r.returncode == 1, r.stderr
        assert "wait=" not in r.stderr
        doc = json.loads(r.stdout)
        assert doc["ok"] is False
        # (every client command waits for a job with --wait, stop too)
        assert "--wait SECONDS" in r.stderr and "--wait" in doc["error"]

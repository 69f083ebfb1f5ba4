"""What a `serve` job exposes on the network, attacked on loopback: the TCP ports its ranks
listen on (read from /proc, as a port scanner would find them), a flood of bare connections
to each under a low open-files limit, and a job of one process, which needs no port at all."""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import CPU_PS_RANK, run_script, wait_until
from fake_server import Behaviour, FakeServer, children, running_job
from locations import SERVE_RANK, TINY
from warm_launch import launcher_pid, torchrun_cmd

pytestmark = pytest.mark.slow

OPEN_FILES = 512  # the job's RLIMIT_NOFILE: gloo aborted once its accepted sockets reached it


# -- what listens, and who -----------------------------------------------------------------------


def _address(hex_address: str, family: socket.AddressFamily) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order) made readable."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((_address(address, family), int(port, 16)))
    return found


def flood(address: str, port: int, connections: int, rounds: int = 3) -> int:
    """`rounds` times: `connections` bare connects to (address, port) at once, each given until
    the round's deadline to be accepted by the kernel, then all closed, having sent nothing.
    Returns how many got through."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    if address in ("0.0.0.0", "::"):
        address = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    made = 0
    for _ in range(rounds):
        socks = [socket.socket(family, socket.SOCK_STREAM) for _ in range(connections)]
        try:
            for s in socks:
                s.setblocking(False)
                s.connect_ex((address, port))
            poller = select.poll()  # (select() stops at descriptor 1023)
            pending = {s.fileno(): s for s in socks}
            for fd in pending:
                poller.register(fd, select.POLLOUT)
            deadline = time.monotonic() + 0.5
            while pending and time.monotonic() < deadline:
                for fd, _ in poller.poll(50):
                    poller.unregister(fd)
                    s = pending.pop(fd)
                    made += s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
        finally:
            for s in socks:
                s.close()
    return made


def _lower_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))


@contextmanager
def _job(cmd: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    with running_job(cmd, env, preexec_fn=_lower_open_files) as proc:
        yield proc


def _wait_serving(job: subprocess.Popen[str], sock: str) -> None:
    """Until the job's control socket is there; the job's log if it ended first."""
    wait_until(lambda: os.path.exists(sock) or job.poll() is not None, 120, "the control socket")
    if job.poll() is not None:
        raise AssertionError(f"the serve job ended: {job.communicate(timeout=60)[1][-3000:]}")


def _push(sock: str, name: str) -> subprocess.CompletedProcess[str]:
    return run_script(
        "push", "--control-socket", sock, "--checkpoint-path", str(TINY),
        "--checkpoint-name", name, "--json", timeout=120,
    )  # fmt: skip


def _stop(job: subprocess.Popen[str], sock: str) -> str:
    stop = run_script("stop", "--control-socket", sock, timeout=30)
    assert stop.returncode == 0, stop.stderr
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err[-3000:]
    return err


# -- the tests ------------------------------------------------------------------------------------


def test_a_flood_of_bare_connections_to_every_port_of_the_ranks_leaves_the_job_serving(
    short_tmp: Path,
) -> None:
    """Issue 24: bare connect+close to the command group's gloo listener, as many at once as
    the job's `ulimit -n`, made gloo abort ("accept: Too many open files") and torchrun end
    the job. Every listening port of every rank is flooded here; no connection may reach a
    rank, and the job must push afterwards."""
    sock = str(short_tmp / "serve.sock")
    with FakeServer(Behaviour()) as server:
        cmd = torchrun_cmd(
            CPU_PS_RANK, "serve", "--inference-parallel-size", "2",
            "--endpoint", server.endpoint, "--control-socket", sock,
        )  # fmt: skip
        with _job(cmd) as job:
            _wait_serving(job, sock)
            ranks = children(launcher_pid(job))
            assert len(ranks) == 2, ranks
            ports = [p for pid in ranks for p in tcp_listeners(pid)]
            assert ports, "no rank listens: the attack would prove nothing"
            reached = sum(flood(address, port, OPEN_FILES) for address, port in ports)
            push = _push(sock, "after-the-flood")
            if push.returncode != 0 and job.poll() is not None:
                raise AssertionError(f"the flood ended the job: {job.communicate()[1][-3000:]}")
            assert push.returncode == 0, push.stderr
            assert json.loads(push.stdout)["ok"] is True
            assert reached == 0, f"{reached} connections reached the ranks on {ports}"
            _stop(job, sock)


def test_the_command_group_of_a_one_node_job_listens_on_loopback_only(short_tmp: Path) -> None:
    """All ranks on one node (LOCAL_WORLD_SIZE == WORLD_SIZE): gloo is built on 127.0.0.1, not
    on GLOO_SOCKET_IFNAME (here one that does not exist, which the group would fail on) nor on
    what the host name resolves to."""
    sock = str(short_tmp / "serve.sock")
    env = {"GLOO_SOCKET_IFNAME": "nonexistent0"}
    with _job(torchrun_cmd(SERVE_RANK, sock), env=env) as job:
        _wait_serving(job, sock)
        ranks = children(launcher_pid(job))
        listeners = [p for pid in ranks for p in tcp_listeners(pid)]
        assert len(ranks) == 2 and listeners, (ranks, listeners)
        assert {address for address, _ in listeners} == {"127.0.0.1"}, listeners
        push = _push(sock, "on-loopback")
        assert push.returncode == 0, push.stderr
        _stop(job, sock)


def test_a_one_process_serve_job_listens_on_no_tcp_port(short_tmp: Path) -> None:
    """One process needs no network: its store lives in memory and it builds no command group.
    (A TCPStore of its own listened on every interface, and anyone could end the job there.)
    checkpoint-engine's own store, on MASTER_PORT+1, is stood in for here (SECURITY.md)."""
    sock = str(short_tmp / "serve.sock")
    with FakeServer(Behaviour()) as server:
        cmd = [
            sys.executable, CPU_PS_RANK, "serve", "--inference-parallel-size", "1",
            "--endpoint", server.endpoint, "--control-socket", sock,
        ]  # fmt: skip
        with _job(cmd) as job:
            _wait_serving(job, sock)
            assert tcp_listeners(job.pid) == []
            push = _push(sock, "one-process")
            assert push.returncode == 0, push.stderr
            doc = json.loads(push.stdout)
            assert doc["ok"] is True and len(doc["ranks"]) == 1
            assert tcp_listeners(job.pid) == []
            _stop(job, sock)

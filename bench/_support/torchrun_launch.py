"""Ports and the torchrun command line on loopback, for the benchmarks and the tests alike."""

from __future__ import annotations

import os
import random
import socket
import sys


def free_port() -> int:
    """A port free now, for a server started right away in this process. Another process may
    take it before it is used: for "nothing listens here" use `fake_server.reserved_port`, for torchrun
    `free_master_port`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            lo, hi = (int(x) for x in fh.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _port_band() -> range | None:
    """Where torchrun ports are picked: below the kernel's ephemeral range, which every
    bind(0) and every outgoing connection on the machine draws from at any moment, and a band
    of its own for each pytest-xdist worker, so that two workers never pick the same port.
    None when the ephemeral range leaves no room below it."""
    low, high = 20000, min(_ephemeral_range()[0], 32768)
    if high - low < 1000:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), index + 1)
    width = (high - low) // count
    return range(low + index * width, low + (index + 1) * width - 1)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_master_port() -> int:
    """A torchrun --master-port whose next port is free too (checkpoint-engine's store listens
    on MASTER_PORT+1). torchrun binds it seconds later, after importing torch: the port comes
    from this worker's band outside the ephemeral range (`_port_band`), so neither a parallel
    test nor the kernel hands it out meanwhile. `fake_server.run_torchrun` retries if it was taken all
    the same (another test suite on the machine)."""
    band = _port_band()
    while True:
        port = random.choice(band) if band is not None else free_port()
        if _bindable(port) and _bindable(port + 1):
            return port


def torchrun_cmd(
    *program: str, nproc: int = 2, nnodes: int = 1, node_rank: int = 0, port: int | None = None
) -> list[str]:
    """A real `torchrun` (torch.distributed.run) of `program` on loopback (tests and benches)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(port or free_master_port()),
        *program,
    ]  # fmt: skip

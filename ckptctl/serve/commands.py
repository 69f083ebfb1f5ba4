"""Commands from rank 0 to every rank over the job's own gloo group, never through the store.

torchrun's TCP store has no authentication and listens where anyone who can reach the node
can write to it, so no command travels through it. At start-up every rank builds a gloo
process group of its own: a `ProcessGroupGloo` met through the job's store (the way
torchrun's and NCCL's own rendezvous meet), apart from the NCCL default group that
checkpoint-engine uses. Afterwards everything goes over that group's TCP connections.

Every rank calls the same methods in the same order:

- `tick` (every ~0.1 s): an all-reduce of [the length of rank 0's next command, the length of
  each rank's stop reason]. A command then follows as a broadcast from rank 0; a stop (a
  signal to any rank, `ckptctl stop` on any node) as a broadcast from the first rank that
  asked, and every rank ends together.
- `gather`: each rank's result, to every rank (so that every node can answer `status`).

Payloads are JSON bytes in uint8 tensors, their lengths first: nothing is ever unpickled.
Every operation has a timeout; a rank that died fails the others' next operation at once (its
connections close), one that hangs fails it at the timeout, and the job then ends.

gloo's listening socket takes no connection once the group is up. gloo accepts every
connection queued on it, from anyone, before it reads from any, and aborts the process when an
accept fails, so a flood of bare connects (up to `ulimit -n`) could end the job. All pairs
connect while the group is built (lazy init off), so afterwards a socket filter that drops
every packet makes the listener unreachable; gloo has no way to close it. A job whose ranks all
run on one node (torchrun's LOCAL_WORLD_SIZE equal to WORLD_SIZE) builds the group on
127.0.0.1, so only local users can reach it even then; a job of one process builds no group.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptctl.errors import OperationFailed

STORE_PREFIX = "serve-commands/"
MAX_COMMAND_BYTES = 64 * 1024
MAX_STOP_REASON_BYTES = 1024
TICK_TIMEOUT_S = 60.0  # ranks reach each tick within milliseconds of one another


class CommandChannel:
    """The job's gloo group and the little protocol the serve loop speaks over it."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        """store: the job's store, on a connection of its own (the rendezvous blocks in it)."""
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self.rank = rank
        self.world_size = world_size
        self._pg: Any = None
        if world_size == 1:
            return  # every collective of one rank is a copy: no group, no port
        before = _tcp_listeners()  # (a gloo device listens from its creation on)
        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined] # (as torch builds it)
        opts._timeout = timedelta(seconds=TICK_TIMEOUT_S)
        try:
            opts._devices = _devices(world_size)
            opts._threads = 2 * len(opts._devices)
            self._pg = ProcessGroupGloo(PrefixStore(STORE_PREFIX, store), rank, world_size, opts)
        except RuntimeError as exc:
            raise OperationFailed(
                f"could not build the serve job's gloo group: {_first_line(exc)}"
            ) from None
        # Every pair is connected now: the listener gloo opened has nothing left to accept.
        for fd, inode in _tcp_listeners().items():
            if inode not in before.values():
                _drop_every_packet(fd)

    # -- the collectives ---------------------------------------------------------------------------
    def tick(
        self, command: bytes, stop_reason: str | None
    ) -> tuple[dict[str, Any] | None, tuple[int, str] | None]:
        """One round: (the command every rank runs now, or None; (rank, reason) of a stop, or None).
        `command` counts on rank 0 only; a stop wins over a command."""
        import torch

        if len(command) > MAX_COMMAND_BYTES:
            raise OperationFailed(f"a command of {len(command)} bytes exceeds {MAX_COMMAND_BYTES}")
        stop = (stop_reason or "").encode()[:MAX_STOP_REASON_BYTES]
        counts = torch.zeros(1 + self.world_size, dtype=torch.int64)
        if self.rank == 0:
            counts[0] = len(command)
        counts[1 + self.rank] = len(stop)
        self._all_reduce(counts, TICK_TIMEOUT_S)
        stops = counts[1:].tolist()
        asking = [r for r, n in enumerate(stops) if n > 0]
        if asking:
            r = asking[0]
            reason = self._broadcast(stop if self.rank == r else b"", stops[r], r, TICK_TIMEOUT_S)
            return None, (r, reason.decode("utf-8", errors="replace"))
        length = int(counts[0])
        if not length:
            return None, None
        data = self._broadcast(command if self.rank == 0 else b"", length, 0, TICK_TIMEOUT_S)
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise OperationFailed("rank 0 sent a command that is not a JSON object")
        return doc, None

    def gather(self, doc: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        """Every rank's `doc`, in rank order, on every rank (waiting up to `timeout_s` for the
        slowest: ranks arrive when their push is over)."""
        import torch

        data = json.dumps(doc).encode()
        mine = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._all_gather(lengths, mine, timeout_s)
        sizes = [int(t) for t in lengths]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: len(data)] = _as_tensor(data)
        outs = [torch.zeros(max(sizes), dtype=torch.uint8) for _ in range(self.world_size)]
        self._all_gather(outs, padded, TICK_TIMEOUT_S)
        return [json.loads(_as_bytes(t[:n])) for t, n in zip(outs, sizes, strict=True)]

    def close(self) -> None:
        """Destroy the group now, while the interpreter runs: left to the interpreter's exit,
        gloo's threads sometimes abort the process ("terminate called without an active
        exception", exit -6) once a peer has gone."""
        self._pg = None

    # -- gloo, bounded -----------------------------------------------------------------------------
    def _all_reduce(self, tensor: Any, timeout_s: float) -> None:
        from torch.distributed import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]
        opts.timeout = timedelta(seconds=timeout_s)
        if self._pg is not None:  # (one rank: the sum is the tensor itself)
            self._run(lambda: self._pg.allreduce([tensor], opts))

    def _broadcast(self, data: bytes, length: int, root: int, timeout_s: float) -> bytes:
        import torch
        from torch.distributed import BroadcastOptions

        buf = torch.zeros(length, dtype=torch.uint8)
        if self.rank == root:
            buf[:] = _as_tensor(data)
        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        opts.timeout = timedelta(seconds=timeout_s)
        if self._pg is not None:
            self._run(lambda: self._pg.broadcast([buf], opts))
        return _as_bytes(buf)

    def _all_gather(self, outs: list[Any], tensor: Any, timeout_s: float) -> None:
        from torch._C._distributed_c10d import AllgatherOptions

        opts = AllgatherOptions()
        opts.timeout = timedelta(seconds=timeout_s)
        if self._pg is None:
            outs[0].copy_(tensor)
            return
        self._run(lambda: self._pg.allgather([outs], [tensor], opts))

    def _run(self, start: Any) -> None:
        try:
            start().wait()
        except RuntimeError as exc:
            raise OperationFailed(
                f"the serve job lost contact with a rank ({_first_line(exc)}): it probably "
                "died or hangs - see its log"
            ) from None


def _devices(world_size: int) -> list[Any]:
    """gloo's devices, connecting every pair while the group is built (never lazily): on
    127.0.0.1 when every rank runs on this node, else as torch builds them (GLOO_SOCKET_IFNAME,
    or the address the host name resolves to)."""
    from torch.distributed import ProcessGroupGloo

    if os.environ.get("LOCAL_WORLD_SIZE", "").strip() == str(world_size):
        return [ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=False)]
    names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]
    if names:
        return [ProcessGroupGloo.create_device(interface=n.strip(), lazy_init=False) for n in names]
    return [ProcessGroupGloo.create_default_device(lazy_init=False)]


def _tcp_listeners() -> dict[int, str]:
    """This process's listening TCP sockets: fd -> "socket:[inode]" (an fd number alone may be
    reused between two looks). Read from /proc, without wrapping another library's sockets."""
    listening = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue  # (no IPv6)
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":  # TCP_LISTEN
                listening.add(f"socket:[{fields[9]}]")
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target in listening:
            found[int(name)] = target
    return found


SO_ATTACH_FILTER = 26  # Linux; Python's socket module does not name it


def _drop_every_packet(fd: int) -> None:
    """Attach a classic BPF filter that keeps nothing (`ret #0`) to the socket `fd`: its
    SYNs are dropped before a connection exists, so no connection ever reaches gloo's accept."""
    import ctypes

    class SockFilter(ctypes.Structure):
        _fields_ = [
            ("code", ctypes.c_uint16),
            ("jt", ctypes.c_uint8),
            ("jf", ctypes.c_uint8),
            ("k", ctypes.c_uint32),
        ]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]

    program = (SockFilter * 1)(SockFilter(0x06, 0, 0, 0))  # BPF_RET | BPF_K, 0 bytes kept
    prog = SockFprog(1, program)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setsockopt(
        fd, socket.SOL_SOCKET, SO_ATTACH_FILTER, ctypes.byref(prog), ctypes.sizeof(prog)
    ):
        raise OperationFailed(
            "could not close the serve job's gloo listener to new connections: "
            f"{os.strerror(ctypes.get_errno())}"
        )


def _as_tensor(data: bytes) -> Any:
    import torch

    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.zeros(0, dtype=torch.uint8)
    )


def _as_bytes(tensor: Any) -> bytes:
    return bytes(tensor.tolist())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]

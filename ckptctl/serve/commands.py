"""Commands from rank 0 to every rank over the job's own gloo group, never through the store.

torchrun's TCP store has no authentication and listens where anyone who can reach the node
can write to it, so no command travels through it. At start-up every rank builds a gloo
process group of its own: a `ProcessGroupGloo` met through the job's store (the way
torchrun's and NCCL's own rendezvous meet), apart from the NCCL default group that
checkpoint-engine uses. Afterwards everything goes over that group's TCP connections.

Every rank calls the same methods in the same order (each says how): `tick` (every ~0.1 s:
rank 0's next command, or a stop from any rank, on which every rank ends together), `gather`
(each rank's result, to every rank, so that every node can answer `status`) and `Exchanges`
(what the ranks of one push must agree on while it runs).

A command is a `ServeCommand`: parsed and bounded once, where a client's request enters
(loop.py's handlers), and sent as its JSON, which every rank parses with the same parser.
Payloads are JSON bytes in uint8 tensors, their lengths first: nothing is ever unpickled.
Every operation has a timeout; a rank that died fails the others' next operation at once (its
connections close), one that hangs fails it at the timeout, and the job then ends (GroupLost).

gloo's listening socket takes no connection once the group is up. gloo accepts every
connection queued on it, from anyone, before it reads from any, and aborts the process when an
accept fails, so a flood of bare connects (up to `ulimit -n`) could end the job. All pairs
connect while the group is built (lazy init off), so afterwards a socket filter that drops
every packet makes the listener unreachable; gloo has no way to close it. A job whose ranks all
run on one node (torchrun's LOCAL_WORLD_SIZE equal to WORLD_SIZE) builds the group on
127.0.0.1, so only local users can reach it even then; a job of one process builds no group.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from ckptctl.errors import OperationFailed, error_for
from ckptctl.settings import PauseMode

STORE_PREFIX = "serve-commands/"
MAX_COMMAND_BYTES = 64 * 1024
MAX_STOP_REASON_BYTES = 1024
TICK_TIMEOUT_S = 60.0  # ranks reach each tick within milliseconds of one another


# -- the command -------------------------------------------------------------------------------

# Each string's bound, in the bytes it stands for (UTF-8; a path's undecodable bytes as the OS
# gives them back). JSON escapes a character into at most six bytes per byte it stands for
# ("\u0001", "\udcff"), so the widest command, every string at its bound, still encodes under
# MAX_COMMAND_BYTES (tests/unit/test_serve_command.py builds it).
TEXT_BOUNDS = {
    "checkpoint_path": 4096,
    "trace": 4096,
    "checkpoint_name": 1024,
    "weight_version": 1024,
    "push_id": 256,
    "started_at": 64,
}
FLAGS = ("consume_shm_files", "verify", "allow_layout_change")
# What a client may send with each request; "restore" is the job's own (after a failed push).
CLIENT_FIELDS = {
    "push": {
        "checkpoint_path",
        "checkpoint_name",
        "weight_version",
        "push_id",
        "trace",
        "pause",
        *FLAGS,
    },
    "stage": {"checkpoint_path", "push_id", "allow_layout_change"},
    "rollback": {"push_id"},
}
ACTIONS = ("push", "stage", "rollback", "restore")
PAUSE_VALUES = tuple(m.value for m in PauseMode)
MAX_SEQ = 2**53  # (exact in any JSON reader)


class BadCommand(ValueError):
    """A request the job refuses (HTTP 400), with why."""


@dataclass(frozen=True)
class ServeCommand:
    """One command of a serve job, as every rank runs it."""

    action: str  # one of ACTIONS
    checkpoint_path: str
    seq: int = 0  # the job's number for it (given when it is queued)
    checkpoint_name: str | None = None
    weight_version: str | None = None
    consume_shm_files: bool = False
    verify: bool = False
    push_id: str | None = None  # the client's own name for it, to cancel it by
    allow_layout_change: bool = False
    trace: str | None = None  # push --trace FILE: where rank 0 writes its timeline
    restores: int | None = None  # a restore's or rollback's: the push whose checkpoint it is
    started_at: str | None = None  # when rank 0 sent it to every rank
    pause: PauseMode | None = None  # push --pause MODE; None: serve's own

    def __post_init__(self) -> None:
        if type(self.pause) is str and self.pause in PAUSE_VALUES:  # (as JSON brings it)
            object.__setattr__(self, "pause", PauseMode(self.pause))
        problem = _problem(self)
        if problem:
            raise BadCommand(problem)

    @classmethod
    def from_request(cls, action: str, doc: Any) -> ServeCommand:
        """A client's push or stage request (`doc`: its parsed JSON body); BadCommand says
        what is wrong with it."""
        if not isinstance(doc, dict):
            raise BadCommand(f'{action} needs a JSON object: {{"checkpoint_path": DIR, ...}}')
        _known_fields(action, doc)
        if not isinstance(doc.get("checkpoint_path"), str) or not doc["checkpoint_path"]:
            raise BadCommand(f'{action} needs {{"checkpoint_path": DIR}}')
        return cls(action=action, **doc)

    def to_json(self) -> bytes:
        """What rank 0 sends every rank (ASCII: every character outside it escaped)."""
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ServeCommand:
        """A command as rank 0 sent it, checked as the control socket checked it."""
        if len(data) > MAX_COMMAND_BYTES:
            raise BadCommand(f"a command of {len(data)} bytes exceeds {MAX_COMMAND_BYTES}")
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            raise BadCommand("a command that is not JSON") from None
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(doc, dict) or set(doc) != names:
            raise BadCommand("a command whose fields are not a serve command's")
        return cls(**doc)


def push_id_of(doc: Any, what: str) -> str | None:
    """The `push_id` of a request that takes nothing else (`what`: rollback, cancel)."""
    if doc is None:
        return None
    if not isinstance(doc, dict) or set(doc) - {"push_id"}:
        raise BadCommand(f'{what} takes no fields but "push_id"')
    push_id = doc.get("push_id")
    problem = _text_problem("push_id", push_id)
    if problem:
        raise BadCommand(problem)
    return push_id


def _known_fields(action: str, doc: dict[str, Any]) -> None:
    known = CLIENT_FIELDS[action]
    unknown = sorted(set(doc) - known)
    if unknown:
        shown = ", ".join(repr(name[:40]) for name in unknown[:5])
        raise BadCommand(f"unknown fields [{shown}]; known: {sorted(known)}")


def _problem(command: ServeCommand) -> str | None:
    """Why `command` cannot be a serve command, or None."""
    if command.action not in ACTIONS:
        return f"no such command: {str(command.action)[:40]!r}"
    for name in ("seq", "restores"):
        value = getattr(command, name)
        if (value is not None or name == "seq") and not (
            type(value) is int and 0 <= value < MAX_SEQ
        ):
            return f"{name} must be a whole number"
    for name in TEXT_BOUNDS:
        problem = _text_problem(name, getattr(command, name))
        if problem:
            return problem
    if not command.checkpoint_path:
        return f'{command.action} needs {{"checkpoint_path": DIR}}'
    if command.trace is not None and not command.trace.startswith("/"):
        return "trace must be an absolute path"
    if command.pause is not None and not isinstance(command.pause, PauseMode):
        return f"pause must be one of {', '.join(PAUSE_VALUES)}"
    for name in FLAGS:
        if type(getattr(command, name)) is not bool:
            return f"{name} must be true or false"
    return None


def _text_problem(name: str, value: Any) -> str | None:
    """Why `value` cannot be the text field `name` (None and bounded text can)."""
    if value is None:
        return None
    bound = TEXT_BOUNDS[name]
    wrong = f"{name} must be a string of at most {bound} bytes (UTF-8), without NUL"
    if not isinstance(value, str) or len(value) > bound or "\0" in value:
        return wrong
    try:
        size = len(value.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # a lone surrogate: no bytes stand for it
        return wrong
    return wrong if size > bound else None


class GroupLost(OperationFailed):
    """The job's group failed (a rank died or hangs): the ranks can no longer run commands in
    step, so the job ends - the one failure of a command that ends it."""


class CommandChannel:
    """The job's gloo group and the little protocol the serve loop speaks over it."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        """store: the job's store, on a connection of its own (the rendezvous blocks in it)."""
        from torch.distributed import PrefixStore, ProcessGroupGloo

        self.rank = rank
        self.world_size = world_size
        self._pg: Any = None
        self._lost: str | None = None  # why an operation failed: the group is unusable since
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
    def tick(self, command: bytes, stop_reason: str | None) -> tuple[bytes, tuple[int, str] | None]:
        """One round: (the command every rank runs now - a ServeCommand's JSON, b"" for none;
        (rank, reason) of a stop, or None). `command` counts on rank 0 only; a stop wins over a
        command."""
        import torch

        if len(command) > MAX_COMMAND_BYTES:  # (ServeCommand's bounds keep every command under)
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
            return b"", (r, reason.decode("utf-8", errors="replace"))
        length = int(counts[0])
        if not length:
            return b"", None
        return self._broadcast(command if self.rank == 0 else b"", length, 0, TICK_TIMEOUT_S), None

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
        if self._lost is not None:  # its collectives are out of step for good: never pair them
            raise GroupLost(self._lost)
        try:
            start().wait()
        except RuntimeError as exc:
            self._lost = (
                f"the serve job lost contact with a rank ({_first_line(exc)}): it probably "
                "died or hangs - see its log"
            )
            raise GroupLost(self._lost) from None


class Exchanges:
    """The exchanges of one command between its ranks, over the job's group (`gather`).

    Every rank makes the same exchanges in the same order, `names` (the command decides them,
    alike on every rank: serve/push.exchanges_of). A rank whose command failed before one of
    them still makes it, with its error instead of its part (`finish`): the group's
    collectives stay paired, and the others fail with that error at the exchange, never
    waiting for a part that does not come."""

    def __init__(
        self, channel: CommandChannel, names: tuple[str, ...], timeout: Callable[[], float]
    ) -> None:
        self._channel = channel
        self._names = names
        self._made = 0
        self._timeout = timeout  # how long the next exchange may wait for the slowest rank

    def __call__(self, name: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `doc` of exchange `name`, in rank order; a rank that failed before it
        fails this one here with its error."""
        if self._made >= len(self._names) or self._names[self._made] != name:
            # A bug of ours: no rank may make an exchange the others do not expect.
            raise OperationFailed(f"exchange {name!r} out of order: expected {self._names}")
        self._made += 1
        docs = self._channel.gather({"ok": True, "doc": doc}, self._timeout())
        for rank, got in enumerate(docs):
            if not got.get("ok"):
                raise error_for(
                    int(got.get("code") or 1), f"rank {rank} failed: {got.get('error')}"
                )
        return [got["doc"] for got in docs]

    def finish(self, code: int, error: str | None) -> None:
        """Make the exchanges this rank did not (its command failed before them: `error`)."""
        while self._made < len(self._names):
            self._made += 1
            self._channel.gather({"ok": False, "code": code, "error": error}, self._timeout())


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
    """A contiguous uint8 tensor's bytes, copied at once (tolist would make an int of each)."""
    import ctypes

    tensor = tensor.contiguous()
    return ctypes.string_at(tensor.data_ptr(), tensor.numel()) if tensor.numel() else b""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]

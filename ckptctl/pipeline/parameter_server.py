"""checkpoint-engine's ParameterServer, with its known traps disarmed.

- Broadcast never touches mooncake: an installed mooncake without RDMA makes the constructor
  raise for every method, so for broadcast the import is blocked and p2p stays off.
- p2p / all are checked before anything is loaded: mooncake importable, an RDMA device present.
- The zmq REQ socket the PS talks to the server's worker through is wrapped, so that
  * every reply is seen: checkpoint-engine throws away the reply to the LAST bucket, so an
    error while the server loads it would otherwise pass as success;
  * sends and receives are bounded: a REQ socket with no peer blocks forever.
- A failed p2p read (the holder is gone, or died mid-transfer) ends the transfer at once:
  checkpoint-engine would wait forever for the server's worker, which waits for the next
  bucket (`watch_p2p_reads`).
- checkpoint files are never handed over as `files=`: for /dev/shm files checkpoint-engine
  pins them in place and DELETES them. We hand over read-only views of the file mapping -
  unless the user asks for exactly that with --consume-shm-files (register_files).

This module imports torch and checkpoint-engine; the CLI imports it only inside `update`.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import importlib.util
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ckptctl.errors import (
    PARTIAL_WEIGHTS_NOTE,
    ExitCode,
    InvalidInput,
    OperationFailed,
    print_error,
)
from ckptctl.pipeline.coordination import PAST_DEADLINE_S


def block_mooncake() -> None:
    """Make `import mooncake` fail with ImportError, which checkpoint-engine treats as 'no p2p'."""
    for name in ("mooncake", "mooncake.engine"):
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]


def prefer_system_unwinder() -> None:
    """Put the system's libgcc_s in the global symbol scope before mooncake loads.

    mooncake-transfer-engine's wheel (0.3.9) bundles libunwind, which exports
    `_Unwind_RaiseException` as libgcc_s does. In a process that loaded torch and zmq first, a
    C++ exception thrown inside mooncake - a refused connection to a holder that is gone - is
    then unwound half by one library and half by the other: the process aborts or segfaults
    (seen on CPU) instead of mooncake returning its error. With libgcc_s global, every library
    unwinds with it (tests/test_p2p_cpu.py, where mooncake loads).
    """
    import ctypes

    with contextlib.suppress(OSError):  # no such library (not glibc): nothing to prefer
        ctypes.CDLL("libgcc_s.so.1", mode=ctypes.RTLD_GLOBAL)


def p2p_missing() -> str | None:
    """Why p2p cannot work here, or None when it can (mooncake and an RDMA device)."""
    try:
        found = importlib.util.find_spec("mooncake") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "mooncake is not installed (pip install 'checkpoint-engine[p2p]')"
    if not (
        glob.glob("/sys/class/infiniband/*")
        or os.environ.get("PS_P2P_STORE_RDMA_DEVICES")
        or os.environ.get("NCCL_IB_HCA")
    ):
        return "no RDMA device (/sys/class/infiniband is empty and no NCCL_IB_HCA is set)"
    return None


def _hint(exc: Exception, p2p: str) -> str:
    if "EADDRINUSE" in str(exc):
        port = int(os.environ.get("MASTER_PORT", "0")) + 1
        return (
            f" (checkpoint-engine's store listens on MASTER_PORT+1 = {port}, which is taken: "
            "give torchrun a --master-port whose next port is free)"
        )
    return "" if p2p == "off" else " (p2p needs a working RDMA NIC)"


# How often a blocked exchange looks whether its transfer was cancelled, and how long a
# cancelled one still waits for a worker that may yet answer.
POLL_MS = 100
CANCEL_GRACE_MS = 2000
_POLLIN, _POLLOUT = 1, 2  # zmq.POLLIN, zmq.POLLOUT (zmq is imported lazily)


class ReplyWatchingSocket:
    """A stand-in for the PS's zmq REQ socket that keeps every non-empty (error) reply, and
    that a failed push can end (`cancel`) while checkpoint-engine blocks in it."""

    def __init__(
        self, socket: Any, timeout_ms: int, on_bucket: Callable[[int], None] | None = None
    ) -> None:
        import zmq

        self._socket = socket
        self.errors: list[str] = []
        # Progress: called with a bucket's bytes once the worker's reply says it has loaded it.
        self.on_bucket = on_bucket
        self._bucket_in_flight = 0
        self._nones_sent = 0
        self.handle: Any = None  # the first message: the CUDA IPC handle of the PS's buffer
        self._replies = 0
        # The PS ends every transfer with None, None; the reply to the second means the
        # server's worker has loaded everything and run its post-hook.
        self.finished = threading.Event()
        # Set once the first message (the IPC handle) has left: a peer (the server's worker)
        # has connected. Until then a stand-in peer can end the transfer (see `rescue`).
        self.handle_sent = threading.Event()
        self.rescued = False  # the handle went to our stand-in peer (`rescue`), not a worker
        # Set (from any thread) by `cancel`: the transfer must end although a worker took part.
        self.cancelled: str | None = None
        # Once a reply was made up or a send dropped, the real socket is out of step with the
        # PS: every later exchange is made up too.
        self._detached = False
        self._timeout_ms = timeout_ms
        self._peer_gone = False  # found after a cancel: the worker's process died (`settle`)
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        socket.setsockopt(zmq.LINGER, 0)
        # Lets a cancelled transfer still hand a slow worker the exception it raises, with its
        # reply still owed (`send_pyobj`); the PS itself never sends twice in a row.
        socket.setsockopt(zmq.REQ_RELAXED, 1)
        socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        socket.setsockopt(zmq.RCVTIMEO, timeout_ms)

    def send_pyobj(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        import zmq

        if obj is None:
            self._nones_sent += 1
        elif self.handle is None:
            self.handle = obj
        elif isinstance(obj, list):  # a bucket's metas: [{name, dtype, shape, offset}, ...]
            self._bucket_in_flight = bucket_bytes(obj)
        if not self._wait_for(_POLLOUT):
            # Cancelled, and the worker did not answer in time. A relaxed REQ socket can still
            # send while it has a peer: a worker that is only slow is there; one whose
            # process died is not.
            self._peer_gone = not self._socket.poll(0, zmq.POLLOUT)
            if isinstance(obj, Exception) and not self._peer_gone:
                # checkpoint-engine's "give up": the worker takes it once its bucket is loaded
                # and raises, instead of waiting forever for a bucket that never comes (and
                # its server's update with it).
                with contextlib.suppress(zmq.ZMQError):
                    self._socket.send_pyobj(obj, zmq.NOBLOCK)
            return None  # dropped
        sent = self._socket.send_pyobj(obj, *args, **kwargs)
        self.handle_sent.set()
        return sent

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        if not self._wait_for(_POLLIN):
            # Cancelled: a made-up error reply, which sends checkpoint-engine down its own
            # error path (the all-reduce of return codes, then its exception) on every rank.
            self._bucket_in_flight = 0
            return self._cancel_reply()
        reply = self._socket.recv(*args, **kwargs)
        self._replies += 1
        if self._bucket_in_flight and reply == b"" and self.on_bucket is not None:
            self.on_bucket(self._bucket_in_flight)
        self._bucket_in_flight = 0
        if reply != b"":
            self.errors.append(reply.decode("utf-8", errors="replace"))
            if self._replies == 1 and reply.startswith(RESCUE_PREFIX.encode()):
                # The handle went to our stand-in (a REQ socket's reply comes from the peer
                # that took the message), which never opens it: give its reference back.
                self._release_handle()
        if self._nones_sent >= 2:
            self.finished.set()
        if reply == b"" and self.cancelled is not None:
            # A worker that answers, after a cancel: the same made-up error, so that every rank
            # leaves at this bucket and the worker is told to give up (not sent the next one).
            return self._cancel_reply()
        return reply

    def cancel(self, message: str) -> None:
        """End this transfer although a worker took the handle (its server died, hangs, or the
        push was stopped). Only a flag: the PS's thread, blocked in `recv` or `send_pyobj`,
        acts on it within POLL_MS. From then on every reply the PS reads is a made-up error:
        a worker that answers its bucket (within CANCEL_GRACE_MS) is then told to give up
        (checkpoint-engine's own message, which it raises); one that is gone gets nothing
        more (see `settle`)."""
        if self.cancelled is None:
            self.cancelled = message

    def _cancel_reply(self) -> bytes:
        """The error reply every exchange after a cancel gets, whatever the worker answered."""
        return f"ckptctl: {self.cancelled}".encode()

    def settle(self) -> None:
        """Once the transfer is over: give back the IPC reference of a worker that took the
        handle and died during a cancelled transfer. A consumer releases its reference when it
        lets go of the buffer; one that died never does, and torch would keep the PS's transfer
        buffer (twice the bucket size) until the job ends. A worker that is only slow keeps
        it, and releases it itself."""
        if self._detached and self._peer_gone and self.handle_sent.is_set() and not self.rescued:
            self._release_handle()

    def _wait_for(self, event: int) -> bool:
        """Wait until the socket can `event` (True), or until the transfer is cancelled and no
        worker can take part any more (False). Past the socket's own timeout, zmq.Again, as a
        blocking call would raise."""
        import zmq

        if self._detached:
            return False
        deadline = time.monotonic() + self._timeout_ms / 1000
        while True:
            if self.cancelled is not None:
                if self._socket.poll(CANCEL_GRACE_MS, event):
                    return True
                self._detached = True
                return False
            left_ms = (deadline - time.monotonic()) * 1000
            if left_ms <= 0:
                raise zmq.Again()
            if self._socket.poll(min(POLL_MS, max(int(left_ms), 1)), event):
                return True

    def _release_handle(self) -> None:
        try:
            release_ipc_reference(self.handle)
        except Exception as exc:  # noqa: BLE001 - a leak is worth a warning, not a crash
            print_error(
                "could not release the failed update's IPC buffer (it stays allocated until "
                f"the job ends): {exc}",
                label="warning",
            )

    def abort(self, message: str, timeout_s: float = 10.0) -> bool:
        """Tell the server's worker to give up this transfer, as checkpoint-engine does when a
        worker failed: take the reply the worker owes us, then send it an exception, which it
        raises. Its server then answers the update with an error and stays usable, instead of
        waiting forever for a bucket that will never come. Only while a message of ours is
        waiting for its reply - at every point of checkpoint-engine's bucket loop where it reads
        over p2p. False if the worker did not take part (or not in time)."""
        import zmq

        if not self.handle_sent.is_set():
            return False
        self._timeout_ms = int(timeout_s * 1000)
        self._socket.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        try:
            self.recv()
            self._socket.send_pyobj(RuntimeError(f"ckptctl: {message}"))
        except zmq.ZMQError:
            return False
        return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def bucket_bytes(metas: list[Any]) -> int:
    """The bytes of the tensors a bucket's metas name (dtype × shape; 0 for what is not such a
    list): what the worker copies out of the IPC buffer for it."""
    total = 0
    for meta in metas:
        try:
            total += math.prod(meta["shape"]) * meta["dtype"].itemsize
        except (KeyError, TypeError, AttributeError):
            continue
    return total


def watch_p2p_reads(store: Any, on_failed_read: Callable[[str], None]) -> None:
    """Make a failed p2p read of checkpoint-engine's `P2PStore` call `on_failed_read` (with one
    line that names the holder) before it raises.

    checkpoint-engine asserts that mooncake's `batch_transfer_sync_read` returned 0, inside its
    bucket loop; its `finally` then joins the request thread, whose server's worker waits for
    the next bucket with no timeout: a holder that is gone would hang the joiner (and wedge the
    server) until --timeout. `on_failed_read` ends the transfer instead.
    """
    read = store.batch_transfer_sync_read

    def checked_read(target: str, buf_ptrs: Any, remote_ptrs: Any, lens: Any) -> Any:
        try:
            return read(target, buf_ptrs, remote_ptrs, lens)
        except Exception as exc:  # noqa: BLE001 - mooncake's failure is a bare AssertionError
            why = f": {type(exc).__name__}: {exc}" if str(exc) else ""
            message = (
                f"p2p read of {sum(lens)} bytes from the holder at {target} failed{why} "
                "(the holder is gone, or its network is unreachable)"
            )
            on_failed_read(message)
            raise OperationFailed(message) from None

    store.batch_transfer_sync_read = checked_read


def unique_socket_counter() -> int:
    """Where this process's count of checkpoint-engine's zmq sockets starts.

    checkpoint-engine names the socket of every update
    `ipc://@checkpoint-engine-<GPU uuid>-<count>.sock`, in the host's shared abstract
    namespace, and counts from 0 in every process: two jobs that update through one GPU at a
    time (a serve job and an update, a save-metas holder beside a joiner, tests run side by
    side) bind the same name, and the second fails with EADDRINUSE (seen on 2x H200); the
    names are also easy to guess for anyone on the host. A random start gives each job names of
    its own. The ranks still agree: checkpoint-engine all-reduces the largest count before
    every update (`_detect_bucket_size`), and each rank names every rank's socket with it.
    """
    import secrets

    return secrets.randbits(40) << 16  # room for 65536 updates before any overlap


def release_ipc_reference(handle: Any) -> bool:
    """Give back the reference a consumer of a CUDA IPC handle would have released.

    `handle` is what torch's `reduce_tensor` made of a CUDA tensor: `(rebuild_cuda_tensor,
    args)`. Sharing counts a reference in a file that the consumer decrements when it lets go;
    a buffer freed while the count is up stays allocated until the process ends. Our stand-in
    peer (`rescue`) takes the handle and never opens it, so it releases the count the way
    torch's own consumer does when it already holds the storage. False if `handle` is not
    such a tuple (nothing done).
    """
    try:
        rebuild, args = handle
    except (TypeError, ValueError):
        return False
    if getattr(rebuild, "__name__", "") != "rebuild_cuda_tensor" or len(args) != 15:
        return False
    storage_cls, device, counter_handle, counter_offset = args[4], args[6], args[11], args[12]
    storage_cls._release_ipc_counter(counter_handle, counter_offset, device=device)
    return True


RESCUE_PREFIX = "ckptctl: the push failed"


def rescue(endpoint: str, message: str, timeout_s: float = 30.0) -> threading.Thread:
    """End a transfer whose server never connected, without ending the process.

    checkpoint-engine's REQ socket blocks until a peer connects. When the server refused (and
    so never will), a REP socket of ours connects in its place, takes the IPC handle (as raw
    bytes: never unpickled), answers with an error, and takes the abort message that follows:
    checkpoint-engine then fails the update on every rank through its own error path, and the
    ParameterServer stays usable for the next push.
    """
    import zmq

    def run() -> None:
        ctx = zmq.Context()
        rep = ctx.socket(zmq.REP)
        rep.setsockopt(zmq.LINGER, 0)
        rep.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        rep.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        try:
            rep.connect(endpoint)
            rep.recv()  # the IPC handle (its reference is released on the PS's side)
            rep.send(f"{RESCUE_PREFIX}: {message}".encode())
            rep.recv()  # the PS's "workers failed" notice; nothing is answered after it
        except zmq.ZMQError:
            pass  # the PS gave up first: nothing left to end
        finally:
            rep.close()
            ctx.term()

    thread = threading.Thread(target=run, name="ckptctl-rescue", daemon=True)
    thread.start()
    return thread


def own_facts(ps: Any, name: str) -> dict[str, Any]:
    """What this rank's ParameterServer adds to the plan for `gather_planned`: its buffers'
    addresses, sizes and tensor counts, its host, GPU and p2p store (what gather_metas sends)."""
    from ckptctl.pipeline.ce_import import engine_module

    own = ps._memory_pool.get(name, [])
    return {
        "ptrs": [b.buffer.data_ptr() for b in own],
        "sizes": [b.size for b in own],
        "tensors": [len(b.metas) for b in own],
        "p2p_store_addr": None if ps._p2p_store is None else ps._p2p_store.addr,
        "host_ip": engine_module("device_utils").get_ip(),
        "device_uuid": ps._device_uuid,
        "rdma_device": ps._rdma_device or "",
    }


def all_gather_json(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `doc`, in rank order, over the job's process group: JSON bytes in two
    all_gathers (lengths, then the padded bytes), never a pickle."""
    import json

    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    data = json.dumps(doc).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    sizes = [int(n.item()) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    padded = padded.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [json.loads(bytes(g[:n].cpu().tolist())) for g, n in zip(gathered, sizes, strict=True)]


def apply_gathered(
    ps: Any, docs: list[dict[str, Any]], planned: dict[int, list[tuple[int, list[Any]]]]
) -> None:
    """Leave `ps` as checkpoint-engine's gather_metas would: the global metas (ranks without
    buffers left out), the hosts and GPU UUIDs (kept from the first gather), the RDMA
    topology. tests/test_gather_planned.py runs checkpoint-engine's own gather_metas beside
    this and compares everything it sets, so a change there fails a test, not an update."""
    from ckptctl.pipeline.ce_import import engine_module

    types = engine_module("data_types")
    global_metas: dict[int, Any] = {}
    all_hosts: list[str] = []
    device_uuids: list[str] = []
    for rank, doc in enumerate(docs):
        buffers = planned.get(rank, [])
        if doc["sizes"] != [size for size, _ in buffers] or doc["tensors"] != [
            len(metas) for _, metas in buffers
        ]:
            raise OperationFailed(
                f"rank {rank} registered buffers of {doc['sizes']} bytes, not the "
                f"{[size for size, _ in buffers]} this rank planned for it: the ranks run "
                "different ckptctl versions or see different checkpoints"
            )
        if rank % ps._gpu_count == 0 and not ps._all_hosts:
            all_hosts.append(doc["host_ip"])
        if not ps._global_device_uuids:
            device_uuids.append(doc["device_uuid"])
        if buffers:
            global_metas[rank] = types.MemoryBufferMetaList.model_construct(
                p2p_store_addr=doc["p2p_store_addr"],
                rdma_device=doc["rdma_device"],
                memory_buffer_metas_list=[
                    types.MemoryBufferMetas.model_construct(metas=metas, ptr=ptr, size=size)
                    for (size, metas), ptr in zip(buffers, doc["ptrs"], strict=True)
                ],
            )
        addr = doc["p2p_store_addr"]
        key = doc["rdma_device"] + "@" + addr.split(":")[0] if addr else doc["host_ip"]
        ps._local_rdma_devices[key].add(rank)
    ps._current_global_parameter_metas = global_metas
    if not ps._all_hosts:
        ps._all_hosts = all_hosts
    if not ps._global_device_uuids:
        ps._global_device_uuids = device_uuids
    ps._remote_rdma_devices = ps._local_rdma_devices.copy()


def last_line(traceback_text: str) -> str:
    lines = [line.strip() for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def drop_frames(exc: BaseException) -> None:
    """Let go of the frames a failed update's exception holds.

    checkpoint-engine's `_update_per_bucket` holds its transfer buffers in locals: a 16 GiB
    double buffer and an 8 GiB host-to-device buffer with the default bucket size. A traceback
    keeps those frames, and so the buffers, alive for as long as anything keeps the
    exception (a chained `__cause__`, a variable in a long-lived loop): every refused push of
    a `serve` job then kept 24 GiB of GPU memory. The caller keeps a text copy of the
    traceback for CKPTCTL_DEBUG instead.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        pending += [e.__cause__, e.__context__]


def release_transfer_memory() -> None:
    """Hand a failed update's GPU memory back to the device, for the inference server that
    shares it. checkpoint-engine empties torch's cache in its own `finally`, while the
    failing frames still hold the buffers; once `drop_frames` has let go of them, this
    returns them (and IPC blocks whose last reference is gone) to the driver."""
    import torch

    gc.collect()  # an exception and its frames can hold each other in a cycle
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


class TransferSockets:
    """The zmq sockets of the current update (one per bind), and how a failed push ends them:
    `rescue` before a server's worker took the handle, `cancel` after."""

    sockets: list[ReplyWatchingSocket]

    def rescue(self, message: str) -> bool:
        """End the current transfer if its server never connected (see `rescue`); False when a
        worker is already attached (then `cancel` ends it)."""
        if not self.sockets or self.sockets[-1].handle_sent.is_set():
            return False
        self.sockets[-1].rescued = True
        rescue(self.sockets[-1].endpoint, message)
        return True

    def cancel(self, message: str) -> None:
        """End the current transfer although workers took the handle (see
        ReplyWatchingSocket.cancel); `update` then raises with `message`."""
        for s in self.sockets:
            s.cancel(message)

    def cancelled(self) -> str | None:
        return next((s.cancelled for s in self.sockets if s.cancelled is not None), None)

    def workers_connected(self) -> bool:
        """Whether a server's worker took the current update's IPC handle: from then on a
        failure may leave the server with a mix of old and new weights."""
        return any(s.handle_sent.is_set() and not s.rescued for s in self.sockets)

    def wait_transfer_finished(self, timeout: float) -> bool:
        """Wait until the current transfer's last reply came back (called from the req thread)."""
        return bool(self.sockets) and self.sockets[-1].finished.wait(timeout)

    def _worker_errors(self) -> list[str]:
        # (A rescued transfer's one reply is our stand-in's, not a worker's.)
        return [e for s in self.sockets if not s.rescued for e in s.errors]


class ParameterServerSession(TransferSockets):
    """One rank's ParameterServer and what we need around it."""

    def __init__(
        self,
        *,
        p2p: str,
        io_timeout: Callable[[], float],
        group_store: Any = None,
        on_failure: Callable[[int, str], None] | None = None,
        group_timeout_s: float | None = None,
    ) -> None:
        """p2p: "off" (mooncake is never imported), "optional" (use it if it starts: joinable
        metas), or "required" (p2p/all updates, join). group_store: the job's store, where
        the ranks meet to build the NCCL group (None for a job of one process). on_failure:
        where a failure that checkpoint-engine would sit on goes (the watchdog's `fail`).
        group_timeout_s: the NCCL group's collective timeout (process_group.group_timeout_s)."""
        if p2p == "off":
            block_mooncake()
        else:
            prefer_system_unwinder()
        import torch

        if not torch.cuda.is_available():
            # (Every GPU command comes here - update, save-metas, join, serve: only `update`
            # has a --dry-run, so the hint names the command.)
            raise OperationFailed(
                "no CUDA device: every rank needs one GPU (check CUDA_VISIBLE_DEVICES); "
                "`ckptctl update --dry-run` plans a split without one"
            )
        from ckptctl.pipeline.process_group import (
            MIN_TIMEOUT_S,
            BackgroundProcessGroup,
            local_device_index,
        )

        # First, so that it overlaps everything up to the first gather (process_group.py).
        rank = int(os.environ["RANK"])
        self._group = BackgroundProcessGroup(
            rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            store=group_store,
            device_index=local_device_index(rank),
            timeout_s=group_timeout_s or MIN_TIMEOUT_S,
        )
        from ckptctl.pipeline.ce_import import engine_module

        ParameterServer = engine_module("ps").ParameterServer  # noqa: N806 - a class

        self._io_timeout = io_timeout
        self.p2p_error: str | None = None
        try:
            self.ps = ParameterServer(auto_pg=False)
        except (RuntimeError, OSError) as exc:
            # mooncake installed but no usable NIC (checkpoint-engine issue #1) raises here
            # for every method: when p2p was only a nicety, retry without it.
            if "EADDRINUSE" in str(exc) or p2p != "optional":
                raise OperationFailed(
                    f"checkpoint-engine's parameter server did not start: {exc}" + _hint(exc, p2p)
                ) from exc
            self.p2p_error = str(exc)
            block_mooncake()
            self.ps = ParameterServer(auto_pg=False)
        if p2p == "required" and self.ps._p2p_store is None:
            raise InvalidInput("p2p was asked for but checkpoint-engine's p2p store did not start")
        self.ps._zmq_addr_counter = unique_socket_counter()
        self.sockets: list[ReplyWatchingSocket] = []  # the current update's (one per bind)
        # Set by the update stage: called with each bucket's bytes once the worker loaded it.
        self.on_bucket_loaded: Callable[[int], None] | None = None
        self._wrap_socket_factory()
        self._on_failure = on_failure
        if self.ps._p2p_store is not None:
            watch_p2p_reads(self.ps._p2p_store, self._p2p_read_failed)

    def _bucket_loaded(self, nbytes: int) -> None:
        if self.on_bucket_loaded is not None:
            self.on_bucket_loaded(nbytes)

    def _wrap_socket_factory(self) -> None:
        bind = getattr(self.ps, "_bind_zmq_socket", None)
        if bind is None:  # a checkpoint-engine we do not know: refuse rather than lose errors
            raise OperationFailed(
                "this checkpoint-engine version has no ParameterServer._bind_zmq_socket; "
                "install checkpoint-engine>=0.4.2,<0.5"
            )

        def bind_watched() -> tuple[Any, list[tuple[str, str]]]:
            socket, paths = bind()
            # Past the deadline (they raced on 2x H200: exit 1 instead of the watchdog's 4).
            timeout_ms = max(int((self._io_timeout() + PAST_DEADLINE_S) * 1000), 1)
            watched = ReplyWatchingSocket(socket, timeout_ms, on_bucket=self._bucket_loaded)
            self.sockets.append(watched)
            return watched, paths

        self.ps._bind_zmq_socket = bind_watched

    def _p2p_read_failed(self, message: str) -> None:
        """Abort the server's worker (so that it does not wait for the next bucket), then fail
        the job: the other ranks sit in the bucket's broadcast until the watchdog ends them."""
        if self.sockets:
            self.sockets[-1].abort(message)
        if self._on_failure is not None:
            self._on_failure(ExitCode.FAILED, message)

    @property
    def device_uuid(self) -> str:
        return str(self.ps._device_uuid)

    def register(self, name: str, named_tensors: dict[str, Any]) -> None:
        if named_tensors:
            # named_tensors, never files=: see the module docstring (/dev/shm files get deleted).
            self.ps.register_checkpoint(name, named_tensors=named_tensors)

    def register_files(self, name: str, files: list[str]) -> None:
        """Whole files, pinned in place by checkpoint-engine: /dev/shm files are DELETED.
        Only for `--consume-shm-files`, where the user asked for exactly that."""
        if files:
            self.ps.register_checkpoint(name, files=files, use_inplace_pin_memory=True)

    def register_buffers(self, name: str, buffers: list[Any]) -> None:
        """Take host buffers we filled and pinned ourselves (see pinning.py) as checkpoint `name`:
        what `register_checkpoint` would have built, put where it would have put it."""
        pool = getattr(self.ps, "_memory_pool", None)
        if not isinstance(pool, dict) or not hasattr(self.ps, "_register_parameters_to_p2p_store"):
            raise OperationFailed(
                "this checkpoint-engine keeps its buffers differently; use --register-mode engine"
            )
        if name in pool:
            raise OperationFailed(f"checkpoint {name!r} is already registered")
        pool[name] = buffers
        if self.ps._p2p_store is not None:
            self.ps._register_parameters_to_p2p_store(name)

    def registered_bytes(self, name: str) -> list[tuple[str, Any]]:
        """(tensor name, its bytes) for every tensor this rank registered as `name`: views of
        the pinned buffers the update sends from, whichever way they were registered. (A rank
        whose share is empty registered nothing.)"""
        return buffer_views(self.ps._memory_pool.get(name, []))

    def gather(self, name: str) -> None:
        self.ensure_group()
        self.ps.gather_metas(name)

    def gather_planned(self, name: str, planned: dict[int, list[tuple[int, list[Any]]]]) -> None:
        """checkpoint-engine's gather_metas, without pickling every rank's metas through
        all_gather_object (1.2 s for 90k tensors on 2x H200): every rank worked out every
        rank's buffers from the plan they share (pinning.planned_buffers), so only what the
        plan cannot know travels - each buffer's address, the host, GPU and p2p store - as
        JSON. The sizes and tensor counts travel too, and must match what was planned."""
        self.ensure_group()
        apply_gathered(self.ps, all_gather_json(own_facts(self.ps, name)), planned)

    def metas(self) -> dict[int, Any]:
        return self.ps.get_metas()

    def load_metas(self, metas: dict[int, Any]) -> None:
        self.ps.load_metas(metas)

    @property
    def p2p_enabled(self) -> bool:
        return self.ps._p2p_store is not None

    def update(
        self, name: str, req_func: Callable[[list[tuple[str, str]]], None], ranks: list[int] | None
    ) -> None:
        # Only this update's sockets count: a long-lived job's earlier (failed) pushes left
        # their errors on theirs.
        self.sockets = []
        self.ensure_group()
        # The group is kept after a failure too. A push refused before the workers connected
        # (`rescue`) goes through the same collectives on every rank, so it stays in step; one
        # rank dropping it alone would leave the others waiting on the old one at the next
        # push. A failure that breaks it ends the job (as `update` would) at the next wait.
        failure: OperationFailed | None = None
        try:
            self.ps.update(name, req_func, ranks=ranks)
        except Exception as exc:  # noqa: BLE001 - raised again below, as ours
            failure = self._explain(exc)
            failure.debug_traceback = "".join(traceback.format_exception(exc))
            drop_frames(exc)
        finally:
            for s in self.sockets:
                s.settle()
        if failure is None and (self._worker_errors() or self.cancelled()):
            # checkpoint-engine dropped the last bucket's reply, or a cancel made it up
            failure = self._explain(None)
        if failure is not None:
            # Raised here, outside the `except`, so that it carries no chain back to
            # checkpoint-engine's frames (see `drop_frames`).
            release_transfer_memory()
            raise failure

    def ensure_group(self) -> float | None:
        """The NCCL process group (building since the session started), kept for every
        later gather and update.

        With auto_pg, checkpoint-engine destroys the group at the end of every update, and
        destroying an NCCL communicator waits for its proxy thread's next 500 ms poll tick:
        half of the update stage's fixed second, measured (bench/pg_destroy_probe.py). Built
        by us instead, it lives until the process ends (see results.leave_group_to_exit).
        Returns the seconds the build took.
        """
        self._group.wait(self._io_timeout())
        return self._group.seconds

    def _explain(self, exc: Exception | None) -> OperationFailed:
        """One line for what went wrong in checkpoint-engine's update, the worker's words first."""
        import zmq

        errors = self._worker_errors()
        cancelled = self.cancelled()
        if cancelled is not None and not errors:
            return OperationFailed(f"{cancelled} ({PARTIAL_WEIGHTS_NOTE})")
        if errors or exc is None:
            return OperationFailed(
                f"the server's worker on {self.device_uuid} failed while loading the weights "
                f"({PARTIAL_WEIGHTS_NOTE}): "
                f"{last_line(errors[-1]) if errors else exc}"
            )
        # Another rank's worker failed, or ours stopped answering: once a worker had the
        # handle, the server may hold some of the new weights all the same.
        note = f" ({PARTIAL_WEIGHTS_NOTE})" if self.workers_connected() else ""
        if isinstance(exc, zmq.Again):
            return OperationFailed(
                f"the server's worker for {self.device_uuid} did not answer over IPC in time; "
                f"check that the server runs on this job's GPUs{note}"
            )
        return OperationFailed(
            f"checkpoint-engine's update failed: {type(exc).__name__}: {exc}{note}"
        )

    def unregister(self, name: str, pool: Any = None) -> None:
        """Drop checkpoint `name`. Buffers that came from `pool` go back to it, still pinned;
        anything else (checkpoint-engine's own, files pinned in place) is unpinned by
        checkpoint-engine as usual."""
        buffers = self.ps._memory_pool.get(name) if pool is not None else None
        if buffers is None or self.ps._p2p_store is not None or not pool.owns(buffers):
            self.ps.unregister_checkpoint(name)  # (serve runs without p2p)
            return
        del self.ps._memory_pool[name]
        pool.give_back(buffers)


def buffer_views(buffers: list[Any]) -> list[tuple[str, memoryview]]:
    """(name, bytes) of every tensor in checkpoint-engine `MemoryBuffer`s: each buffer holds its
    metas' tensors back to back, each at an offset rounded up to `aligned_size`."""
    import math

    out: list[tuple[str, memoryview]] = []
    for buf in buffers:
        flat = memoryview(buf.buffer.numpy()).cast("B")
        offset = 0
        for meta in buf.metas:
            nbytes = meta.dtype.itemsize * math.prod(meta.shape)
            out.append((meta.name, flat[offset : offset + nbytes]))
            offset += meta.aligned_size
    return out

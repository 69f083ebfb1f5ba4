"""One rank's checkpoint-engine ParameterServer, and what ckptctl needs around it. It never
gets checkpoint files as `files=` (/dev/shm files would be DELETED) unless --consume-shm-files
asks for exactly that. torch and checkpoint-engine are imported when a session starts.
"""

from __future__ import annotations

import gc
import math
import os
import traceback
from collections.abc import Callable
from typing import Any

from ckptctl.ce import internals as ce_internals
from ckptctl.ce import p2p as _p2p
from ckptctl.ce.transfer_sockets import ReplyWatchingSocket, TransferSockets
from ckptctl.errors import PARTIAL_WEIGHTS_NOTE, ExitCode, InvalidInput, OperationFailed
from ckptctl.job.coordination import PAST_DEADLINE_S
from ckptctl.settings import P2P


def _hint(exc: Exception, p2p: P2P) -> str:
    if "EADDRINUSE" in str(exc):
        port = int(os.environ.get("MASTER_PORT", "0")) + 1
        return (
            f" (checkpoint-engine's store listens on MASTER_PORT+1 = {port}, which is taken: "
            "give torchrun a --master-port whose next port is free)"
        )
    return "" if p2p is P2P.off else " (p2p needs a working RDMA NIC)"


def all_gather_json(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `doc`, in rank order, over the job's process group: JSON bytes in two
    all_gathers (lengths, then the padded bytes), never a pickle."""
    import json

    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # (the current device)
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


class ParameterServerSession(TransferSockets):
    """One rank's ParameterServer and what we need around it."""

    def __init__(
        self,
        *,
        p2p: P2P,
        io_timeout: Callable[[], float],
        group_store: Any = None,
        on_failure: Callable[[int, str], None] | None = None,
        group_timeout_s: float | None = None,
    ) -> None:
        """p2p: "off" (mooncake never imported), "optional" (used if it starts: joinable metas)
        or "required" (p2p/all updates, join). group_store: the job's store, where the NCCL
        group is built (None for one process). on_failure: where a failure checkpoint-engine
        would sit on goes (the watchdog's `fail`). group_timeout_s: the group's timeout."""
        ce_internals.check_version()  # first: one line, not a traceback later
        if p2p is P2P.off:
            _p2p.block_mooncake()
        else:
            _p2p.prefer_system_unwinder()
        import torch

        if not torch.cuda.is_available():
            # (every GPU command comes here; only `update` has a --dry-run)
            raise OperationFailed(
                "no CUDA device: every rank needs one GPU (check CUDA_VISIBLE_DEVICES); "
                "`ckptctl update --dry-run` plans a split without one"
            )
        from ckptctl.ce.bare_import import engine_module
        from ckptctl.job import process_group as pg

        # First, so that it overlaps everything up to the first gather.
        rank = int(os.environ["RANK"])
        self._group = pg.BackgroundProcessGroup(
            rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            store=group_store,
            device_index=pg.local_device_index(rank),
            timeout_s=group_timeout_s or pg.MIN_TIMEOUT_S,
        )

        ParameterServer = engine_module("ps").ParameterServer  # noqa: N806 - a class

        self._io_timeout = io_timeout
        self.p2p_error: str | None = None
        try:
            self.ps = ParameterServer(auto_pg=False)
        except (RuntimeError, OSError) as exc:
            # mooncake installed but no usable NIC (checkpoint-engine issue #1) raises here
            # for every method: when p2p was only a nicety, retry without it.
            if "EADDRINUSE" in str(exc) or p2p is not P2P.optional:
                raise OperationFailed(
                    f"checkpoint-engine's parameter server did not start: {exc}" + _hint(exc, p2p)
                ) from exc
            self.p2p_error = str(exc)
            _p2p.block_mooncake()
            self.ps = ParameterServer(auto_pg=False)
        if p2p is P2P.required and not self.p2p_enabled:
            raise InvalidInput("p2p was asked for but checkpoint-engine's p2p store did not start")
        ce_internals.start_socket_counter(self.ps)
        self.new_transfer()  # (self.sockets: the current transfer's, one per bind)
        # Set by the update stage: called with each bucket's bytes once the worker loaded it.
        self.on_bucket_loaded: Callable[[int], None] | None = None
        self._wrap_socket_factory()
        self._on_failure = on_failure
        if self.p2p_enabled:
            _p2p.watch_p2p_reads(ce_internals.p2p_store(self.ps), self._p2p_read_failed)

    def _bucket_loaded(self, nbytes: int) -> None:
        if self.on_bucket_loaded is not None:
            self.on_bucket_loaded(nbytes)

    def _wrap_socket_factory(self) -> None:
        def watched(socket: Any) -> ReplyWatchingSocket:
            # Past the deadline, so that the watchdog's timeout (exit 4) comes first.
            timeout_ms = max(int((self._io_timeout() + PAST_DEADLINE_S) * 1000), 1)
            return self._add_socket(ReplyWatchingSocket(socket, timeout_ms, self._bucket_loaded))

        ce_internals.wrap_socket_factory(self.ps, watched)

    def _p2p_read_failed(self, message: str) -> None:
        """Abort the server's worker (so that it does not wait for the next bucket), then fail
        the job: the other ranks sit in the bucket's broadcast until the watchdog ends them."""
        if self.sockets:
            self.sockets[-1].abort(message)
        if self._on_failure is not None:
            self._on_failure(ExitCode.FAILED, message)

    @property
    def device_uuid(self) -> str:
        return ce_internals.device_uuid(self.ps)

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
        """Take host buffers we filled and pinned ourselves (host_memory) as checkpoint `name`:
        what `register_checkpoint` would have built, put where it would have put it."""
        ce_internals.add_checkpoint(self.ps, name, buffers)

    def registered_bytes(self, name: str) -> list[tuple[str, Any]]:
        """(tensor name, its bytes) for every tensor this rank registered as `name`: views of
        the pinned buffers the update sends from, whichever way they were registered."""
        return buffer_views(ce_internals.registered_buffers(self.ps, name))

    def gather(self, name: str) -> None:
        self.ensure_group()
        self.ps.gather_metas(name)

    def gather_planned(self, name: str, planned: dict[int, list[tuple[int, list[Any]]]]) -> None:
        """gather_metas without pickling every rank's metas: each rank worked them out from the
        shared plan (host_memory.planned_buffers), so only what the plan cannot know (addresses,
        host, GPU, p2p store) travels, as JSON, with the sizes and counts it must match."""
        self.ensure_group()
        facts = all_gather_json(ce_internals.own_facts(self.ps, name))
        ce_internals.apply_gathered(self.ps, facts, planned)

    def metas(self) -> dict[int, Any]:
        return self.ps.get_metas()

    def load_metas(self, metas: dict[int, Any]) -> None:
        self.ps.load_metas(metas)

    @property
    def p2p_enabled(self) -> bool:
        return ce_internals.p2p_store(self.ps) is not None

    def update(
        self, name: str, req_func: Callable[[list[tuple[str, str]]], None], ranks: list[int] | None
    ) -> None:
        # (self.sockets: this transfer's, since `new_transfer`; a serve push's guard calls it
        # before it watches, so that its rescue is never lost to a reset here)
        self.ensure_group()
        # The group is kept after a failure too: a push refused before the workers connected
        # (`rescue`) goes through the same collectives on every rank, so it stays in step; a
        # failure that breaks it ends the job at the next wait.
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
        """The NCCL process group (building since the session started), kept for every later
        gather and update: with auto_pg checkpoint-engine would destroy it after every update,
        and destroying one waits for its proxy thread's next poll tick. It lives until the
        process ends (results.leave_group_to_exit). Returns the seconds the build took."""
        self._group.wait(self._io_timeout())
        return self._group.seconds

    def _explain(self, exc: Exception | None) -> OperationFailed:
        """One line for what went wrong in checkpoint-engine's update, the worker's words first."""
        import zmq

        errors, cancelled = self._worker_errors(), self.cancelled()
        if cancelled is not None and not errors:
            return OperationFailed(f"{cancelled} ({PARTIAL_WEIGHTS_NOTE})")
        if errors or exc is None:
            return OperationFailed(
                f"the server's worker on {self.device_uuid} failed while loading the weights "
                f"({PARTIAL_WEIGHTS_NOTE}): {last_line(errors[-1]) if errors else exc}"
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
        buffers = ce_internals.registered_buffers(self.ps, name) if pool is not None else []
        if not buffers or self.p2p_enabled or not pool.owns(buffers):
            self.ps.unregister_checkpoint(name)  # (serve runs without p2p)
            return
        ce_internals.forget_checkpoint(self.ps, name)
        pool.give_back(buffers)


def buffer_views(buffers: list[Any]) -> list[tuple[str, memoryview]]:
    """(name, bytes) of every tensor in checkpoint-engine `MemoryBuffer`s: each buffer holds its
    metas' tensors back to back, each at an offset rounded up to `aligned_size`."""
    out: list[tuple[str, memoryview]] = []
    for buf in buffers:
        flat = memoryview(buf.buffer.numpy()).cast("B")
        offset = 0
        for meta in buf.metas:
            nbytes = meta.dtype.itemsize * math.prod(meta.shape)
            out.append((meta.name, flat[offset : offset + nbytes]))
            offset += meta.aligned_size
    return out


def last_line(traceback_text: str) -> str:
    lines = [line.strip() for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def drop_frames(exc: BaseException) -> None:
    """Let go of the frames a failed update's exception holds: checkpoint-engine's hold its GPU
    transfer buffers, which a kept exception (a `__cause__`, a serve loop's variable) would keep
    alive. The caller keeps a text copy of the traceback for CKPTCTL_DEBUG instead."""
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
    """Hand a failed update's GPU memory back to the device (for the inference server) once
    `drop_frames` let go of it: checkpoint-engine empties torch's cache while it is held."""
    import torch

    gc.collect()  # an exception and its frames can hold each other in a cycle
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()

"""Run the real `ckptctl` CLI with checkpoint-engine's ParameterServer replaced by a CPU
stand-in (the real one needs CUDA). Everything else is real: torchrun, the store, the
watchdog, the split, the HTTP requests to a real server, the read-back. Used by
test_update_orchestration.py to test the pipeline's wiring on CPU; the GPU tests run the
real ParameterServer.

    torchrun ... tests/support/cpu_ps_rank.py update --checkpoint-path DIR ...

What the stand-in can be told to do:
- a checkpoint registered under a name containing "fail-after-connect": the server's workers
  connect, then the last rank's worker fails mid-transfer, and every rank's update fails the
  way checkpoint-engine's does (its return-code all-reduce);
- CPU_PS_SLOW_UPDATE_RANK=r: rank r's update takes a second longer (a slow node), and no
  rank waits for another at its end (checkpoint-engine's issue #106);
- CPU_PS_LATE_UPDATE_RANK=r: rank r begins each update only once another rank's part is done,
  or once its push's guard tried to end it (the push failed elsewhere first: a busy machine's
  order of events), 20 s at most;
- CPU_PS_EVENTS=F: every rank appends "update-end NAME" / "unregister NAME" lines to F, one
  shared file, in the order they happen;
- CPU_PS_SLOW_CHECK_RANK=r: rank r checks a --consume-shm-files plan late;
- CPU_PS_START_HOLD_S=N: the ParameterServer's start takes N seconds (a slow CUDA start);
- CPU_PS_TRANSFER=zmq: the update is the real ParameterServerSession's, around `CpuEngine`,
  which speaks checkpoint-engine's IPC protocol over real zmq sockets to the server's workers
  (a FakeServer whose on_update is tests/fake_worker.ZmqWorkers): the server can die, hang or
  fail mid-transfer, and the job must end the transfer as it would on a GPU;
- CPU_PS_COPY=DIR (with CPU_PS_TRANSFER=zmq): a checkpoint registered as buffers (direct
  registration) is sent with its bytes, the way checkpoint-engine sends it: its own
  `_gen_h2d_buckets` (buckets of CPU_PS_BUCKET_BYTES), its own `_copy_to_buffer` (which
  ckptctl may wrap) into a host "H2D buffer", then into a double buffer in a file under DIR
  that the server's workers map (the "IPC handle" names it), announced with its own
  `_to_named_tensor` metas;
- CPU_PS_READ_HOLD=DIR: the reader's open of a shard X waits while DIR/hold-X exists, until
  DIR/loaded (or DIR/connected, with DIR/hold-X holding "connected") exists - which the
  server's workers write (fake_worker.ZmqWorkers.flags) - at most 20 s; with DIR/cut-X it
  then cuts X short (a writer truncating it mid-push); with DIR/fail-X the open fails as one
  of an unreadable file does, X left as it is (a passing I/O error). Each open so held
  appends a line {"held": X, "released": true|false} to DIR/holds.
- CPU_PS_PLAN_LATE=1: the plan made (and share read) early, from the command's start, is done
  only once the job asks for it (a busy machine's order of events).
- CPU_PS_NODE_COPY=SRC:DST[,SRC:DST...]: every rank but rank 0 stands on another node, whose
  copy of the checkpoint SRC is the folder DST (a copy that differs, or none at all).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch


class CpuParameterServerSession:
    """What the pipeline calls on ParameterServerSession, without CUDA: registered tensors are
    kept as views, `update` hands every rank's fake IPC socket paths to the request function
    in a thread, the way checkpoint-engine does."""

    def __init__(
        self,
        *,
        p2p: str,
        io_timeout: Any,
        group_store: Any = None,
        on_failure: Any = None,
        group_timeout_s: float | None = None,
    ) -> None:
        self.group_store = group_store  # the job's store (None for one process)
        time.sleep(float(os.environ.get("CPU_PS_START_HOLD_S", "0")))
        self.group_timeout_s = group_timeout_s  # the NCCL group's, were there one
        log = os.environ.get("CPU_PS_LOG")
        if log:
            with open(f"{log}.session.{os.environ['RANK']}", "w") as fh:
                json.dump({"group_timeout_s": group_timeout_s}, fh)
        self.updates: dict[str, int] = {}  # per checkpoint name: the key of each update
        self.p2p_enabled = False
        self.p2p_error = None
        self.registered: dict[str, dict[str, Any]] = {}
        self.buffers: dict[str, list[Any]] = {}
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.connected = False  # the server's workers took the IPC handle (this update)
        self.connected_at: float | None = None  # (when: its perf_counter)
        self.rescued: str | None = None
        self.guard_acted = threading.Event()  # the push's guard tried to end this transfer
        self.on_bucket_loaded: Any = None
        self.real: Any = None  # CPU_PS_TRANSFER=zmq: the real session, around a CpuEngine
        self._engine: Any = None
        if os.environ.get("CPU_PS_TRANSFER") == "zmq":
            real = object.__new__(REAL_SESSION)  # its constructor needs CUDA
            real.ps = CpuEngine(self)
            real.sockets = []
            real._io_timeout = io_timeout
            real._group = _BuiltGroup()
            real.on_bucket_loaded = None
            real._on_failure = on_failure
            real._wrap_socket_factory()
            self.real = real

    def register(self, name: str, named_tensors: dict[str, Any]) -> None:
        self.registered[name] = dict(named_tensors)

    def register_buffers(self, name: str, buffers: list[Any]) -> None:
        self.registered[name] = {m.name: m for b in buffers for m in b.metas}
        self.buffers[name] = buffers

    def _log_buffers(self, name: str) -> None:
        """CPU_PS_LOG: what landed in the buffers (tests fill each checkpoint with one byte
        value) and where: a test reads this to see a pool refilled in place. Read at the update,
        through checkpoint-engine's own copy of each buffer (which ckptctl gates while a push's
        read is still filling them): then the bytes are there."""
        from checkpoint_engine.data_types import BucketRange, H2DBucket

        buffers = self.buffers.get(name)
        if buffers is None:
            return
        fills = set()
        for i, b in enumerate(buffers):
            whole = H2DBucket.model_construct(size=b.size, ranges=[BucketRange(i, 0, b.size)])
            copy = torch.empty(b.size, dtype=torch.uint8)
            self.ps._copy_to_buffer(name, whole, copy)
            offset = 0
            for m in b.metas:
                n = m.dtype.itemsize * int(torch.Size(m.shape).numel())
                fills.update(copy[offset : offset + n].unique().tolist())
                offset += m.aligned_size
        with open(f"{os.environ['CPU_PS_LOG']}.{self.rank}", "a") as fh:
            ptrs = sorted(b.buffer.data_ptr() for b in buffers)
            fh.write(json.dumps({"name": name, "ptrs": ptrs, "fills": sorted(fills)}) + "\n")

    def register_files(self, name: str, files: list[str]) -> None:
        # What checkpoint-engine's in-place pinning does with /dev/shm files: pin, then delete.
        self.registered[name] = {f: f for f in files}
        for f in files:
            os.remove(f)

    def registered_bytes(self, name: str) -> list[tuple[str, Any]]:
        """What the real session hashes for --verify: the bytes each tensor was registered with."""
        if name in self.buffers:
            from ckptctl.ce import buffer_views

            return buffer_views(self.buffers[name])
        return [
            (n, memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            for n, t in self.registered.get(name, {}).items()
        ]

    def ensure_group(self) -> float | None:
        return None  # no process group to build here

    def gather(self, name: str) -> None:
        pass

    def gather_planned(self, name: str, planned: dict[int, Any]) -> None:
        # Direct registration knows every rank's buffers from the plan: this rank's part must
        # be exactly what it registered (the real session also exchanges the addresses).
        own = [(b.size, [m.name for m in b.metas]) for b in self.buffers.get(name, [])]
        want = [(size, [m.name for m in metas]) for size, metas in planned.get(self.rank, [])]
        assert own == want, "the planned metas are not what this rank registered"
        log = os.environ.get("CPU_PS_LOG")
        if log:
            with open(f"{log}.gathered.{self.rank}", "a") as fh:
                fh.write(json.dumps({"gathered": name, "planned_ranks": sorted(planned)}) + "\n")

    def metas(self) -> dict[int, Any]:
        return {}

    def wait_transfer_finished(self, timeout: float) -> bool:
        return True if self.real is None else self.real.wait_transfer_finished(timeout)

    # What ckptctl.transfer.overlap reaches (CPU_PS_TRANSFER=zmq): the engine, the transfer.
    @property
    def ps(self) -> Any:
        if self.real is not None:
            return self.real.ps
        if self._engine is None:  # (its copies never run: this stand-in sends no bytes)
            self._engine = CpuEngine(self)
        return self._engine

    def buckets_announced(self) -> bool:
        return True if self.real is None else self.real.buckets_announced()

    def cancelled(self) -> str | None:
        return None if self.real is None else self.real.cancelled()

    def cancel(self, message: str) -> None:
        if self.real is not None:
            self.real.cancel(message)

    def new_transfer(self) -> None:
        self.connected, self.connected_at, self.rescued = False, None, None
        self.guard_acted.clear()
        if self.real is not None:
            self.real.new_transfer()

    def rescue(self, message: str) -> bool:
        self.guard_acted.set()
        if self.real is not None:
            return bool(self.real.rescue(message))
        if self.connected:
            return False  # a worker has the handle: only its own error path ends the transfer
        self.rescued = message  # the real one ends checkpoint-engine's blocked transfer
        return True

    def workers_connected(self) -> bool:
        return self.connected if self.real is None else self.real.workers_connected()

    def workers_connected_at(self) -> float | None:
        return self.connected_at if self.real is None else self.real.workers_connected_at()

    def worker_error(self) -> str | None:
        return None if self.real is None else self.real.worker_error()

    def _event(self, what: str, name: str) -> None:
        path = os.environ.get("CPU_PS_EVENTS")
        if path:
            line = json.dumps({"rank": self.rank, "event": what, "name": name}) + "\n"
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())  # one write: lines from ranks never interleave
            finally:
                os.close(fd)

    def update(self, name: str, req_func: Any, ranks: list[int] | None) -> None:
        from ckptctl.errors import OperationFailed

        if os.environ.get("CPU_PS_LOG"):
            self._log_buffers(name)
        if self.real is not None:
            self.real.on_bucket_loaded = self.on_bucket_loaded
            try:
                self.real.update(name, req_func, ranks)
            finally:
                self._event("update-end", name)
            return

        self.updates[name] = self.updates.get(name, 0) + 1
        key = f"cpu-ps/{name}/{self.updates[name]}"
        store = self.group_store
        if os.environ.get("CPU_PS_LATE_UPDATE_RANK") == str(self.rank) and store is not None:
            others = [f"{key}/{r}" for r in range(self.world) if r != self.rank]
            deadline = time.monotonic() + 20.0
            while not self.guard_acted.is_set() and not store.check(others):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        # (A transfer rescued before it began: its handle went to the stand-in peer.)
        self.connected = "fail-after-connect" in name and self.rescued is None
        self.connected_at = time.perf_counter() if self.connected else None
        paths = [(f"GPU-fake-{r}", f"ipc://@fake-{r}.sock") for r in range(self.world)]
        sent = len(getattr(req_func, "messages", []))
        thread = threading.Thread(target=req_func, args=(paths,))
        thread.start()
        thread.join()
        # checkpoint-engine's update is collective: it returns on every rank together, once the
        # leader's server has taken the weights, or fails on every rank. A rank here marks its
        # part done (a leader only when its server said yes) and waits for all: a failed
        # leader never marks it, and every rank is ended - by the watchdog (update) or by the
        # rescue of its transfer (serve) - never left to finish, or exit 0, on its own. Where
        # the workers connected, their error replies end the transfer on every rank
        # (checkpoint-engine's error path): it is over, failed or not.
        leader = getattr(getattr(req_func, "assignment", None), "is_leader", False)
        ok = self.connected or not leader or len(getattr(req_func, "messages", [])) > sent
        if ok and self.rescued is None and store is not None:
            store.set(f"{key}/{self.rank}", "done")

        def all_done() -> bool:
            return ok if store is None else store.check([f"{key}/{r}" for r in range(self.world)])

        while self.rescued is None and not all_done():
            time.sleep(0.02)
        if os.environ.get("CPU_PS_SLOW_UPDATE_RANK") == str(self.rank):
            threading.Event().wait(1.0)  # still copying this rank's buffers
        self._event("update-end", name)
        if self.rescued is not None:
            raise OperationFailed(f"checkpoint-engine's update failed: {self.rescued}")
        if self.connected:
            note = "the server may now hold partly updated weights"
            if self.rank == self.world - 1:  # this rank's worker replied with an error
                raise OperationFailed(
                    f"the server's worker on GPU-fake-{self.rank} failed while loading the "
                    f"weights ({note}): RuntimeError: injected failure in bucket 1"
                )
            raise OperationFailed(
                "checkpoint-engine's update failed: RuntimeError: Failed to update weights due "
                f"to remote errors ({note})"
            )

    def unregister(self, name: str, pool: Any = None) -> None:
        self._event("unregister", name)
        self.registered.pop(name, None)
        buffers = self.buffers.pop(name, None)
        if pool is not None and buffers is not None:
            pool.give_back(buffers)


class _BuiltGroup:
    """The NCCL group the real session waits for: none here (the store stands in for it)."""

    seconds = None

    def wait(self, timeout_s: float) -> None:
        pass


class CpuEngine:
    """checkpoint-engine's ParameterServer as far as one update goes, on CPU: `update` runs
    its `_update_per_bucket` protocol over real zmq sockets - the handle, then per bucket the
    worker's reply, the all-reduce of return codes (through the job's store), the next bucket;
    then None, None - and fails the same way when a reply is not empty. The real
    ParameterServerSession wraps `_bind_zmq_socket` as it wraps checkpoint-engine's."""

    def __init__(self, session: CpuParameterServerSession) -> None:
        self.session = session
        self._device_uuid = f"GPU-fake-{session.rank}"
        self._count = 0
        # ipc names are machine-wide: this job's own (its ranks agree on it)
        self._token = os.environ.get("MASTER_PORT", "") + "-" + str(os.getppid())
        from types import MethodType, SimpleNamespace

        from checkpoint_engine.ps import ParameterServer

        # checkpoint-engine's own copy of a bucket out of the registered buffers (CPU_PS_COPY)
        self._copy_to_buffer = MethodType(ParameterServer._copy_to_buffer, self)
        self.device_manager = SimpleNamespace(device_module=SimpleNamespace(synchronize=_no_op))

    def _get_memory_pool(self, name: str) -> list[Any]:
        if name not in self.session.buffers:
            raise RuntimeError(f"checkpoint {name} is not registered")
        return self.session.buffers[name]

    def _bind_zmq_socket(self) -> tuple[Any, list[tuple[str, str]]]:
        import zmq

        def path(r: int) -> str:
            return f"ipc://@ckptctl-cpu-ps-{self._token}-{r}-{self._count}.sock"

        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.bind(path(self.session.rank))
        return sock, [(f"GPU-fake-{r}", path(r)) for r in range(self.session.world)]

    def _buckets(self, name: str) -> list[list[dict[str, Any]]]:
        count = int(os.environ.get("CPU_PS_BUCKETS", "3"))
        items = sorted(self.session.registered.get(name, {}).items())
        metas = [
            {"name": n, "shape": list(t.shape), "dtype": t.dtype, "offset": 0} for n, t in items
        ]
        return [metas[i::count] for i in range(count)]

    def _all_gather(self, key: str, value: int) -> list[int]:
        store, world, rank = self.session.group_store, self.session.world, self.session.rank
        if store is None:
            return [value]
        store.set(f"{key}/{rank}", str(value))
        keys = [f"{key}/{r}" for r in range(world)]
        while not store.check(keys):
            time.sleep(0.005)
        return [int(store.get(k)) for k in keys]

    def _all_reduce(self, key: str, value: int) -> int:
        return sum(self._all_gather(key, value))

    def update(self, name: str, req_func: Any, ranks: list[int] | None = None) -> None:
        self._count += 1
        key = f"cpu-ps-zmq/{name}/{self._count}"
        rank = self.session.rank
        handle: Any = ("cpu-ipc-handle", rank)
        path = None
        if os.environ.get("CPU_PS_COPY") and name in self.session.buffers:
            path = os.path.join(
                os.environ["CPU_PS_COPY"], f"ipc-{self._token}-{rank}-{self._count}"
            )
            steps = self._byte_buckets(name, path)
            handle = (*handle, path)
        else:
            steps = [lambda bucket=bucket: bucket for bucket in self._buckets(name)]
        count = max(self._all_gather(f"{key}/count", len(steps)))
        socket, paths = self._bind_zmq_socket()
        req_thread = threading.Thread(target=req_func, args=(paths,))
        req_thread.start()
        socket.send_pyobj(handle)
        pending = True  # a message of ours waits for its reply
        try:
            for i in range(count):
                resp, message = b"", None
                if i < len(steps):
                    message = steps[i]()  # (with bytes: the bucket's copy, then its metas)
                    resp, pending = socket.recv(), False
                if self._all_reduce(f"{key}/{i}", int(resp != b"")):
                    if pending:
                        socket.recv()
                    socket.send_pyobj(RuntimeError("Some workers failed to update weights"))
                    raise RuntimeError("Failed to update weights due to remote errors")
                if message is not None:
                    socket.send_pyobj(message)
                    pending = True
            if pending:
                socket.recv()
            socket.send_pyobj(None)
            socket.recv()
            socket.send_pyobj(None)
            socket.recv()
        finally:
            req_thread.join()
            self._all_reduce(f"{key}/end", 0)
            socket.close()
            if path is not None:
                os.unlink(path)

    def _byte_buckets(self, name: str, path: str) -> list[Any]:
        """CPU_PS_COPY: checkpoint-engine's buckets of this rank's buffers, each step copying
        one (its `_copy_to_buffer` into a host "H2D buffer", then into its slot of the double
        buffer at `path`) and returning its metas, as `_update_per_bucket` does."""
        from checkpoint_engine.data_types import MemoryBufferMetaList, MemoryBufferMetas
        from checkpoint_engine.ps import _gen_h2d_buckets, _to_named_tensor

        pool = self.session.buffers[name]
        size = int(os.environ.get("CPU_PS_BUCKET_BYTES", str(1 << 20)))
        size = max([size] + [m.aligned_size for b in pool for m in b.metas])
        metas = MemoryBufferMetaList.model_construct(
            p2p_store_addr=None,
            rdma_device="",
            memory_buffer_metas_list=[
                MemoryBufferMetas.model_construct(
                    metas=b.metas, ptr=b.buffer.data_ptr(), size=b.size
                )
                for b in pool
            ],
        )
        rank = self.session.rank
        buckets = [b for _, _, b in _gen_h2d_buckets({rank: metas}, size, {}, {})] if pool else []
        ipc = torch.from_file(path, shared=True, size=2 * size, dtype=torch.uint8)
        h2d = torch.empty(size, dtype=torch.uint8)

        def step(i: int) -> Any:
            self._copy_to_buffer(name, buckets[i], h2d)
            start = i % 2 * size
            ipc[start : start + buckets[i].size].copy_(h2d[: buckets[i].size])
            return _to_named_tensor(buckets[i].items, start)

        return [lambda i=i: step(i) for i in range(len(buckets))]


def _no_op() -> None:
    pass


def hold_reads(hold_dir: str) -> None:
    """CPU_PS_READ_HOLD (see the module's doc): the reader's opens, held and cut on demand."""
    import ckptctl.transfer.host_memory._file_reads as reads_module

    open_planned = reads_module.open_planned

    def held_open(checkpoint: Any, file: str) -> int:
        hold = os.path.join(hold_dir, f"hold-{file}")
        if os.path.exists(hold):
            with open(hold) as fh:
                flag = os.path.join(hold_dir, fh.read().strip() or "loaded")
            deadline = time.monotonic() + 20.0
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.01)
            released = os.path.exists(flag)
            if os.path.exists(os.path.join(hold_dir, f"cut-{file}")):
                path = checkpoint.path_of(file)
                os.truncate(path, os.path.getsize(path) // 2)
            with open(os.path.join(hold_dir, "holds"), "a") as fh:
                fh.write(json.dumps({"held": file, "released": released}) + "\n")
            if os.path.exists(os.path.join(hold_dir, f"fail-{file}")):
                from ckptctl.errors import InvalidInput

                raise InvalidInput(f"{checkpoint.path_of(file)}: cannot be read (I/O error)")
        return int(open_planned(checkpoint, file))

    reads_module.open_planned = held_open  # type: ignore[assignment]


if __name__ == "__main__":
    import ckptctl.ce as ps_module
    import ckptctl.transfer.host_memory._cuda_pinning as pinning_module

    REAL_SESSION = ps_module.ParameterServerSession
    ps_module.ParameterServerSession = CpuParameterServerSession  # type: ignore[misc]
    # No CUDA to pin host memory with: direct registration's buffers stay pageable.
    pinning_module.DriverPin.for_rank = classmethod(lambda cls, rank: None)  # type: ignore
    pinning_module.pin_in_place = lambda buffer: None  # type: ignore[assignment]
    pinning_module.unpin = lambda buffer: None  # type: ignore[assignment]
    if os.environ.get("CPU_PS_READ_HOLD"):
        hold_reads(os.environ["CPU_PS_READ_HOLD"])
    if os.environ.get("CPU_PS_SLOW_CHECK_RANK") == os.environ.get("RANK", "0"):
        # This rank checks a --consume-shm-files plan late (a slower node, a busy CPU).
        import ckptctl.checkpoint.consume as consume_module

        check = consume_module.check_consumable

        def slow_check(plan: Any) -> None:
            time.sleep(2.0)
            check(plan)

        consume_module.check_consumable = slow_check  # type: ignore[assignment]
    if os.environ.get("CPU_PS_PLAN_LATE"):
        import threading

        import ckptctl.transfer.stages as stages_module

        asked = threading.Event()
        read_and_plan, plan_share = stages_module.read_and_plan, stages_module.plan_share

        def late_read_and_plan(*args: Any) -> Any:
            asked.wait(60)
            return read_and_plan(*args)

        def asking_plan_share(*args: Any, **kwargs: Any) -> Any:
            asked.set()
            return plan_share(*args, **kwargs)

        stages_module.read_and_plan = late_read_and_plan  # type: ignore[assignment]
        stages_module.plan_share = asking_plan_share  # type: ignore[assignment]
    if os.environ.get("CPU_PS_NODE_COPY") and os.environ.get("RANK", "0") != "0":
        import ckptctl.transfer.stages as stages_module

        copies = dict(pair.split(":") for pair in os.environ["CPU_PS_NODE_COPY"].split(","))
        plan_here = stages_module.read_and_plan

        def plan_node_copy(path: str, *args: Any) -> Any:
            return plan_here(copies.get(path, path), *args)

        stages_module.read_and_plan = plan_node_copy  # type: ignore[assignment]
    sys.argv = ["ckptctl", *sys.argv[1:]]
    from ckptctl.cli import main

    main()

"""Run the real `ckptctl` CLI with checkpoint-engine's ParameterServer replaced by a CPU
stand-in (the real one needs CUDA). Everything else is real: torchrun, the store, the
watchdog, the split, the HTTP requests to a real server, the read-back. Used by
test_update_orchestration.py to test the pipeline's wiring on CPU; the GPU tests run the
real ParameterServer.

    torchrun ... tests/cpu_ps_rank.py update --checkpoint-path DIR ...
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import torch


class CpuParameterServerSession:
    """What the pipeline calls on ParameterServerSession, without CUDA: registered tensors are
    kept as views, `update` hands every rank's fake IPC socket paths to the request function
    in a thread, the way checkpoint-engine does."""

    def __init__(
        self, *, p2p: str, io_timeout: Any, group_store: Any = None, on_failure: Any = None
    ) -> None:
        self.p2p_enabled = False
        self.p2p_error = None
        self.registered: dict[str, dict[str, Any]] = {}
        self.buffers: dict[str, list[Any]] = {}
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])

    def register(self, name: str, named_tensors: dict[str, Any]) -> None:
        self.registered[name] = dict(named_tensors)

    def register_buffers(self, name: str, buffers: list[Any]) -> None:
        self.registered[name] = {m.name: m for b in buffers for m in b.metas}
        self.buffers[name] = buffers
        # What landed in the buffers (tests fill each checkpoint with one byte value) and
        # where: a test reads this to see a pool refilled in place.
        fills = set()
        for b in buffers:
            offset = 0
            for m in b.metas:
                n = m.dtype.itemsize * int(torch.Size(m.shape).numel())
                fills.update(b.buffer[offset : offset + n].unique().tolist())
                offset += m.aligned_size
        log = os.environ.get("CPU_PS_LOG")
        if log:
            with open(f"{log}.{self.rank}", "a") as fh:
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
            from ckptctl.pipeline.parameter_server import buffer_views

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
        return True

    def rescue(self, message: str) -> bool:
        self.rescued = message  # the real one ends checkpoint-engine's blocked transfer
        return True

    def update(self, name: str, req_func: Any, ranks: list[int] | None) -> None:
        from ckptctl.errors import OperationFailed

        self.rescued: str | None = None
        paths = [(f"GPU-fake-{r}", f"ipc://@fake-{r}.sock") for r in range(self.world)]
        thread = threading.Thread(target=req_func, args=(paths,))
        thread.start()
        thread.join()
        leader = getattr(getattr(req_func, "assignment", None), "is_leader", False)
        if self.rescued is None and leader and not getattr(req_func, "messages", None):
            # The request failed and nothing rescued the transfer: the real PS stays blocked
            # on its socket until the watchdog ends the process. Returning instead would race
            # the watchdog to the finish (a failed push could exit 0).
            threading.Event().wait()
        if self.rescued is None and self.world > 1:
            # The other ranks learn of a failure through the store (serve's watcher):
            # checkpoint-engine's update returns on every rank together, so wait a little.
            threading.Event().wait(0.5)
        if self.rescued is not None:
            raise OperationFailed(f"checkpoint-engine's update failed: {self.rescued}")

    def unregister(self, name: str, pool: Any = None) -> None:
        self.registered.pop(name, None)
        buffers = self.buffers.pop(name, None)
        if pool is not None and buffers is not None:
            pool.give_back(buffers)


if __name__ == "__main__":
    import ckptctl.pipeline.parameter_server as ps_module
    import ckptctl.pipeline.pinning as pinning_module

    ps_module.ParameterServerSession = CpuParameterServerSession  # type: ignore[misc]
    # No CUDA to pin host memory with: direct registration's buffers stay pageable.
    pinning_module.pin_in_place = lambda buffer: None  # type: ignore[assignment]
    pinning_module.unpin = lambda buffer: None  # type: ignore[assignment]
    if os.environ.get("CPU_PS_SLOW_CHECK_RANK") == os.environ["RANK"]:
        # This rank checks a --consume-shm-files plan late (a slower node, a busy CPU).
        import time

        import ckptctl.pipeline.update as update_module

        check = update_module.check_consumable

        def slow_check(plan: Any) -> None:
            time.sleep(2.0)
            check(plan)

        update_module.check_consumable = slow_check  # type: ignore[assignment]
    sys.argv = ["ckptctl", *sys.argv[1:]]
    from ckptctl.cli import main

    main()

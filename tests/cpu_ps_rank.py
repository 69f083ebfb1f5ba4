"""Run the real `ckptctl` CLI with checkpoint-engine's ParameterServer replaced by a CPU
stand-in (the real one needs CUDA). Everything else is real: torchrun, the store, the
watchdog, the split, the HTTP requests to a real server, the read-back. Used by
test_update_orchestration.py to test the pipeline's wiring on CPU; the GPU tests run the
real ParameterServer.

    torchrun ... tests/cpu_ps_rank.py update --checkpoint-path DIR ...
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any


class CpuParameterServerSession:
    """What the pipeline calls on ParameterServerSession, without CUDA: registered tensors are
    kept as views, `update` hands every rank's fake IPC socket paths to the request function
    in a thread, the way checkpoint-engine does."""

    def __init__(self, *, p2p: str, io_timeout: Any) -> None:
        self.p2p_enabled = False
        self.p2p_error = None
        self.registered: dict[str, dict[str, Any]] = {}
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])

    def register(self, name: str, named_tensors: dict[str, Any]) -> None:
        self.registered[name] = dict(named_tensors)

    def register_buffers(self, name: str, buffers: list[Any]) -> None:
        self.registered[name] = {m.name: m for b in buffers for m in b.metas}

    def register_files(self, name: str, files: list[str]) -> None:
        self.registered[name] = {f: f for f in files}

    def gather(self, name: str) -> None:
        pass

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
        if self.rescued is None and self.world > 1:
            # The other ranks learn of a failure through the store (serve's watcher):
            # checkpoint-engine's update returns on every rank together, so wait a little.
            threading.Event().wait(0.5)
        if self.rescued is not None:
            raise OperationFailed(f"checkpoint-engine's update failed: {self.rescued}")

    def unregister(self, name: str, pool: Any = None) -> None:
        self.registered.pop(name, None)


if __name__ == "__main__":
    import ckptctl.pipeline.parameter_server as ps_module

    ps_module.ParameterServerSession = CpuParameterServerSession  # type: ignore[misc]
    sys.argv = ["ckptctl", *sys.argv[1:]]
    from ckptctl.cli import main

    main()

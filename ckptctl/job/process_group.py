"""The job's NCCL process group, built in a background thread while the rank starts up.

checkpoint-engine gathers metas and broadcasts buckets over a torch.distributed group. Built
the way it builds it (`init_process_group` at the first gather), the group's rendezvous, NCCL's
communicator and its connections at the first collective all sit on the critical path of every
run (bench/README.md). None of that needs the checkpoint or the ParameterServer, so it runs in
a thread from the moment CUDA is known to be there, alongside the ParameterServer's own start
(CUDA context, its store) and the read of the share.

The group is torch.distributed's default group (what checkpoint-engine's `dist` uses), met
through the job's store (torchrun's agent store, see coordination.py), and bound to this
rank's GPU so that NCCL sets it up eagerly; one small collective then makes NCCL connect its
peers. The thread never ends the process: a failure is kept and raised by `wait`, on the
main thread, and a rendezvous that never completes is bounded by the job's watchdog.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

from ckptctl.errors import DeadlineExceeded, OperationFailed

STORE_PREFIX = "process-group/"

# checkpoint-engine's timeout for its group, and the least ours gets.
MIN_TIMEOUT_S = 600.0
# How much longer than the job may wait NCCL waits for a collective: past its timeout NCCL
# aborts the process (SIGABRT, no error line), so the watchdog, which ends a stuck collective
# with its error line and exit code, must go first.
TIMEOUT_GRACE_S = 60.0


def group_timeout_s(longest_wait_s: float | None) -> float:
    """The collective timeout for a job whose watchdog ends any wait after `longest_wait_s`
    seconds (None: not known): never shorter than checkpoint-engine's 10 minutes, nor than
    the job's own bound plus TIMEOUT_GRACE_S (a serve job's --push-timeout may be longer)."""
    import math

    if longest_wait_s is None or not math.isfinite(longest_wait_s):
        return MIN_TIMEOUT_S
    return max(MIN_TIMEOUT_S, longest_wait_s + TIMEOUT_GRACE_S)


# Set once a build has started in this process, whatever became of it: NCCL's threads may be
# running even after a failed build, and results.leave_group_to_exit then skips the interpreter
# shutdown (which can hang or abort under them).
started = False


def local_device_index(rank: int) -> int:
    """The GPU this rank drives: checkpoint-engine's rule (rank modulo the visible GPUs)."""
    import torch

    return rank % torch.cuda.device_count()


class BackgroundProcessGroup:
    """`init_process_group` plus one warm-up collective, in a thread of its own."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store: Any | None,
        backend: str = "nccl",
        device_index: int | None = None,
        timeout_s: float = MIN_TIMEOUT_S,
    ) -> None:
        """store: the job's torch.distributed store (None for a job of one process);
        device_index: the GPU to bind (None: a CPU backend, for tests); timeout_s: how long a
        collective may wait before NCCL aborts the process (group_timeout_s)."""
        self._rank = rank
        self._world_size = world_size
        self._store = store
        self._backend = backend
        self._device_index = device_index
        self._timeout = timedelta(seconds=timeout_s)
        self._error: BaseException | None = None
        self.seconds: float | None = None
        global started
        started = True
        self._thread = threading.Thread(target=self._build, name="ckptctl-group", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        import time

        t0 = time.perf_counter()
        try:
            import torch
            import torch.distributed as torch_dist

            store = self._store if self._store is not None else torch_dist.HashStore()
            device = None
            if self._device_index is not None:
                torch.cuda.set_device(self._device_index)  # the current device is per thread
                device = torch.device("cuda", self._device_index)
            torch_dist.init_process_group(
                backend=self._backend,
                rank=self._rank,
                world_size=self._world_size,
                store=torch_dist.PrefixStore(STORE_PREFIX, store),
                timeout=self._timeout,  # our watchdog ends a stuck collective sooner
                device_id=device,
            )
            # NCCL connects its peers at the first collective; do it now, off the critical path.
            probe = torch.ones(1, device=device)
            torch_dist.all_reduce(probe)
            if device is not None:
                torch.cuda.synchronize(device)
            if int(probe.item()) != self._world_size:
                raise OperationFailed(
                    f"the process group's first all-reduce gave {probe.item()}, "
                    f"not {self._world_size}"
                )
        except BaseException as exc:  # noqa: BLE001 - kept for `wait`, raised on the main thread
            self._error = exc
        finally:
            self.seconds = time.perf_counter() - t0

    def wait(self, timeout_s: float) -> None:
        """Block until the group is up; raise what building it raised."""
        self._thread.join(max(timeout_s, 0.0))
        if self._thread.is_alive():
            raise DeadlineExceeded(
                "the NCCL process group did not come up in time: a rank did not join it"
            )
        if isinstance(self._error, OperationFailed):
            raise self._error
        if self._error is not None:
            raise OperationFailed(
                f"could not build the NCCL process group: "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error

"""Probe: how long does destroy_process_group take after an NCCL collective, as a function of
the idle time before it? (Run under torchrun, 2 GPUs.) If it is about 0.5 s minus the idle time,
NCCL's proxy thread (poll with a 500 ms timeout) is what the update's fixed second waits on.

    torchrun --nproc-per-node 2 bench/pg_destroy_probe.py

Rank 0 writes pg-destroy-probe-tp<N>.json to bench/results/ (or $OUT when set), replacing the
previous run's, with the commit, date and machine.
"""

from __future__ import annotations

import gc
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world, rank == 0,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    rows = []
    for i, idle in enumerate([0.0, 0.0, 0.1, 0.25, 0.4, 0.6]):
        t0 = time.perf_counter()
        dist.init_process_group("nccl", store=dist.PrefixStore(f"p{i}", store), rank=rank,
                                world_size=world, device_id=torch.device("cuda", torch.cuda.current_device()))  # fmt: skip
        x = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        time.sleep(idle)
        t2 = time.perf_counter()
        dist.destroy_process_group()
        t3 = time.perf_counter()
        rows.append({"idle_s": idle, "init_and_first_collective_s": round(t1 - t0, 3),
                     "destroy_s": round(t3 - t2, 3)})  # fmt: skip
    import checkpoint_engine.ps  # noqa: F401 - a process of the size ckptctl's is

    t = time.perf_counter()
    gc.collect()
    gc_s = time.perf_counter() - t
    gc.freeze()
    t = time.perf_counter()
    gc.collect()
    frozen_s = time.perf_counter() - t
    if rank == 0:
        from result_files import RESULTS, write_results

        doc = {"destroy_probe": rows, "gc_collect_s": round(gc_s, 4),
               "gc_collect_after_freeze_s": round(frozen_s, 4)}  # fmt: skip
        print(json.dumps(doc))
        out = os.environ.get("OUT") or RESULTS
        write_results(out, f"pg-destroy-probe-tp{world}", doc, None)


if __name__ == "__main__":
    main()

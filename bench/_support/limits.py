"""The physical limits a benchmark measures beside itself, in the same run: host-to-device
copies and reads from the page cache and from disk (bench/README.md: each result is a ratio to
one of these)."""

from __future__ import annotations

import mmap
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from _support.ckpt_factory import drop_cache

GiB = 1 << 30
CHUNK = 64 << 20


def h2d_bandwidth(pinned: bool, nbytes: int = 4 * GiB, repeat: int = 3) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
    return best


def limit_read(files: list[Path], threads: int, fresh: bool) -> float:
    """GB/s of `threads` threads reading every file in 64 MiB preadv pieces: into a buffer of
    their own that is reused (the ceiling) or into fresh anonymous memory (faulted in as ours)."""
    pieces = [(f, at) for f in files for at in range(0, f.stat().st_size, CHUNK)]
    fds = {f: os.open(f, os.O_RDONLY) for f in files}
    taken = iter(range(len(pieces)))
    lock = threading.Lock()
    total = [0]

    def work() -> None:
        own = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        done = 0
        while True:
            with lock:
                i = next(taken, None)
            if i is None:
                break
            f, at = pieces[i]
            target = own
            if fresh:  # as ckptctl allocates: private, anonymous
                target = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            done += os.preadv(fds[f], [target], at)
            if fresh:
                target.close()
        with lock:
            total[0] += done

    workers = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return total[0] / seconds / 1e9


def read_limits(files: list[Path], threads: list[int]) -> dict[str, Any]:
    """The page cache's limit with each thread count (warm: read everything once first) and
    the disk's with the most threads (cold: each file dropped from the cache first)."""
    for f in files:
        subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)
    warm = {n: round(limit_read(files, n, fresh=False), 2) for n in threads}
    drop_cache(files)
    cold = round(limit_read(files, max(threads), fresh=False), 2)
    return {"warm_read_gb_s_by_threads": warm, "warm_read_gb_s": max(warm.values()),
            "cold_read_gb_s": cold, "cold_read_threads": max(threads)}  # fmt: skip

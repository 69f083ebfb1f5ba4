"""Splitting a checkpoint across ranks by bytes, deterministically.

The plan is a pure function of the checkpoint's sorted file names and headers: every rank on
every node computes the same plan on its own, with no communication. Each tensor goes to
exactly one rank.

- files:   whole files per rank, balanced by bytes (longest processing time first, then an
           exact search while the file count is small enough to finish quickly).
- tensors: single tensors per rank, balanced by bytes; each rank's tensors are listed in read
           order, grouped by file. Contiguous runs of the checkpoint (each rank reads its part of
           the files front to back) when those balance to within CONTIGUOUS_SLACK of the lower
           bound, as they do for many small tensors; otherwise longest processing time first.
- auto:    whichever of the two has the smaller largest rank (ties: files).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Literal

from ckptctl.checkpoint.headers import Checkpoint, TensorInfo
from ckptctl.checkpoint.remembered import LastResult
from ckptctl.settings import SplitMode

# checkpoint-engine packs each tensor into pinned memory at a 256-byte boundary.
PIN_ALIGN = 256
# The exact search for the files split tries at most this many (file, rank) placements, a few
# tens of milliseconds. A step budget, not a time budget, so that every rank stops at the same
# point and gets the same plan.
EXACT_SEARCH_STEPS = 50_000
# A tensors split into contiguous runs is taken when its largest rank is within this fraction
# of the lower bound: neighbours are read in one request instead of one each (a DeepSeek-V3
# checkpoint has 90k tensors; largest-first would deal neighbours out to different ranks).
CONTIGUOUS_SLACK = 0.005


def pinned_size(nbytes: int) -> int:
    return (nbytes + PIN_ALIGN - 1) // PIN_ALIGN * PIN_ALIGN


@dataclass(frozen=True)
class RankPlan:
    rank: int
    files: tuple[str, ...]  # the files this rank reads, sorted
    tensors: tuple[TensorInfo, ...]  # the tensors it registers, in read order (file, offset)
    bytes: int

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory checkpoint-engine needs for these tensors (before bucketing)."""
        return sum(pinned_size(t.nbytes) for t in self.tensors)


@dataclass(frozen=True)
class Plan:
    checkpoint: Checkpoint
    world_size: int
    split: Literal["files", "tensors"]
    requested: SplitMode
    ranks: tuple[RankPlan, ...]
    # Largest rank share of every split that was computed (both under auto).
    candidates: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.checkpoint.total_bytes

    @property
    def max_rank_bytes(self) -> int:
        return max(r.bytes for r in self.ranks)

    @property
    def even_bytes(self) -> float:
        return self.total_bytes / self.world_size

    @property
    def lower_bound_bytes(self) -> int:
        """No split of this kind can do better: max(total / world, largest unit)."""
        return lower_bound(self.checkpoint, self.world_size, self.split)

    def as_json(self) -> dict[str, object]:
        """The contract's fields (world_size, split, total_bytes, ranks[rank, bytes, files,
        tensors]) plus a few extras for people reading the plan."""
        return {
            "world_size": self.world_size,
            "split": self.split,
            "total_bytes": self.total_bytes,
            "ranks": [
                {
                    "rank": r.rank,
                    "bytes": r.bytes,
                    "files": list(r.files),
                    "tensors": r.tensor_names,
                    "tensor_count": len(r.tensors),
                    "pinned_bytes": r.pinned_bytes,
                }
                for r in self.ranks
            ],
            "requested_split": self.requested,
            "checkpoint_path": str(self.checkpoint.root),
            "total_tensors": len(self.checkpoint.tensors),
            "total_files": len(self.checkpoint.files),
            "max_rank_bytes": self.max_rank_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "candidates": dict(self.candidates),
        }


def lower_bound(checkpoint: Checkpoint, world_size: int, split: str) -> int:
    even = -(-checkpoint.total_bytes // world_size)  # ceil
    if split == "files":
        largest = max(checkpoint.file_bytes.values(), default=0)
    else:
        largest = max((t.nbytes for t in checkpoint.tensors), default=0)
    return max(even, largest)


def _lpt(sizes: Sequence[int], world_size: int) -> list[int]:
    """Longest processing time first: sizes must already be sorted, largest first. Each goes to
    the least loaded rank (lowest rank on ties). Returns the rank of each size."""
    heap = [(0, r) for r in range(world_size)]
    owner = [0] * len(sizes)
    for i, size in enumerate(sizes):
        load, r = heap[0]
        heapq.heapreplace(heap, (load + size, r))
        owner[i] = r
    return owner


def _exact(sizes: Sequence[int], world_size: int, owner: list[int]) -> list[int]:
    """Improve an assignment by branch and bound (sizes sorted, largest first); returns the best
    found within EXACT_SEARCH_STEPS placements, which is optimal if the search completes."""
    loads = [0] * world_size
    for size, r in zip(sizes, owner, strict=True):
        loads[r] += size
    best = max(loads)
    floor = max(-(-sum(sizes) // world_size), max(sizes, default=0))
    if best <= floor:
        return owner  # already provably optimal

    best_owner = list(owner)
    current = [0] * len(sizes)
    loads = [0] * world_size
    steps = 0

    def search(i: int) -> bool:
        """True once the lower bound is reached or the budget is spent (stop everything)."""
        nonlocal best, best_owner, steps
        if i == len(sizes):
            best, best_owner = max(loads), list(current)
            return best <= floor
        tried: set[int] = set()
        for r in range(world_size):
            steps += 1
            if steps > EXACT_SEARCH_STEPS:
                return True
            # Ranks with equal loads are interchangeable: trying one of them is enough.
            if loads[r] in tried or loads[r] + sizes[i] >= best:
                continue
            tried.add(loads[r])
            loads[r] += sizes[i]
            current[i] = r
            stop = search(i + 1)
            loads[r] -= sizes[i]
            if stop:
                return True
        return False

    search(0)
    return best_owner


def _ranks_from_groups(
    checkpoint: Checkpoint, groups: list[list[int]], files: list[set[str]]
) -> tuple[RankPlan, ...]:
    """Turn per-rank lists of tensor positions (in `checkpoint.tensors`, which is in read order)
    into RankPlans. Ranks are numbered by their first read, so rank 0 reads the first file;
    ranks with nothing to do come last."""
    for group in groups:
        group.sort()  # read order: grouped by file, then by offset

    def first_read(r: int) -> tuple[bool, int, str]:
        # A rank holding only tensor-less files sorts by file name after those with tensors.
        return (not groups[r], groups[r][0] if groups[r] else 0, min(files[r], default=""))

    tensors = checkpoint.tensors
    sizes = [t.end - t.start for t in tensors]
    ranks = []
    for new, old in enumerate(sorted(range(len(groups)), key=first_read)):
        infos = tuple(map(tensors.__getitem__, groups[old]))
        nbytes = sum(map(sizes.__getitem__, groups[old]))
        ranks.append(RankPlan(new, tuple(sorted(files[old])), infos, nbytes))
    return tuple(ranks)


def _split_files(checkpoint: Checkpoint, world_size: int) -> tuple[RankPlan, ...]:
    positions: dict[str, list[int]] = {f: [] for f in checkpoint.files}
    for i, t in enumerate(checkpoint.tensors):
        positions[t.file].append(i)
    order = sorted(checkpoint.files, key=lambda f: (-checkpoint.file_bytes[f], f))
    sizes = [checkpoint.file_bytes[f] for f in order]
    owner = _exact(sizes, world_size, _lpt(sizes, world_size))
    groups: list[list[int]] = [[] for _ in range(world_size)]
    files: list[set[str]] = [set() for _ in range(world_size)]
    for f, r in zip(order, owner, strict=True):
        groups[r].extend(positions[f])
        files[r].add(f)
    return _ranks_from_groups(checkpoint, groups, files)


def _split_tensors(checkpoint: Checkpoint, world_size: int) -> tuple[RankPlan, ...]:
    tensors = checkpoint.tensors
    groups = _contiguous_runs(checkpoint, world_size)
    if groups is None:
        # Largest first; equal sizes by name, so the order never depends on how files were listed.
        keys = [(t.start - t.end, t.name) for t in tensors]
        order = sorted(range(len(tensors)), key=keys.__getitem__)
        owner = _lpt([tensors[i].end - tensors[i].start for i in order], world_size)
        groups = [[] for _ in range(world_size)]
        for i, r in zip(order, owner, strict=True):
            groups[r].append(i)
    files = [{tensors[i].file for i in group} for group in groups]
    return _ranks_from_groups(checkpoint, groups, files)


def _contiguous_runs(checkpoint: Checkpoint, world_size: int) -> list[list[int]] | None:
    """Cut the tensors, in read order, into `world_size` runs whose largest is as small as
    possible (a binary search on it, each probe a greedy cut by bisection), or None when even
    the best is not within CONTIGUOUS_SLACK of the lower bound."""
    tensors = checkpoint.tensors
    prefix = list(accumulate((t.end - t.start for t in tensors), initial=0))
    n = len(tensors)

    def cuts(cap: int) -> list[int] | None:
        at = [0]
        for _ in range(world_size):
            at.append(bisect.bisect_right(prefix, prefix[at[-1]] + cap, lo=at[-1]) - 1)
        return at if at[-1] == n else None

    low = lower_bound(checkpoint, world_size, "tensors")
    high = int(low * (1 + CONTIGUOUS_SLACK))
    if cuts(high) is None:
        return None
    while low < high:
        mid = (low + high) // 2
        if cuts(mid) is None:
            low = mid + 1
        else:
            high = mid
    best = cuts(high)
    assert best is not None
    return [list(range(a, b)) for a, b in zip(best[:-1], best[1:], strict=True)]


def plan_split(checkpoint: Checkpoint, world_size: int, mode: SplitMode = SplitMode.auto) -> Plan:
    """Split `checkpoint` across `world_size` ranks; `mode` is "auto", "files" or "tensors"."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    mode = SplitMode(mode)  # (a ValueError for anything else)

    def split() -> tuple[str, tuple[RankPlan, ...], dict[str, int]]:
        candidates: dict[str, tuple[RankPlan, ...]] = {}
        if mode in ("auto", "files"):
            candidates["files"] = _split_files(checkpoint, world_size)
        if mode in ("auto", "tensors"):
            candidates["tensors"] = _split_tensors(checkpoint, world_size)
        largest = {name: max(r.bytes for r in ranks) for name, ranks in candidates.items()}
        # Ties go to files: whole files are fewer, larger reads.
        chosen = min(largest, key=lambda name: (largest[name], name != "files"))
        return chosen, candidates[chosen], largest

    # The split depends on the tensors and files alone, not on the directory (remembered.py).
    key = (checkpoint.tensors, checkpoint.files, checkpoint.file_bytes, world_size, mode)
    chosen, ranks, largest = _LAST_SPLIT.get(key, split)
    return Plan(
        checkpoint=checkpoint,
        world_size=world_size,
        split=chosen,  # type: ignore[arg-type]
        requested=mode,
        ranks=ranks,
        candidates=dict(largest),
    )


_LAST_SPLIT: LastResult[tuple[str, tuple[RankPlan, ...], dict[str, int]]] = LastResult()

"""The node's progress on rank 0's terminal: the other ranks' byte counts, through the store.

torchrun's ranks on one node share its terminal, and only rank 0 draws there (the others keep
quiet on a terminal). In a stage where every rank moves its own share (registration: each
reads its part of the checkpoint), rank 0's bar counts the whole node: every other rank of
node 0 publishes its counters in the job's store every PUBLISH_S, and rank 0 reads them when
it draws. Whatever can reach the store's port can write to it, so what rank 0 reads is
checked like any input from the network: bounded in size, numbers only, never more than the
total it claims.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

from ckptctl.launch import LaunchInfo
from ckptctl.progress import Reporter

PUBLISH_S = 0.5
MAX_DOC_BYTES = 4096
MAX_BYTES = 1 << 50  # no rank's share is a petabyte: anything larger is not a real figure
KEPT_FINISHED = 8  # finished stages a rank keeps publishing (rank 0 may still be in them)


class NodeProgress:
    """Rank 0 of node 0: reads the other local ranks' counters (`others`). Any other rank of
    node 0: publishes its own, from a thread, until `stop`."""

    def __init__(self, store: Any, launch: LaunchInfo, reporter: Reporter) -> None:
        self.store = store
        self.launch = launch
        self.reporter = reporter
        self.expected = launch.local_world_size - 1  # the ranks whose counters rank 0 reads
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cache: tuple[float, dict[int, dict[str, tuple[int, int]]]] = (0.0, {})

    @classmethod
    def start(cls, launch: LaunchInfo, coordinator: Any, reporter: Reporter) -> NodeProgress | None:
        """None unless this rank is on node 0 with other ranks beside it (nothing to share)."""
        if coordinator is None or launch.node_rank != 0 or launch.local_world_size <= 1:
            return None
        share = cls(coordinator.store, launch, reporter)
        if launch.rank == 0:
            reporter.node = share
        else:
            share._thread = threading.Thread(
                target=share._run, name="ckptctl-node-progress", daemon=True
            )
            share._thread.start()
        return share

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    # -- the other ranks: publish --------------------------------------------------------------

    def _key(self, rank: int) -> str:
        return f"progress/{rank}"

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_S):
            # Progress is a nicety: a store that hiccups must not end the rank (the watchdog
            # notices a store that is really gone).
            with contextlib.suppress(Exception):
                self.publish()

    def publish(self) -> None:
        stages: dict[str, list[int]] = {}
        for figures in self.reporter.figures.stages[-KEPT_FINISHED:]:
            if figures.node_wide and figures.bytes:
                stages[figures.key] = [figures.bytes, figures.bytes]
        for figures in self.reporter.running_stages():
            if figures.node_wide and figures.bytes:
                stages[figures.key] = [figures.done_bytes(), figures.bytes]
        self.store.set(self._key(self.launch.rank), json.dumps(stages))

    # -- rank 0: read ------------------------------------------------------------------------------

    def others(self, key: str) -> tuple[int, int, int]:
        """(bytes done, bytes in all, ranks) of stage `key` on the node's other ranks."""
        done = total = ranks = 0
        for doc in self._read_all().values():
            if key in doc:
                d, t = doc[key]
                done, total, ranks = done + d, total + t, ranks + 1
        return done, total, ranks

    def _read_all(self) -> dict[int, dict[str, tuple[int, int]]]:
        at, docs = self._cache
        if time.monotonic() - at < PUBLISH_S / 2:
            return docs
        docs = {}
        for rank in range(1, self.launch.local_world_size):
            key = self._key(rank)
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    docs[rank] = parse(self.store.get(key))
        self._cache = (time.monotonic(), docs)
        return docs


def parse(raw: bytes) -> dict[str, tuple[int, int]]:
    """A rank's published counters, or {} for anything that is not what a rank publishes."""
    if len(raw) > MAX_DOC_BYTES:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(doc, dict):
        return {}
    out: dict[str, tuple[int, int]] = {}
    for key, value in doc.items():
        if (
            isinstance(key, str)
            and isinstance(value, list)
            and len(value) == 2
            and all(type(v) is int and 0 <= v <= MAX_BYTES for v in value)
        ):
            out[key] = (min(value[0], value[1]), value[1])
    return out

"""What a serve job is given and keeps between pushes, typed: its options (ServeOptions), the
executor's state (ServeState) and the bounded log of every push it ran (PushLog), which
`ckptctl status --history` lists.

ServeState is written by the push that runs (push.py, on the loop's thread) and read by
`status` (control socket threads); every rank holds its own, alike. No torch here.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptctl.defaults import PUSH_LOG_SIZE
from ckptctl.errors import print_error
from ckptctl.results import outcome

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ckptctl.checkpoint.headers import Checkpoint, TensorInfo
    from ckptctl.checkpoint.plan import RankPlan
    from ckptctl.transfer.host_memory import PinnedPool, ShareReader
    from ckptctl.transfer.pausing import ServerPauses
    from ckptctl.transfer.request import TransferRequest


@dataclass
class ServeOptions:
    request: TransferRequest  # the servers, split and register mode every push starts from
    control_socket: str | None = None  # None: named after the servers (control.py)
    server_wait: float = 30.0  # after the first push: how long a push waits for the server
    server_start_wait: float = 300.0  # the first push's wait, for a server that is starting
    restore: bool = True  # push the last whole checkpoint again after a partial failure
    bucket_size_gb: float | None = None
    mem_fraction: float | None = None
    verbose: bool = False
    drop_page_cache: bool = False  # each push's file pages, once read into pinned buffers
    metrics: tuple[str, int] | None = None  # serve --metrics-host/--metrics-port

    @property
    def push_timeout(self) -> float:
        """Each push's deadline: the request's timeout (Setting.push_timeout)."""
        return self.request.timeout


@dataclass(frozen=True)
class ServedLayout:
    """The tensors the server holds: a push of another layout is refused (push.check_layout)."""

    seq: int  # the push whose checkpoint it is
    tensors: Sequence[TensorInfo]  # their names, dtypes and shapes


# How long a staged read no push took may take to stop before its buffers go back to the pool.
DISCARD_WAIT_S = 30.0


@dataclass
class Staged:
    """A checkpoint read ahead (`ckptctl stage`) into a second set of the pool's buffers while
    the server keeps its weights: the push of it that follows takes them, read."""

    seq: int  # the stage command's
    checkpoint_path: str
    checkpoint: Checkpoint
    share: RankPlan
    reader: ShareReader

    def discard(self) -> None:
        """No push takes it: its read stopped, its buffers back to the pool (kept from it, with
        a warning, if the reader does not stop: it may still write into them)."""
        if not self.reader.discard(DISCARD_WAIT_S):
            print_error(
                "a staged read did not stop; its buffers stay out of the pool until the job ends",
                label="warning",
            )

    def describe(self) -> dict[str, Any]:
        """What `status` says of it."""
        progress = self.reader.progress
        return {
            "seq": self.seq,
            "checkpoint_path": self.checkpoint_path,
            "total_bytes": self.checkpoint.total_bytes,
            "share_bytes": progress.total_bytes,  # this rank's, which it reads
            "bytes_read": progress.bytes_read,
            "read": progress.done.is_set(),
            "error": None if progress.error is None else str(progress.error),
        }


@dataclass
class ServeState:
    """The executor's state, from one push to the next."""

    registered: str | None = None  # the checkpoint name registered with the ParameterServer
    pool: PinnedPool | None = None  # --register-mode direct: pinned buffers refilled by each push
    layout: ServedLayout | None = None  # what the server holds, once a push succeeded
    pinned_pool_bytes: int | None = None  # the pool's pinned bytes after the last push
    # The last KEPT_WHOLE whole pushes' checkpoints by seq, that a restore or rollback re-pushes.
    whole: dict[int, Checkpoint] = field(default_factory=dict)
    server_seen: bool = False  # the server answered once: later pushes wait --server-wait
    staged: Staged | None = None  # `ckptctl stage`: read ahead for the next push
    pauses: ServerPauses | None = None  # --pause: what is paused, resumed after each command

    def drop_staged(self) -> None:
        """Discard the stage held, if any (`Staged.discard`)."""
        staged, self.staged = self.staged, None
        if staged is not None:
            staged.discard()

    @property
    def served_tensors(self) -> int | None:
        """How many tensors the server holds from the job's pushes (None before the first)."""
        return None if self.layout is None else len(self.layout.tensors)


class PushLog:
    """The last `size` pushes of the job, oldest first, one entry of facts each: bounded, so
    that a job that pushes for weeks does not grow (apart from the whole pushes a restore or a
    rollback needs, JobStatus.whole_pushes)."""

    def __init__(self, size: int = PUSH_LOG_SIZE) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self._count = 0  # every push logged, the dropped ones too

    def add(self, result: dict[str, Any]) -> None:
        """Log a push's merged result (loop.merge_results, or a push cancelled before it ran)."""
        entry = {
            "seq": result.get("seq"),
            "action": result.get("action") or "push",
            "checkpoint_path": _clip(result.get("checkpoint_path"), 4096),
            "weight_version": _clip(result.get("weight_version"), 1024),
            "outcome": outcome(result),
            "exit_code": result.get("exit_code"),
            "wall_s": result.get("wall_s"),
            "total_bytes": result.get("total_bytes"),
            "finished_at": result.get("finished_at"),
            "server_weights": result.get("server_weights"),
            "error": _clip(result.get("error"), 2000),
        }
        with self._lock:
            self._entries.append(entry)
            self._count += 1

    def snapshot(self) -> dict[str, Any]:
        """`status --history`'s fields: the pushes kept, how many were logged, the bound."""
        with self._lock:
            entries, count = list(self._entries), self._count
        return {"pushes": entries, "pushes_run": count, "history_limit": self.size}


def _clip(text: Any, most: int) -> str | None:
    """`text` cut to at most `most` bytes as the control socket's JSON writes it (ASCII: a
    character takes 1 to 12 bytes there, an emoji 12), "…" ending one that was cut; None stays
    None. A full log, every string at its longest, still fits in one answer."""
    if text is None:
        return None
    text = str(text)
    if len(text) <= most and len(_escaped(text)) <= most:
        return text
    room = most - len(_escaped("…"))
    low, high = 0, min(len(text), room)  # the longest start that fits (a character: 1+ bytes)
    while low < high:
        mid = (low + high + 1) // 2
        if len(_escaped(text[:mid])) <= room:
            low = mid
        else:
            high = mid - 1
    return text[:low] + "…"


def _escaped(text: str) -> str:
    return json.dumps(text)[1:-1]

"""What a serve job keeps between pushes, typed: the executor's state (ServeState).

ServeState is written by the push that runs (push.py, on the loop's thread) and read by
`status` (control socket threads); every rank holds its own, alike. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptctl.checkpoint.headers import Checkpoint, TensorInfo
    from ckptctl.pipeline.pinning import PinnedPool


@dataclass(frozen=True)
class ServedLayout:
    """The tensors the server holds: a push of another layout is refused (push.check_layout)."""

    seq: int  # the push whose checkpoint it is
    tensors: list[TensorInfo]  # their names, dtypes and shapes


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

    @property
    def served_tensors(self) -> int | None:
        """How many tensors the server holds from the job's pushes (None before the first)."""
        return None if self.layout is None else len(self.layout.tensors)

"""After a failed update: one line for the user, and the GPU memory its frames held let go."""

from __future__ import annotations

import gc
import traceback


def last_line(traceback_text: str) -> str:
    lines = [line.strip() for line in traceback_text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"


def drop_frames(exc: BaseException) -> None:
    """Let go of the frames a failed update's exception holds.

    checkpoint-engine's `_update_per_bucket` holds its GPU transfer buffers (three buckets'
    worth) in locals. A traceback keeps those frames, and so the buffers, alive for as long as
    anything keeps the exception (a chained `__cause__`, a variable in a long-lived loop), and
    a `serve` job would keep them after every refused push. The caller keeps a text copy of
    the traceback for CKPTCTL_DEBUG instead.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        pending += [e.__cause__, e.__context__]


def release_transfer_memory() -> None:
    """Hand a failed update's GPU memory back to the device, for the inference server that
    shares it. checkpoint-engine empties torch's cache in its own `finally`, while the
    failing frames still hold the buffers; once `drop_frames` has let go of them, this
    returns them (and IPC blocks whose last reference is gone) to the driver."""
    import torch

    gc.collect()  # an exception and its frames can hold each other in a cycle
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()

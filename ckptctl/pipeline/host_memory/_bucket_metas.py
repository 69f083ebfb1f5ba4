"""checkpoint-engine's ParameterMetas for host buckets, built fast and from the plan alone.

A 90k-tensor checkpoint needs 90k metas on every rank; validated construction is too slow for
that, so they are built as pydantic's `model_construct` builds them. Every rank can also work
out every other rank's buckets from the plan they share (`planned_buffers`), which spares
pickling all metas through gather_metas' all_gather_object.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from typing import Any

from ckptctl.pipeline.host_memory._file_reads import ALIGN, HostBucket, layout


class MetaMaker:
    """checkpoint-engine ParameterMetas for a bucket's tensors, `==` to validated ones, with one
    torch dtype and one torch.Size object per distinct dtype and shape: equal shapes pickle as
    one memo reference in every bucket checkpoint-engine sends to the server."""

    def __init__(self) -> None:
        from ckptctl.checkpoint.loader import torch_layout
        from ckptctl.pipeline.engine import engine_module

        self._cls = engine_module("data_types").ParameterMeta
        self._layout = torch_layout
        self._known: dict[tuple[str, tuple[int, ...]], tuple[Any, Any]] = {}
        self._fields = frozenset(("name", "dtype", "shape", "aligned_size"))

    def __call__(self, bucket: HostBucket) -> list[Any]:
        import torch

        new, set_slot = object.__new__, object.__setattr__
        cls, known, fields, align = self._cls, self._known, self._fields, ALIGN
        out: list[Any] = []
        append = out.append
        for t, _ in bucket.placed:
            layout = known.get((t.dtype, t.shape))
            if layout is None:
                dtype, shape = self._layout(t)
                layout = known[(t.dtype, t.shape)] = (dtype, torch.Size(shape))
            meta = new(cls)
            set_slot(
                meta,
                "__dict__",
                {
                    "name": t.name,
                    "dtype": layout[0],
                    "shape": layout[1],
                    "aligned_size": (t.end - t.start + align - 1) // align * align,
                },
            )
            set_slot(meta, "__pydantic_fields_set__", fields)
            set_slot(meta, "__pydantic_extra__", None)
            set_slot(meta, "__pydantic_private__", None)
            append(meta)
        return out


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection while 90k objects are made (none of them cyclic garbage): with
    torch imported, each collection walks its heap and doubles the time these loops take."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def planned_buffers(plan: Any) -> dict[int, list[tuple[int, list[Any]]]]:
    """Every rank's host buffers as its ShareReader lays them out - (size, metas) per bucket -
    from the plan that every rank shares (ParameterServerSession.gather_planned)."""
    make = MetaMaker()
    with gc_paused():
        return {
            r.rank: [(b.size, make(b)) for b in layout(r.tensors)] for r in plan.ranks if r.tensors
        }

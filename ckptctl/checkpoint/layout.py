"""Whether a checkpoint has the tensors a server holds: the same names, dtypes and shapes.

A server loads pushed tensors into the parameters it has; one of another shape fails in the
middle of its update, after the tensors before it were taken, and leaves the server with a mix
of old and new weights. A serve job therefore compares each push with what it served last,
before anything is sent (serve/push.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from ckptctl.checkpoint.headers import TensorInfo

# How many differing tensors a refusal names; the rest are counted.
SHOWN = 3


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def layout_change(served: Iterable[TensorInfo], new: Iterable[TensorInfo]) -> str | None:
    """None when `new` has exactly the names, dtypes and shapes of `served` (in any order and
    any files); else what differs: the first SHOWN differing tensors, then a count of all.

    Tensors of `new` come first in its own order (another dtype or shape, or not served),
    then the served tensors it lacks."""
    served, new = tuple(served), tuple(new)
    if served == new:  # the same tensors (a pass of pointer checks: checkpoint/remembered.py)
        return None
    before = {t.name: (t.dtype, t.shape) for t in served}
    after = {t.name: (t.dtype, t.shape) for t in new}
    if before == after:  # the common case, compared in C
        return None
    found: list[str] = []
    counts = {"another shape": 0, "another dtype": 0, "new": 0, "missing": 0}
    for name, (dtype, shape) in after.items():
        old = before.get(name)
        if old == (dtype, shape):
            continue
        if old is None:
            counts["new"] += 1
            what = f"{name}: new here (not served)"
        else:
            counts["another dtype" if old[0] != dtype else "another shape"] += 1
            what = f"{name}: {dtype} {_shape(shape)} here, {old[0]} {_shape(old[1])} served"
        if len(found) < SHOWN:
            found.append(what)
    missing = [name for name in before if name not in after]  # in the served order
    counts["missing"] = len(missing)
    found += [f"{name}: missing here (served)" for name in missing[: SHOWN - len(found)]]
    total = sum(counts.values())
    text = "; ".join(found)
    if total > len(found):
        kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
        text += f"; and {total - len(found)} more ({total} differ: {kinds})"
    return text

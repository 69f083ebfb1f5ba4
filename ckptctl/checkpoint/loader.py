"""Handing a rank's tensors to checkpoint-engine without a second copy in host memory.

checkpoint-engine's `register_checkpoint(name, named_tensors=...)` copies every tensor into
pinned buffers itself. If we handed it tensors read into memory first (as `safe_open(...)
.get_tensor` does), each rank would hold the checkpoint twice at peak. Instead every tensor
here is a view into a private, copy-on-write mapping of its file: the bytes come from the page
cache when checkpoint-engine copies them, and no anonymous memory is allocated for them.

The mapping is private (MAP_PRIVATE): writing to a returned tensor never reaches the file, and
the files are never modified, moved or deleted (unlike checkpoint-engine's in-place pinning of
/dev/shm files, which removes them).

torch is imported inside the functions: `ckptctl --help` must not pay for it.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckptctl.checkpoint.headers import SAFETENSORS_DTYPES, Checkpoint, TensorInfo, open_planned
from ckptctl.checkpoint.plan import RankPlan
from ckptctl.errors import InvalidInput

if TYPE_CHECKING:
    import torch

TORCH_DTYPE_NAMES = {name: attr for name, (_, attr) in SAFETENSORS_DTYPES.items() if attr}


def torch_dtype(dtype: str) -> torch.dtype | None:
    """The torch dtype for a safetensors dtype, or None if this torch has none (F6_*, ...)."""
    import torch

    attr = TORCH_DTYPE_NAMES.get(dtype)
    return getattr(torch, attr, None) if attr else None


def torch_layout(t: TensorInfo) -> tuple[torch.dtype, tuple[int, ...]]:
    dtype = torch_dtype(t.dtype)
    shape = t.shape
    if dtype is not None and t.dtype == "F4":
        if not shape or shape[-1] % 2:
            dtype = None  # torch's packed type cannot split a byte across rows
        else:
            shape = (*shape[:-1], shape[-1] // 2)
    if dtype is None:
        raise InvalidInput(
            f"{t.file}: tensor {t.name!r} has dtype {t.dtype} {list(t.shape)}, which this torch "
            "build cannot represent; convert the tensor to a supported dtype"
        )
    return dtype, shape


def _map_file(checkpoint: Checkpoint, file: str, needed: int) -> mmap.mmap:
    """A private mapping of `file`, once it is known to be the very file that was planned.

    A mapped file that is cut short kills the process with SIGBUS (exit 135, no message) when
    checkpoint-engine copies from past its new end: `open_planned` refuses (exit 3) a file
    whose size, inode, mtime or ctime changed since its header was read. What no check can catch is
    a file truncated *during* the copy, after this point: keep writers away from a checkpoint
    while it loads (or use --register-mode direct, whose reads fail cleanly on a short file).
    """
    path = checkpoint.path_of(file)
    fd = open_planned(checkpoint, file)
    try:
        size = os.fstat(fd).st_size
        if size < needed:  # (a checkpoint built without recorded identities)
            raise InvalidInput(
                f"{path}: is {size} bytes, but its header needs {needed}: the file changed "
                "since the checkpoint was planned; wait for the writer to finish and rerun"
            )
        return _map_private(fd, size)
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot be mapped ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


MAP_FIXED = 0x10  # Linux on x86-64, arm64 and ppc64le alike


def _map_private(fd: int, size: int) -> mmap.mmap:
    """A private (MAP_PRIVATE: writable for torch, writes never reach the file) mapping of the
    first `size` bytes of `fd` that keeps no file descriptor open.

    Python's mmap keeps a dup of the fd for the mapping's life: one per shard, and a checkpoint
    of more shards than `ulimit -n` ran out of descriptors. So Python maps anonymous memory of
    that size (it owns the range and unmaps it when the last view is gone), and the file is
    mapped over it in place (MAP_FIXED); the caller closes `fd`.
    """
    import ctypes

    prot = mmap.PROT_READ | mmap.PROT_WRITE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE, prot=prot)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
    ]  # fmt: skip
    if libc.mmap(address, size, prot, mmap.MAP_PRIVATE | MAP_FIXED, fd, 0) != address:
        err = ctypes.get_errno()
        region.close()
        raise OSError(err, os.strerror(err))
    return region


def load_tensors(checkpoint: Checkpoint, tensors: Iterable[TensorInfo]) -> dict[str, torch.Tensor]:
    """{name: tensor} for `tensors`, each a zero-copy view into its file's mapping.

    Views are CPU tensors with the checkpoint's dtype and shape; the data is read from disk (or
    the page cache) only when it is first touched. The mappings live as long as the tensors.
    """
    import torch

    tensors = list(tensors)
    needed: dict[str, int] = {}
    for t in tensors:
        needed[t.file] = max(needed.get(t.file, 0), t.end)
    maps: dict[str, mmap.mmap] = {}
    out: dict[str, torch.Tensor] = {}
    for t in tensors:
        dtype, shape = torch_layout(t)
        if t.nbytes == 0:
            out[t.name] = torch.empty(shape, dtype=dtype)  # no bytes to map (a 0 in the shape)
            continue
        mapping = maps.get(t.file)
        if mapping is None:
            mapping = maps[t.file] = _map_file(checkpoint, t.file, needed[t.file])
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=t.nbytes, offset=t.start)
        out[t.name] = raw.view(dtype).view(shape)
    return out


def load_rank_tensors(checkpoint: Checkpoint, rank_plan: RankPlan) -> dict[str, torch.Tensor]:
    """The tensors rank `rank_plan.rank` registers, as views backed by the file mappings.

    Pass the result to `ParameterServer.register_checkpoint(name, named_tensors=...)` (with
    `files=[]`) in every split mode: checkpoint-engine then copies straight from the page cache
    into its pinned buffers.
    """
    return load_tensors(checkpoint, rank_plan.tensors)

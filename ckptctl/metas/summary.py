"""What a metas file holds (for `inspect-metas`), and how it differs from a checkpoint.

Sizes here are real tensor bytes (dtype itemsize × numel). checkpoint-engine's
`aligned_size` rounds each tensor up to 256 bytes inside its pinned buffers; that total is
reported separately as `buffer_bytes`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ckptctl.checkpoint.headers import SAFETENSORS_DTYPES, TensorInfo

if TYPE_CHECKING:
    from checkpoint_engine.data_types import MemoryBufferMetaList

    from ckptctl.metas.fileformat import MetasFile

# A metas file's torch dtype string → its safetensors name (not F4's: its torch shape counts
# bytes, so a metas file of F4 tensors differs from the checkpoint in dtype).
_TORCH_TO_SAFETENSORS = {
    f"torch.{attr}": name for name, (_, attr) in SAFETENSORS_DTYPES.items() if attr and name != "F4"
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    rank: int
    dtype: str  # "torch.bfloat16"
    shape: tuple[int, ...]
    nbytes: int

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rank": self.rank,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "bytes": self.nbytes,
        }


@dataclass(frozen=True)
class RankSummary:
    rank: int
    buffers: int
    parameters: int
    nbytes: int
    buffer_bytes: int
    p2p_store_addr: str | None
    rdma_device: str

    def as_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "parameters": self.parameters,
            "bytes": self.nbytes,
            "buffers": self.buffers,
            "buffer_bytes": self.buffer_bytes,
            "p2p_store_addr": self.p2p_store_addr,
            "rdma_device": self.rdma_device,
        }


@dataclass(frozen=True)
class MetasSummary:
    source: MetasFile
    ranks: list[RankSummary]
    dtypes: dict[str, tuple[int, int]]  # torch dtype string → (parameters, bytes), largest first
    largest: list[TensorEntry]
    duplicate_names: list[str] = field(default_factory=list)

    @property
    def total_parameters(self) -> int:
        return sum(r.parameters for r in self.ranks)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    @property
    def p2p_ready(self) -> bool:
        """Whether `join` can use it: checkpoint-engine's load_metas needs both on every rank."""
        return bool(self.ranks) and all(r.p2p_store_addr and r.rdma_device for r in self.ranks)

    def as_json(self) -> dict[str, Any]:
        """cli-contract `inspect-metas --json` fields first, then extras."""
        src = self.source
        return {
            "checkpoint_name": src.checkpoint_name,
            "world_size": src.world_size,
            "total_parameters": self.total_parameters,
            "total_bytes": self.total_bytes,
            "ranks": [r.as_json() for r in self.ranks],
            "file": str(src.path),
            "legacy_pickle": src.legacy_pickle,
            "format_version": src.format_version,
            "created_at": src.created_at.isoformat() if src.created_at else None,
            "ckptctl_version": src.ckptctl_version,
            "checkpoint_engine_version": src.checkpoint_engine_version,
            "total_buffers": sum(r.buffers for r in self.ranks),
            "buffer_bytes": sum(r.buffer_bytes for r in self.ranks),
            "p2p_ready": self.p2p_ready,
            "dtypes": [
                {"dtype": d, "parameters": n, "bytes": b} for d, (n, b) in self.dtypes.items()
            ],
            "largest_tensors": [t.as_json() for t in self.largest],
            "duplicate_names": self.duplicate_names,
        }


def tensor_entries(metas: dict[int, MemoryBufferMetaList]) -> list[TensorEntry]:
    """Every parameter of every owner rank, in rank then buffer order."""
    return [
        TensorEntry(
            name=p.name,
            rank=rank,
            dtype=str(p.dtype),
            shape=tuple(p.shape),
            nbytes=p.dtype.itemsize * p.shape.numel(),
        )
        for rank in sorted(metas)
        for buffer in metas[rank].memory_buffer_metas_list
        for p in buffer.metas
    ]


def summarize(source: MetasFile, *, top: int = 10) -> MetasSummary:
    ranks = []
    for rank in sorted(source.metas):
        entry = source.metas[rank]
        buffers = entry.memory_buffer_metas_list
        ranks.append(
            RankSummary(
                rank=rank,
                buffers=len(buffers),
                parameters=sum(len(b.metas) for b in buffers),
                nbytes=sum(p.dtype.itemsize * p.shape.numel() for b in buffers for p in b.metas),
                buffer_bytes=sum(b.size for b in buffers),
                p2p_store_addr=entry.p2p_store_addr,
                rdma_device=entry.rdma_device,
            )
        )
    tensors = tensor_entries(source.metas)
    dtypes: dict[str, tuple[int, int]] = {}
    for t in tensors:
        n, b = dtypes.get(t.dtype, (0, 0))
        dtypes[t.dtype] = (n + 1, b + t.nbytes)
    counts = Counter(t.name for t in tensors)
    return MetasSummary(
        source=source,
        ranks=ranks,
        dtypes=dict(sorted(dtypes.items(), key=lambda kv: (-kv[1][1], kv[0]))),
        largest=sorted(tensors, key=lambda t: (-t.nbytes, t.name))[:top],
        duplicate_names=sorted(n for n, c in counts.items() if c > 1),
    )


# --------------------------------------------------------------------------------------------
# Checking a metas file against a checkpoint


class CheckpointTensor(NamedTuple):
    """One tensor of a checkpoint as its safetensors header describes it."""

    name: str
    dtype: str  # safetensors name: "BF16"
    shape: tuple[int, ...]
    nbytes: int | None  # from the header's data offsets; None where the reader cannot tell


@dataclass(frozen=True)
class Difference:
    # missing_in_metas · not_in_checkpoint · duplicate_in_metas · dtype · shape · size
    kind: str
    name: str
    metas: str | None = None
    checkpoint: str | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        if self.kind == "missing_in_metas":
            return f"{self.name}: in the checkpoint, not in the metas"
        if self.kind == "not_in_checkpoint":
            return f"{self.name}: in the metas, not in the checkpoint"
        if self.kind == "duplicate_in_metas":
            return f"{self.name}: held by several ranks ({self.metas})"
        return f"{self.name}: {self.kind} {self.metas} in the metas, {self.checkpoint} in the checkpoint"


def compare_with_checkpoint(
    metas: dict[int, MemoryBufferMetaList], checkpoint: Iterable[CheckpointTensor | TensorInfo]
) -> list[Difference]:
    """Names, dtypes, shapes and sizes that differ, in checkpoint order, then metas extras."""
    held: dict[str, list[TensorEntry]] = {}
    for t in tensor_entries(metas):
        held.setdefault(t.name, []).append(t)
    diffs = [
        Difference("duplicate_in_metas", name, metas="ranks " + ",".join(str(t.rank) for t in ts))
        for name, ts in held.items()
        if len(ts) > 1
    ]
    seen: set[str] = set()
    for ct in checkpoint:
        seen.add(ct.name)
        if ct.name not in held:
            diffs.append(Difference("missing_in_metas", ct.name))
            continue
        mt = held[ct.name][0]
        mt_dtype = _TORCH_TO_SAFETENSORS.get(mt.dtype, mt.dtype)
        if mt_dtype != ct.dtype:
            diffs.append(Difference("dtype", ct.name, mt_dtype, ct.dtype))
        elif mt.shape != tuple(ct.shape):
            diffs.append(Difference("shape", ct.name, str(list(mt.shape)), str(list(ct.shape))))
        elif ct.nbytes is not None and mt.nbytes != ct.nbytes:
            # dtype and shape agree: the checkpoint's header offsets contradict them.
            diffs.append(Difference("size", ct.name, f"{mt.nbytes} bytes", f"{ct.nbytes} bytes"))
    diffs.extend(Difference("not_in_checkpoint", name) for name in held if name not in seen)
    return diffs

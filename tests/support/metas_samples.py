"""Real checkpoint-engine metas for the tests (its pydantic models import fine on CPU)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from checkpoint_engine.data_types import MemoryBufferMetaList, MemoryBufferMetas, ParameterMeta

# Every dtype torch has, once each under its canonical name (torch.float, torch.half are aliases).
ALL_DTYPES = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=lambda d: str(d)
)
ALIGN = 256


def aligned(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """checkpoint-engine's _align_size: real bytes rounded up to 256."""
    nbytes = dtype.itemsize * torch.Size(shape).numel()
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def param(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> ParameterMeta:
    return ParameterMeta(
        name=name, dtype=dtype, shape=torch.Size(shape), aligned_size=aligned(dtype, shape)
    )


def owner(params: list[ParameterMeta], rank: int, *, buffers: int = 1) -> MemoryBufferMetaList:
    """One owner rank's entry, its parameters spread over `buffers` pinned buffers."""
    chunks = [params[i::buffers] for i in range(buffers)]
    return MemoryBufferMetaList(
        p2p_store_addr=f"10.0.0.{rank // 8}:{17000 + rank}",
        rdma_device=f"mlx5_{rank % 8}",
        memory_buffer_metas_list=[
            MemoryBufferMetas(
                metas=chunk,
                ptr=0x7F00_0000_0000 + rank * 2**32 + i * 2**28,
                size=sum(p.aligned_size for p in chunk),
            )
            for i, chunk in enumerate(chunks)
        ],
    )


def every_dtype_metas(world_size: int = 64) -> dict[int, MemoryBufferMetaList]:
    """Every dtype, 0-dim and zero-element shapes, owner ranks spread over a large world."""
    shapes = [(), (0,), (3,), (2, 0, 5), (4, 7), (1, 1, 1, 1)]
    params = [
        param(f"model.layers.{i}.{str(dt)[6:]}.{j}", dt, shape)
        for i, dt in enumerate(ALL_DTYPES)
        for j, shape in enumerate(shapes)
    ]
    ranks = list(range(0, world_size, 3))  # a sparse set: get_metas() leaves out empty ranks
    return {
        rank: owner(params[k :: len(ranks)], rank, buffers=1 + k % 3)
        for k, rank in enumerate(ranks)
    }


def small_metas() -> dict[int, MemoryBufferMetaList]:
    return {
        0: owner([param("embed.weight", torch.bfloat16, (16, 8))], 0),
        1: owner(
            [
                param("lm_head.weight", torch.bfloat16, (16, 8)),
                param("layer.scale", torch.float8_e4m3fn, ()),
                param("layer.norm", torch.float32, (8,)),
            ],
            1,
            buffers=2,
        ),
    }


def write_small_metas(directory: Path) -> Path:
    """small_metas() as `metas.json`: checkpoint "ck-iter-7", world size 2."""
    from ckptctl.metas import write_metas_file

    path = directory / "metas.json"
    write_metas_file(path, small_metas(), checkpoint_name="ck-iter-7", world_size=2)
    return path


def canonical_checksum(doc: dict[str, Any]) -> str:
    """The checksum as the format defines it, computed here independently of ckptctl."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def rewrite(path: Path, mutate: Any, *, fix_checksum: bool = True) -> None:
    """Edit a metas file's JSON; by default re-sign it, as a forger (or a careful editor) would."""
    doc = json.loads(path.read_text())
    mutate(doc)
    if fix_checksum:
        doc["checksum"] = canonical_checksum(doc)
    path.write_text(json.dumps(doc))

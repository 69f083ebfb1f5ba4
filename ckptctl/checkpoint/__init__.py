"""Checkpoints on disk: read their layout from headers, plan a split, load a rank's share.

    ckpt = read_checkpoint("/models/Qwen3-8B")           # headers only, validated (exit 3)
    plan = plan_split(ckpt, world_size=8, mode="auto")    # the same plan on every rank
    named = load_rank_tensors(ckpt, plan.ranks[rank])     # zero-copy views into the files

Only the loader's functions import torch, and only when called.
"""

from __future__ import annotations

from ckptctl.checkpoint.headers import DTYPE_BITS, Checkpoint, TensorInfo, read_checkpoint
from ckptctl.checkpoint.loader import load_rank_tensors, load_tensors, torch_dtype
from ckptctl.checkpoint.plan import Plan, RankPlan, plan_split

__all__ = [
    "DTYPE_BITS",
    "Checkpoint",
    "Plan",
    "RankPlan",
    "TensorInfo",
    "load_rank_tensors",
    "load_tensors",
    "plan_split",
    "read_checkpoint",
    "torch_dtype",
]

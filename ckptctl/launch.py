"""Where this process sits in a `torchrun` job, read from the environment without importing torch."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    under_torchrun: bool = False

    @property
    def is_primary(self) -> bool:
        """Rank 0 prints results and drives progress displays; the others only log."""
        return self.rank == 0

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value.strip() else default
    except ValueError:
        return default


def launch_info() -> LaunchInfo:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE; a plain process is rank 0 of 1."""
    under = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = _int_env("WORLD_SIZE", 1)
    return LaunchInfo(
        rank=_int_env("RANK", 0),
        world_size=world,
        local_rank=_int_env("LOCAL_RANK", _int_env("RANK", 0)),
        local_world_size=_int_env("LOCAL_WORLD_SIZE", world),
        under_torchrun=under,
    )

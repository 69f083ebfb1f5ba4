"""Where the tests' files are: the repository, the example checkpoint, the helper scripts."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]
TINY = ROOT / "examples" / "tiny-checkpoint"

# Scripts the tests run as processes of their own (under torchrun, most of them).
CPU_PS_RANK = str(SUPPORT / "cpu_ps_rank.py")  # the real CLI, CPU ParameterServer stand-in
SERVE_RANK = str(SUPPORT / "serve_rank.py")
COORDINATION_RANK = str(SUPPORT / "coordination_rank.py")
P2P_RANK = str(SUPPORT / "p2p_rank.py")
GPU_RECEIVER = str(SUPPORT / "gpu_receiver.py")

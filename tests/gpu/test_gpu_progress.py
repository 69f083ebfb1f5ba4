"""The progress display's byte counts against checkpoint-engine's real ParameterServer (issue 15,
item 6): every bucket the server's worker loaded is counted, and direct registration counts
every byte it reads. The counts show in each stage's figures as `bytes_done`. Needs CUDA (see
tests/gpu/README.md).

    python -m pytest -m gpu tests/gpu/test_gpu_progress.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ckpt_factory import mixed_tensors, write_real_checkpoint
from gpu_jobs import assert_bit_exact, json_summary, torchrun_update
from gpu_receiver import ReceiverServer

from ckptctl.checkpoint import plan_split, read_checkpoint

pytestmark = [pytest.mark.gpu]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mixed dtypes and a few MB, so that 1 MiB buckets make several buckets."""
    import torch

    g = torch.Generator().manual_seed(5)
    big = {
        f"model.layers.{i}.w": torch.randn(512, 1024, generator=g).to(torch.bfloat16)
        for i in range(4)
    }
    mixed = mixed_tensors(seed=6)
    return write_real_checkpoint(tmp_path_factory.mktemp("progress"), [mixed, big])


@pytest.mark.parametrize("mode", ["engine", "direct"])
def test_the_update_counts_every_bucket_and_the_reader_every_byte(
    checkpoint: Path, mode: str
) -> None:
    total = read_checkpoint(checkpoint).total_bytes
    with ReceiverServer(checkpoint, [0]) as rx:
        code, out, err, _ = torchrun_update(
            1,
            "--checkpoint-path", str(checkpoint), "--inference-parallel-size", "1",
            "--endpoint", rx.endpoint, "--json", "--timeout", "120",
            "--bucket-size-gb", "0.001", "--register-mode", mode,
        )  # fmt: skip
        assert code == 0, err[-4000:]
        assert_bit_exact(rx, checkpoint)
    stages: dict[str, Any] = json_summary(out)["ranks"][0]["stages"]
    update, register = stages["update"], stages["register"]
    # every bucket's reply came back empty (loaded), and each one was counted once
    assert update["bytes"] == total and update["bytes_done"] == total, json.dumps(stages)
    share = plan_split(read_checkpoint(checkpoint), 1, "auto").ranks[0].bytes
    if mode == "direct":
        assert register["bytes_done"] == share  # every pread, counted
    else:
        # checkpoint-engine copies out of the file mappings: the pages it mapped so far
        assert 0 < register["bytes_done"] <= share
    assert "mooncake" not in err  # checkpoint-engine's p2p notice: nobody asked for p2p

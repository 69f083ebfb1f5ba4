"""load_rank_tensors: correct bytes for every dtype, zero-copy views, files left untouched,
and the host memory it costs (measured in a fresh process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_factory import mixed_tensors, sparse_file, write_raw, write_real_checkpoint
from safetensors.torch import load_file

from ckptctl.checkpoint import load_rank_tensors, load_tensors, plan_split, read_checkpoint
from ckptctl.errors import InvalidInput

HERE = Path(__file__).resolve().parent


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).tolist())


def mixed_checkpoint(root: Path, shards: int = 3) -> Path:
    tensors = mixed_tensors()
    names = list(tensors)
    return write_real_checkpoint(
        root, [{k: tensors[k] for k in names[i::shards]} for i in range(shards)]
    )


@pytest.mark.parametrize("mode", ["files", "tensors"])
def test_every_rank_gets_its_tensors_with_the_right_bytes(tmp_path: Path, mode: str) -> None:
    root = mixed_checkpoint(tmp_path / "c")
    ckpt = read_checkpoint(root)
    expected: dict[str, torch.Tensor] = {}
    for f in ckpt.files:
        expected.update(load_file(str(root / f)))
    plan = plan_split(ckpt, 2, mode)  # type: ignore[arg-type]
    loaded: dict[str, torch.Tensor] = {}
    for rank_plan in plan.ranks:
        named = load_rank_tensors(ckpt, rank_plan)
        assert list(named) == rank_plan.tensor_names
        loaded.update(named)
    assert set(loaded) == set(expected)
    for name, want in expected.items():
        got = loaded[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert got.device.type == "cpu"
        assert raw(got) == raw(want), name


def test_zero_dim_and_empty_tensors(tmp_path: Path) -> None:
    root = mixed_checkpoint(tmp_path / "c", shards=1)
    ckpt = read_checkpoint(root)
    named = load_tensors(ckpt, ckpt.tensors)
    assert named["scalar_f32"].shape == () and named["scalar_f32"].item() == 3.5
    assert named["scalar_i64"].item() == -7
    assert named["empty_bf16"].shape == (0, 4) and named["empty_bf16"].dtype == torch.bfloat16
    assert named["empty_i32"].shape == (3, 0)
    # What checkpoint-engine does with each tensor: flatten, view as bytes, copy.
    for t in named.values():
        assert t.view(-1).view(torch.uint8).numel() == t.numel() * t.element_size()


def test_dtypes_safetensors_cannot_load_into_torch(tmp_path: Path) -> None:
    # F8_E8M0 (MX scales) and F4 (packed pairs): safetensors' own torch loader refuses them.
    root = tmp_path / "c"
    root.mkdir()
    header = {
        "scale": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]},
        "packed": {"dtype": "F4", "shape": [2, 6], "data_offsets": [4, 10]},
    }
    path = write_raw(root / "model.safetensors", header, 10)
    payload = bytes(range(120, 130))
    with open(path, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(payload)
    ckpt = read_checkpoint(root)
    named = load_tensors(ckpt, ckpt.tensors)
    assert named["scale"].dtype == torch.float8_e8m0fnu and raw(named["scale"]) == payload[:4]
    assert named["packed"].dtype == torch.float4_e2m1fn_x2
    assert named["packed"].shape == (2, 3)  # two values per byte
    assert raw(named["packed"]) == payload[4:]


def test_dtype_torch_cannot_represent_is_invalid_input(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    sparse_file(root / "model.safetensors", [("w", "F6_E2M3", (4, 4))])
    ckpt = read_checkpoint(root)
    with pytest.raises(InvalidInput, match=r"'w'.*F6_E2M3.*cannot represent"):
        load_tensors(ckpt, ckpt.tensors)


def test_views_share_the_file_mapping_and_never_write_the_file(tmp_path: Path) -> None:
    root = mixed_checkpoint(tmp_path / "c", shards=1)
    path = root / "model.safetensors"
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    ckpt = read_checkpoint(root)
    named = load_tensors(ckpt, ckpt.tensors)
    fp32 = named["fp32"]
    # A view, not a copy: its storage is exactly the tensor's bytes in the mapping.
    assert fp32.untyped_storage().nbytes() == fp32.numel() * 4
    fp32.fill_(123.0)  # copy-on-write: the private mapping changes, the file does not
    del named, fp32
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    assert path.exists()


def test_file_that_shrank_since_planning(tmp_path: Path) -> None:
    root = mixed_checkpoint(tmp_path / "c", shards=1)
    ckpt = read_checkpoint(root)
    os.truncate(root / "model.safetensors", 100)
    with pytest.raises(InvalidInput, match="changed since the checkpoint was planned"):
        load_tensors(ckpt, ckpt.tensors)


MEASURE = r"""
import gc, json, sys, torch
from ckptctl.checkpoint import load_rank_tensors, plan_split, read_checkpoint

def status():
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out

ckpt = read_checkpoint(sys.argv[1])
# What checkpoint-engine allocates: a pinned buffer for the rank's bytes (pageable here).
dest = torch.empty(ckpt.total_bytes, dtype=torch.uint8)
dest.fill_(0)
stages = {"start": status()}
named = load_rank_tensors(ckpt, plan_split(ckpt, 1).ranks[0])
stages["loaded"] = status()
offset = 0
for t in named.values():  # checkpoint-engine's register_tensor: flatten, bytes, copy
    n = t.numel() * t.element_size()
    dest[offset:offset + n] = t.view(-1).view(torch.uint8)
    offset += n
stages["copied"] = status()
del named, t
gc.collect()
stages["released"] = status()
print(json.dumps({"bytes": ckpt.total_bytes, "stages": stages}))
"""


def test_host_memory_one_copy_not_two(tmp_path: Path) -> None:
    """Loading allocates nothing; copying out costs page cache (file-backed, reclaimable), not
    anonymous memory; dropping the tensors unmaps it, leaving only the destination."""
    root = tmp_path / "c"
    root.mkdir()
    chunk = torch.arange(16 << 20, dtype=torch.int32).view(torch.uint8)  # 64 MiB of data
    for i in range(2):
        shard = {f"w{i}.{j}": chunk[j << 23 : (j + 1) << 23].view(torch.bfloat16) for j in range(8)}
        write_real_checkpoint(root, [shard], names=[f"part{i}.safetensors"], index=False)
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(done.stdout)
    size, stages = result["bytes"], result["stages"]
    assert size == 128 << 20

    def grew(stage: str, key: str) -> int:
        return stages[stage][key] - stages["start"][key]

    assert grew("loaded", "RssAnon") < 0.05 * size and grew("loaded", "RssFile") < 0.05 * size
    assert grew("copied", "RssAnon") < 0.05 * size  # no second anonymous copy
    assert grew("copied", "RssFile") > 0.9 * size  # the source pages, mapped from the cache
    assert grew("released", "RssFile") < 0.05 * size  # unmapped once the tensors are gone

"""A serve job's next push of the same model: its headers, plan, layout and metas are the
last push's, found again rather than worked out again (ckptctl.checkpoint.remembered) - and
never for a checkpoint that differs in anything they depend on. Real safetensors files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from ckpt_factory import write_real_checkpoint

from ckptctl.checkpoint import plan_split, read_checkpoint
from ckptctl.checkpoint.headers import HEADERS
from ckptctl.checkpoint.layout import layout_change
from ckptctl.checkpoint.remembered import TENSOR_BYTES, HeaderCache, LastResult
from ckptctl.errors import InvalidInput


def shards(seed: int, rows: int = 8) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {f"layers.{s}.w": torch.randn(rows, 16, generator=g), f"layers.{s}.b": torch.randn(16)}
        for s in range(3)
    ]


@pytest.fixture(autouse=True)
def _fresh_cache() -> None:
    HEADERS.clear()


def test_the_same_headers_give_the_same_tensors_from_another_directory(tmp_path: Path) -> None:
    a = read_checkpoint(write_real_checkpoint(tmp_path / "a", shards(1)))
    b = read_checkpoint(write_real_checkpoint(tmp_path / "b", shards(2)))  # other bytes
    assert b.root != a.root and b.tensors == a.tensors
    # The very same objects: what is planned from them is found again by pointer checks.
    assert all(x is y for x, y in zip(a.tensors, b.tensors, strict=True))
    # ... and the plan is the last one's, for this checkpoint (its own directory).
    pa, pb = plan_split(a, 2), plan_split(b, 2)
    assert pb.ranks is pa.ranks and pb.checkpoint is b
    assert layout_change(a.tensors, b.tensors) is None


def test_a_header_that_differs_is_read_anew(tmp_path: Path) -> None:
    a = read_checkpoint(write_real_checkpoint(tmp_path / "a", shards(1)))
    b = read_checkpoint(write_real_checkpoint(tmp_path / "b", shards(1, rows=9)))
    shapes = {t.name: t.shape for t in b.tensors}
    assert shapes["layers.0.w"] == (9, 16), shapes
    assert plan_split(b, 2).ranks != plan_split(a, 2).ranks
    change = layout_change(a.tensors, b.tensors)
    assert change is not None and "layers.0.w" in change


def test_a_known_header_over_a_cut_file_is_still_refused(tmp_path: Path) -> None:
    """The header's bytes are the ones validated before, but the file is shorter: its tensors
    run past the end, which the cache must not hide."""
    a = write_real_checkpoint(tmp_path / "a", shards(1))
    read_checkpoint(a)
    cut = tmp_path / "cut"
    shutil.copytree(a, cut)
    last = sorted(cut.glob("*.safetensors"))[-1]
    last.write_bytes(last.read_bytes()[:-4])
    with pytest.raises(InvalidInput, match="past the end"):
        read_checkpoint(cut)


def test_header_cache_is_bounded() -> None:
    cost = 4 + TENSOR_BYTES  # (4 header bytes and one tensor each)
    cache = HeaderCache(max_entries=3, max_bytes=2 * cost)
    cache.put("a", 1, b"aaaa", ("A",))
    cache.put("b", 1, b"bbbb", ("B",))
    assert cache.get("a", 1, b"aaaa") == ("A",)  # (now the most recent)
    cache.put("c", 1, b"cccc", ("C",))  # past the bytes allowed: the least recent goes
    assert cache.get("b", 1, b"bbbb") is None
    assert cache.get("a", 1, b"aaaa") == ("A",) and cache.get("c", 1, b"cccc") == ("C",)
    cache.put("d", 1, b"d" * 4, ("D",) * 3)  # more than the whole cache: not kept
    assert cache.get("d", 1, b"d" * 4) is None
    assert cache.get("a", 2, b"aaaa") is None  # another data length: another key


def test_headers_that_change_every_time_are_not_piled_up(tmp_path: Path) -> None:
    """A job whose headers differ on every push (a step number, other shapes) keeps the
    headers of the last two checkpoints read, not of every one."""
    for step in range(6):
        read_checkpoint(write_real_checkpoint(tmp_path / f"step{step}", shards(1, rows=8 + step)))
    assert len(HEADERS) == 2 * 3  # (3 files a checkpoint)
    # ... and the last one's still come back as they were.
    again = read_checkpoint(write_real_checkpoint(tmp_path / "again", shards(2, rows=13)))
    last = read_checkpoint(tmp_path / "step5")
    assert all(x is y for x, y in zip(again.tensors, last.tensors, strict=True))


def test_last_result_is_made_again_only_for_another_key() -> None:
    made: list[int] = []
    last: LastResult[list[int]] = LastResult()

    def make(n: int) -> list[int]:
        made.append(n)
        return [n]

    first = last.get((1, "x"), lambda: make(1))
    assert last.get((1, "x"), lambda: make(1)) is first
    assert last.get((2, "x"), lambda: make(2)) == [2]
    assert last.get((1, "x"), lambda: make(1)) is not first  # only the last key is kept
    assert made == [1, 2, 1]

"""A forged metas file (re-signed, so its checksum holds) with numbers beyond torch's int64
sizes: refused with one line and exit 3, with the safetensors header parser's bounds. torch
counts elements in int64: a shape of three 2^62 dimensions wrapped to 0 bytes and was accepted,
[2^63] ended in `internal error: ValueError: Overflow`, a buffer of 2^100 bytes was accepted."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_engine.data_types import ParameterMeta
from cli_run import invoke
from conftest import assert_failure_document
from metas_samples import owner, rewrite, small_metas, write_small_metas

from ckptctl.errors import InvalidInput
from ckptctl.metas import read_metas_file

INT64 = 2**63 - 1


def _buffer(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["metas"]["1"]["memory_buffer_metas_list"][0]


def _lm_head(doc: dict[str, Any]) -> dict[str, Any]:
    return _buffer(doc)["metas"][0]


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: _lm_head(d).update(shape=[2**62] * 3), "has shape .* beyond"),
        (lambda d: _lm_head(d).update(shape=[2**63]), "has shape .* beyond"),
        (lambda d: _lm_head(d).update(shape=[0, 2**62, 2**62]), "has shape .* beyond"),
        (lambda d: _lm_head(d).update(shape=[-(2**63)]), "has shape .* beyond"),
        (lambda d: _lm_head(d).update(shape=[2**62, 2]), "has shape .* beyond"),
        # 2^62 bfloat16 elements are 2^63 bytes: one more than int64 holds.
        (lambda d: _lm_head(d).update(shape=[2**62]), f"needs {2**63} bytes, beyond {INT64}"),
        (lambda d: _buffer(d).update(size=2**100), f"buffer 0: size {2**100} is beyond"),
        (lambda d: _buffer(d).update(size=2**63), f"buffer 0: size {2**63} is beyond"),
        (lambda d: _buffer(d).update(ptr=2**100), "buffer 0: ptr .* is beyond"),
        (lambda d: _lm_head(d).update(aligned_size=2**64), "aligned_size .* is beyond"),
    ],
)
def test_numbers_beyond_int64_are_refused(tmp_path: Path, mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    path = write_small_metas(tmp_path)
    rewrite(path, mutate)
    with pytest.raises(InvalidInput, match=message):
        read_metas_file(path)


def test_the_largest_sizes_are_read_exactly(tmp_path: Path) -> None:
    """At the bound: 2^62 one-byte elements in a buffer of int64's largest size, counted
    without wrapping by the reader and by `inspect-metas`."""
    path = write_small_metas(tmp_path)

    def largest(doc: dict[str, Any]) -> None:
        _lm_head(doc).update(dtype="torch.uint8", shape=[2**31, 2**31], aligned_size=2**62)
        _buffer(doc).update(size=INT64)

    rewrite(path, largest)
    got = read_metas_file(path).metas[1].memory_buffer_metas_list[0]
    assert got.size == INT64 and got.metas[0].shape == torch.Size([2**31, 2**31])
    r = invoke("inspect-metas", str(path), "--json")
    assert r.exit_code == 0, r.stderr
    rank1 = json.loads(r.stdout)["ranks"][1]
    assert rank1["bytes"] == 2**62 + 1 + 32  # lm_head, the fp8 scalar, 8 float32s
    assert rank1["buffer_bytes"] == INT64 + 256


def test_the_cli_says_one_line_and_exits_3(tmp_path: Path) -> None:
    path = write_small_metas(tmp_path)
    rewrite(path, lambda d: _lm_head(d).update(shape=[2**63]))
    r = invoke("inspect-metas", str(path), "--json")
    assert r.exit_code == 3, r.stderr
    doc = assert_failure_document(r.stdout, 3)
    assert "beyond" in doc["error"] and "internal error" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_legacy_pickle_is_held_to_the_same_bounds(tmp_path: Path) -> None:
    metas = small_metas()
    forged = ParameterMeta(
        name="w", dtype=torch.bfloat16, shape=torch.Size([2**62] * 3), aligned_size=256
    )
    metas[2] = owner([forged], 2)
    path = tmp_path / "metas.pkl"
    path.write_bytes(pickle.dumps(metas))
    with pytest.raises(InvalidInput, match="rank 2 buffer 0: 'w' has shape .* beyond"):
        read_metas_file(path, allow_pickle=True)

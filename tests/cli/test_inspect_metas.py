"""`ckptctl inspect-metas`: summary, --json fields of the CLI contract, and checkpoint checks."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from cli_run import invoke, run_script
from conftest import assert_failure_document
from metas_samples import (
    every_dtype_metas,
    owner,
    param,
    rewrite,
    small_metas,
    write_small_metas,
)
from safetensors.torch import save_file

from ckptctl.metas import CheckpointTensor, compare_with_checkpoint, write_metas_file


@pytest.fixture
def metas_file(tmp_path: Path) -> Path:
    return write_small_metas(tmp_path)


def _checkpoint(tmp_path: Path) -> Path:
    """A two-file checkpoint holding exactly the tensors small_metas() describes."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(
        {"embed.weight": torch.zeros(16, 8, dtype=torch.bfloat16)},
        str(ckpt / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {
            "lm_head.weight": torch.zeros(16, 8, dtype=torch.bfloat16),
            "layer.scale": torch.zeros((), dtype=torch.float8_e4m3fn),
            "layer.norm": torch.zeros(8, dtype=torch.float32),
        },
        str(ckpt / "model-00002-of-00002.safetensors"),
    )
    return ckpt


def test_json_has_the_contract_fields(metas_file: Path) -> None:
    result = invoke("inspect-metas", str(metas_file), "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)  # exactly one document
    assert doc["checkpoint_name"] == "ck-iter-7"
    assert doc["world_size"] == 2
    assert doc["total_parameters"] == 4
    # real bytes: 16*8*2 + 16*8*2 + 1 + 8*4
    assert doc["total_bytes"] == 256 + 256 + 1 + 32
    assert [(r["rank"], r["parameters"], r["bytes"]) for r in doc["ranks"]] == [
        (0, 1, 256),
        (1, 3, 256 + 1 + 32),
    ]
    # extras
    assert doc["ranks"][1]["buffers"] == 2 and doc["ranks"][1]["rdma_device"] == "mlx5_1"
    assert doc["ranks"][1]["buffer_bytes"] == 3 * 256  # aligned to 256 per tensor
    assert doc["p2p_ready"] is True and doc["legacy_pickle"] is False
    assert doc["dtypes"][0] == {"dtype": "torch.bfloat16", "parameters": 2, "bytes": 512}
    assert doc["largest_tensors"][-1]["name"] == "layer.scale"
    assert doc["largest_tensors"][-1]["shape"] == []


def test_human_summary(metas_file: Path) -> None:
    result = invoke("inspect-metas", str(metas_file))
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    for text in ("ck-iter-7", "world size 2", "10.0.0.0:17001", "mlx5_1", "torch.float8_e4m3fn"):
        assert text in out
    assert "lm_head.weight" in out and "total" in out
    assert result.stderr == ""


def test_many_ranks_and_every_dtype(tmp_path: Path) -> None:
    path = tmp_path / "big.json"
    metas = every_dtype_metas(world_size=64)
    write_metas_file(path, metas, checkpoint_name="big", world_size=64)
    doc = json.loads(invoke("inspect-metas", str(path), "--json").stdout)
    assert [r["rank"] for r in doc["ranks"]] == sorted(metas)
    assert doc["total_parameters"] == sum(r["parameters"] for r in doc["ranks"])
    assert len(doc["largest_tensors"]) == 10
    sizes = [t["bytes"] for t in doc["largest_tensors"]]
    assert sizes == sorted(sizes, reverse=True)


def test_legacy_pickle_needs_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "metas.pkl"
    path.write_bytes(pickle.dumps(small_metas()))
    refused = invoke("inspect-metas", str(path))
    assert refused.exit_code == 3 and "--allow-pickle" in refused.stderr
    result = invoke("inspect-metas", str(path), "--allow-pickle", "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["legacy_pickle"] is True and doc["checkpoint_name"] is None
    assert doc["total_parameters"] == 4
    assert "legacy pickle" in result.stderr  # the warning goes to stderr, not into the JSON


def test_matches_its_checkpoint(tmp_path: Path, metas_file: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    result = invoke("inspect-metas", str(metas_file), "--checkpoint-path", str(ckpt), "--json")
    assert result.exit_code == 0, result.stderr
    check = json.loads(result.stdout)["check"]
    assert check == {"checkpoint_path": str(ckpt), "ok": True, "differences": []}
    human = invoke("inspect-metas", str(metas_file), "--checkpoint-path", str(ckpt))
    assert human.exit_code == 0 and "matches" in human.stdout


def test_differences_from_a_checkpoint_are_exit_1(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path)
    metas = {
        0: owner(
            [
                param("embed.weight", torch.float16, (16, 8)),  # dtype differs
                param("lm_head.weight", torch.bfloat16, (8, 16)),  # shape differs
                param("layer.norm", torch.float32, (8,)),  # same
                param("extra.bias", torch.float32, (8,)),  # not in the checkpoint
            ],
            0,
        ),
        1: owner([param("layer.norm", torch.float32, (8,))], 1),  # held twice
    }  # layer.scale: missing
    path = tmp_path / "m.json"
    write_metas_file(path, metas, checkpoint_name="ck", world_size=2)

    result = invoke("inspect-metas", str(path), "--checkpoint-path", str(ckpt), "--json")
    assert result.exit_code == 1
    assert "4 difference" not in result.stderr and "5 difference(s)" in result.stderr
    diffs = json.loads(result.stdout)["check"]["differences"]
    assert sorted((d["kind"], d["name"]) for d in diffs) == [
        ("dtype", "embed.weight"),
        ("duplicate_in_metas", "layer.norm"),
        ("missing_in_metas", "layer.scale"),
        ("not_in_checkpoint", "extra.bias"),
        ("shape", "lm_head.weight"),
    ]
    dtype_diff = next(d for d in diffs if d["kind"] == "dtype")
    assert (dtype_diff["metas"], dtype_diff["checkpoint"]) == ("F16", "BF16")

    human = invoke("inspect-metas", str(path), "--checkpoint-path", str(ckpt))
    assert human.exit_code == 1
    assert "embed.weight: dtype F16 in the metas, BF16 in the checkpoint" in human.stdout
    assert "layer.scale: in the checkpoint, not in the metas" in human.stdout


def test_size_difference_from_header_offsets() -> None:
    # Only a header whose offsets contradict its dtype and shape yields a size difference.
    metas = {0: owner([param("w", torch.bfloat16, (4, 4))], 0)}
    same = [CheckpointTensor("w", "BF16", (4, 4), 32)]
    assert compare_with_checkpoint(metas, same) == []
    (diff,) = compare_with_checkpoint(metas, [CheckpointTensor("w", "BF16", (4, 4), 30)])
    assert (diff.kind, diff.metas, diff.checkpoint) == ("size", "32 bytes", "30 bytes")


def test_missing_checkpoint_is_invalid_input(tmp_path: Path, metas_file: Path) -> None:
    missing = tmp_path / "no"
    result = invoke("inspect-metas", str(metas_file), "--checkpoint-path", str(missing))
    assert result.exit_code == 3
    assert result.stderr.startswith("error: ") and str(missing) in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_text(p.read_text()[:300]), "is truncated"),
        (lambda p: p.write_text('{"weight_map": {}}'), "not a ckptctl metas file"),
        (lambda p: rewrite(p, lambda d: d.update(world_size=7), fix_checksum=False), "checksum"),
        (lambda p: rewrite(p, lambda d: d.update(format_version=9)), "version 9"),
        (lambda p: p.unlink(), "does not exist"),
    ],
)
def test_bad_files_are_one_line_and_exit_3(metas_file: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    damage(metas_file)
    result = invoke("inspect-metas", str(metas_file), "--json")
    assert result.exit_code == 3
    assert message in assert_failure_document(result.stdout, 3)["error"]
    assert result.stderr.count("\n") == 1 and message in result.stderr


def test_installed_script(tmp_path: Path, metas_file: Path) -> None:
    ok = run_script("inspect-metas", str(metas_file), "--json")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["world_size"] == 2
    metas_file.write_text(metas_file.read_text()[:-40])
    bad = run_script("inspect-metas", str(metas_file))
    assert bad.returncode == 3 and bad.stdout == ""
    assert bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
    usage = run_script("inspect-metas")
    assert usage.returncode == 2  # the FILE argument is required


def test_names_are_printed_literally_not_as_markup(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    metas = {0: owner([param("w[red]x[/red]", torch.float32, (4,))], 0)}
    write_metas_file(path, metas, checkpoint_name="[bold]ck", world_size=1)
    result = invoke("inspect-metas", str(path))
    assert result.exit_code == 0
    assert "w[red]x[/red]" in result.stdout and "[bold]ck" in result.stdout

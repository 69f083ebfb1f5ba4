"""layout_change: whether a checkpoint has the tensors a server holds (issue 23 item 7)."""

from __future__ import annotations

from pathlib import Path

from ckpt_factory import write_sparse_checkpoint

from ckptctl.checkpoint import TensorInfo, read_checkpoint
from ckptctl.checkpoint.layout import layout_change


def t(name: str, dtype: str = "BF16", *shape: int, file: str = "a.safetensors") -> TensorInfo:
    return TensorInfo(name, dtype, tuple(shape), file, 0, 0)


SERVED = (t("embed", "BF16", 8, 4), t("w1", "BF16", 4, 4), t("w2", "F32", 4), t("norm", "F32"))


def test_the_same_tensors_in_other_files_and_order_are_no_change() -> None:
    moved = tuple(reversed([x._replace(file="b.safetensors", start=9) for x in SERVED]))
    assert layout_change(SERVED, moved) is None
    assert layout_change((), ()) is None


def test_another_shape_names_the_tensor_and_both_shapes() -> None:
    new = (t("embed", "BF16", 9, 4), *SERVED[1:])
    assert layout_change(SERVED, new) == "embed: BF16 [9, 4] here, BF16 [8, 4] served"


def test_another_dtype_a_new_and_a_missing_tensor_are_each_named() -> None:
    new = (SERVED[0], t("w1", "F16", 4, 4), t("extra", "F32", 2), SERVED[3])
    assert layout_change(SERVED, new) == (
        "w1: F16 [4, 4] here, BF16 [4, 4] served; extra: new here (not served); "
        "w2: missing here (served)"
    )


def test_a_0_dim_tensor_that_grew_a_dimension() -> None:
    new = (*SERVED[:3], t("norm", "F32", 1))
    assert layout_change(SERVED, new) == "norm: F32 [1] here, F32 [] served"


def test_past_three_differences_the_rest_are_counted_by_kind() -> None:
    served = tuple(t(f"layer.{i}", "BF16", 4) for i in range(10))
    new = tuple(t(f"layer.{i}", "BF16", 8) for i in range(6)) + (t("layer.6", "F32", 4),)
    change = layout_change(served, new)
    assert change is not None
    named, rest = change.split("; and ")
    assert named == (
        "layer.0: BF16 [8] here, BF16 [4] served; layer.1: BF16 [8] here, BF16 [4] served; "
        "layer.2: BF16 [8] here, BF16 [4] served"
    )
    assert rest == "7 more (10 differ: 6 another shape, 1 another dtype, 3 missing)"


def test_real_checkpoints_sharded_differently_have_one_layout(tmp_path: Path) -> None:
    specs = [(f"model.layers.{i}.weight", "BF16", (64, 32)) for i in range(6)]
    one = read_checkpoint(write_sparse_checkpoint(tmp_path / "one", specs))
    many = read_checkpoint(write_sparse_checkpoint(tmp_path / "many", specs, shard_bytes=8192))
    assert len(many.files) > 1
    assert layout_change(one.tensors, many.tensors) is None
    wider = [*specs[:5], ("model.layers.5.weight", "BF16", (64, 64))]
    other = read_checkpoint(write_sparse_checkpoint(tmp_path / "wider", wider))
    assert layout_change(one.tensors, other.tensors) == (
        "model.layers.5.weight: BF16 [64, 64] here, BF16 [64, 32] served"
    )

"""Regenerate examples/tiny-checkpoint: a real, tiny, sharded safetensors checkpoint.

    python examples/make_tiny_checkpoint.py            # writes examples/tiny-checkpoint/
    ckptctl update --dry-run --checkpoint-path examples/tiny-checkpoint --world-size 2

Three shards plus model.safetensors.index.json, in HF layout, with mixed dtypes (bf16, fp32,
fp8 e4m3, int64, bool, a 0-dim scale). The output is byte-for-byte the same on every run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch  # noqa: TID253 - a standalone script, not the CLI
from safetensors.torch import save_file  # noqa: TID253

HIDDEN, VOCAB, INTER, LAYERS = 32, 256, 64, 2
MAX_SHARD_BYTES = 24_000


def tiny_model() -> dict[str, torch.Tensor]:
    """A two-layer toy transformer's weights, in the order a model stores them."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": randn(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}.self_attn.{proj}.weight"] = randn(HIDDEN, HIDDEN)
        for proj, shape in (("gate_proj", (INTER, HIDDEN)), ("down_proj", (HIDDEN, INTER))):
            tensors[f"{p}.mlp.{proj}.weight"] = randn(*shape, dtype=torch.float8_e4m3fn)
            tensors[f"{p}.mlp.{proj}.weight_scale"] = torch.tensor(0.5 + i)  # 0-dim fp32
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(HIDDEN)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(HIDDEN)
    tensors["model.rotary_emb.position_ids"] = torch.arange(64, dtype=torch.int64)
    tensors["model.causal_mask"] = torch.ones(16, 16, dtype=torch.bool).tril()
    tensors["model.norm.weight"] = torch.ones(HIDDEN)
    tensors["lm_head.weight"] = randn(VOCAB, HIDDEN)
    return tensors


def write(out: Path) -> None:
    tensors = tiny_model()
    # HF sharding: in model order, start a new shard when the next tensor would not fit.
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    print(f"wrote {len(tensors)} tensors, {total} bytes, in {len(shards)} shards to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "tiny-checkpoint"
    )
    write(parser.parse_args().out)

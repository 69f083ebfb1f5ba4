"""Tensor names, dtypes and shapes of real models (from their HF config.json), in the order
their HF checkpoints store them. Used to write sparse checkpoints of the real size."""

from __future__ import annotations

from collections.abc import Iterator

Spec = tuple[str, str, tuple[int, ...]]  # (name, safetensors dtype, shape)


def qwen3_8b() -> Iterator[Spec]:
    """Qwen3-8B: 36 layers, hidden 4096, 32 heads / 8 KV heads of 128, intermediate 12288,
    vocab 151936, untied lm_head. 399 tensors, 16.38 GB in bf16."""
    return _qwen3(hidden=4096, inter=12288, tied=False)


def qwen3_32b() -> Iterator[Spec]:
    """Qwen3-32B: 64 layers, hidden 5120, 64 heads / 8 KV heads of 128, intermediate 25600,
    vocab 151936, untied lm_head. 707 tensors, 65.5 GB in bf16."""
    return _qwen3(hidden=5120, inter=25600, tied=False, layers=64, heads=64)


def qwen3_4b() -> Iterator[Spec]:
    """Qwen3-4B: 36 layers, hidden 2560, 32 heads / 8 KV heads of 128, intermediate 9728,
    vocab 151936, tied embeddings (no lm_head). 398 tensors, 8.04 GB in bf16."""
    return _qwen3(hidden=2560, inter=9728, tied=True)


def qwen3_0_6b() -> Iterator[Spec]:
    """Qwen3-0.6B: 28 layers, hidden 1024, 16 heads / 8 KV heads of 128, intermediate 3072,
    vocab 151936, tied embeddings. 310 tensors, 1.19 GB in bf16 (a soak of many pushes)."""
    return _qwen3(hidden=1024, inter=3072, tied=True, layers=28, heads=16)


def _qwen3(
    *, hidden: int, inter: int, tied: bool, layers: int = 36, heads: int = 32
) -> Iterator[Spec]:
    vocab, head_dim, kv_heads = 151936, 128, 8
    yield "model.embed_tokens.weight", "BF16", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}"
        yield f"{p}.self_attn.q_proj.weight", "BF16", (heads * head_dim, hidden)
        yield f"{p}.self_attn.k_proj.weight", "BF16", (kv_heads * head_dim, hidden)
        yield f"{p}.self_attn.v_proj.weight", "BF16", (kv_heads * head_dim, hidden)
        yield f"{p}.self_attn.o_proj.weight", "BF16", (hidden, heads * head_dim)
        yield f"{p}.self_attn.q_norm.weight", "BF16", (head_dim,)
        yield f"{p}.self_attn.k_norm.weight", "BF16", (head_dim,)
        yield f"{p}.mlp.gate_proj.weight", "BF16", (inter, hidden)
        yield f"{p}.mlp.up_proj.weight", "BF16", (inter, hidden)
        yield f"{p}.mlp.down_proj.weight", "BF16", (hidden, inter)
        yield f"{p}.input_layernorm.weight", "BF16", (hidden,)
        yield f"{p}.post_attention_layernorm.weight", "BF16", (hidden,)
    yield "model.norm.weight", "BF16", (hidden,)
    if not tied:
        yield "lm_head.weight", "BF16", (vocab, hidden)


def _fp8_linear(name: str, out_dim: int, in_dim: int) -> Iterator[Spec]:
    # DeepSeek-V3's FP8 linears carry one F32 scale per 128x128 block.
    yield f"{name}.weight", "F8_E4M3", (out_dim, in_dim)
    yield f"{name}.weight_scale_inv", "F32", (-(-out_dim // 128), -(-in_dim // 128))


def deepseek_v3() -> Iterator[Spec]:
    """DeepSeek-V3 (FP8): 61 layers (3 dense, 58 MoE with 256 routed + 1 shared expert) plus the
    MTP layer 61; MLA attention. About 92k tensors and 680 GB."""
    return _deepseek_v3(
        hidden=7168, vocab=129280, dense_inter=18432, moe_inter=2048, q_lora=1536, heads=128
    )


def deepseek_v3_small() -> Iterator[Spec]:
    """DeepSeek-V3's layout at small widths: its 61 layers (3 dense), 256 routed + 1 shared
    experts, MLA projections, FP8 E4M3 weights each with an F32 `weight_scale_inv` of 128x128
    blocks, no MTP layer. 90,427 tensors, 3.09 GB: many tensors, few bytes (issue 16)."""
    return _deepseek_v3(
        hidden=512, vocab=129280, dense_inter=1280, moe_inter=112, q_lora=128, heads=16, mtp=False
    )


def _deepseek_v3(
    *,
    hidden: int,
    vocab: int,
    dense_inter: int,
    moe_inter: int,
    q_lora: int,
    heads: int,
    mtp: bool = True,
) -> Iterator[Spec]:
    experts, kv_lora, nope, rope, v_dim = 256, 512, 128, 64, 128

    def layer(i: int) -> Iterator[Spec]:
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", "BF16", (hidden,)
        yield from _fp8_linear(f"{p}.self_attn.q_a_proj", q_lora, hidden)
        yield f"{p}.self_attn.q_a_layernorm.weight", "BF16", (q_lora,)
        yield from _fp8_linear(f"{p}.self_attn.q_b_proj", heads * (nope + rope), q_lora)
        yield from _fp8_linear(f"{p}.self_attn.kv_a_proj_with_mqa", kv_lora + rope, hidden)
        yield f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (kv_lora,)
        yield from _fp8_linear(f"{p}.self_attn.kv_b_proj", heads * (nope + v_dim), kv_lora)
        yield from _fp8_linear(f"{p}.self_attn.o_proj", hidden, heads * v_dim)
        yield f"{p}.post_attention_layernorm.weight", "BF16", (hidden,)
        if i < 3:
            for proj, (o, n) in _mlp(dense_inter, hidden).items():
                yield from _fp8_linear(f"{p}.mlp.{proj}", o, n)
            return
        yield f"{p}.mlp.gate.weight", "BF16", (experts, hidden)
        yield f"{p}.mlp.gate.e_score_correction_bias", "F32", (experts,)
        for e in range(experts):
            for proj, (o, n) in _mlp(moe_inter, hidden).items():
                yield from _fp8_linear(f"{p}.mlp.experts.{e}.{proj}", o, n)
        for proj, (o, n) in _mlp(moe_inter, hidden).items():
            yield from _fp8_linear(f"{p}.mlp.shared_experts.{proj}", o, n)

    yield "model.embed_tokens.weight", "BF16", (vocab, hidden)
    for i in range(61):
        yield from layer(i)
    yield "model.norm.weight", "BF16", (hidden,)
    yield "lm_head.weight", "BF16", (vocab, hidden)
    if not mtp:
        return
    # Multi-token prediction module, stored as layer 61.
    yield from layer(61)
    yield "model.layers.61.embed_tokens.weight", "BF16", (vocab, hidden)
    yield "model.layers.61.enorm.weight", "BF16", (hidden,)
    yield "model.layers.61.hnorm.weight", "BF16", (hidden,)
    yield "model.layers.61.eh_proj.weight", "BF16", (hidden, 2 * hidden)
    yield "model.layers.61.shared_head.norm.weight", "BF16", (hidden,)
    yield "model.layers.61.shared_head.head.weight", "BF16", (vocab, hidden)


def _mlp(inter: int, hidden: int) -> dict[str, tuple[int, int]]:
    return {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }

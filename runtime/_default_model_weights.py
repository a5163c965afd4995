"""The demo model's architecture and weights: a tiny ``Qwen3_5MoeForCausalLM`` config, the
shape of every checkpoint tensor under its Hugging Face name, and seeded random values for them.

``runtime.default_model`` writes ``model_config`` to ``config.json`` and ``random_weights`` to
``model.safetensors``; the same seed gives the same tensors on every machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["MAX_LEN", "model_config", "random_weights", "weight_shapes"]

_SEED = 20250601
# The context length, in config.json and as the tokenizer's model_max_length.
MAX_LEN = 8192


def model_config(vocab_size: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """A text-only Qwen3.5-MoE config, in the form transformers itself saves."""
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAX_LEN,
        # 16 of the 64 head dims rotate; M-RoPE sections sum to 16 / 2 (plain RoPE for text).
        "partial_rotary_factor": 0.25,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
    }


def weight_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint under its Hugging Face name (experts one by one)."""
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    num_heads, num_kv_heads, head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    num_v_heads = c["linear_num_value_heads"]
    value_dim = num_v_heads * c["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    inter, shared = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if kind == "full_attention":
            # q_proj also produces the output gate: [q | gate] per head.
            shapes[p + "self_attn.q_proj.weight"] = (2 * num_heads * head_dim, hidden)
            shapes[p + "self_attn.k_proj.weight"] = (num_kv_heads * head_dim, hidden)
            shapes[p + "self_attn.v_proj.weight"] = (num_kv_heads * head_dim, hidden)
            shapes[p + "self_attn.o_proj.weight"] = (hidden, num_heads * head_dim)
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        else:
            shapes[p + "linear_attn.in_proj_qkv.weight"] = (conv_dim, hidden)
            shapes[p + "linear_attn.in_proj_z.weight"] = (value_dim, hidden)
            shapes[p + "linear_attn.in_proj_b.weight"] = (num_v_heads, hidden)
            shapes[p + "linear_attn.in_proj_a.weight"] = (num_v_heads, hidden)
            shapes[p + "linear_attn.conv1d.weight"] = (conv_dim, 1, c["linear_conv_kernel_dim"])
            shapes[p + "linear_attn.A_log"] = (num_v_heads,)
            shapes[p + "linear_attn.dt_bias"] = (num_v_heads,)
            shapes[p + "linear_attn.norm.weight"] = (c["linear_value_head_dim"],)
            shapes[p + "linear_attn.out_proj.weight"] = (hidden, value_dim)
        shapes[p + "mlp.gate.weight"] = (c["num_experts"], hidden)
        for e in range(c["num_experts"]):
            shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (inter, hidden)
            shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (inter, hidden)
            shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (hidden, inter)
        shapes[p + "mlp.shared_expert.gate_proj.weight"] = (shared, hidden)
        shapes[p + "mlp.shared_expert.up_proj.weight"] = (shared, hidden)
        shapes[p + "mlp.shared_expert.down_proj.weight"] = (hidden, shared)
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, hidden)
    return shapes


def random_weights(config: dict[str, Any], advance: Callable[[int], None]) -> dict[str, torch.Tensor]:
    """Seeded weights of a scale that keeps activations O(1) and next-token logits far from uniform.

    (Hugging Face's init, std 0.02 with zero norms, gives near-uniform logits: greedy output would
    then hinge on rounding noise and differ between implementations.)
    """
    gen = torch.Generator().manual_seed(_SEED)

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    weights: dict[str, torch.Tensor] = {}
    for name, shape in sorted(weight_shapes(config).items()):
        if name.endswith("A_log"):
            weights[name] = torch.empty(shape).uniform_(0.05, 8.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            weights[name] = normal(shape, 0.2, 1.0)
        elif name.endswith("linear_attn.norm.weight"):
            # A plain scale; every other norm weight is zero-centred (scale 1 + w).
            weights[name] = normal(shape, 0.1, 1.0)
        elif name.endswith("norm.weight"):
            weights[name] = normal(shape, 0.1)
        elif name.endswith("conv1d.weight"):
            weights[name] = normal(shape, 0.5)
        elif name == "model.embed_tokens.weight":
            weights[name] = normal(shape, 1.0)
        elif name == "lm_head.weight":
            weights[name] = normal(shape, 3.0 / math.sqrt(shape[-1]))
        else:
            # Linear [out, in]: unit gain on fan-in.
            weights[name] = normal(shape, 1.0 / math.sqrt(shape[-1]))
        advance(1)
    return weights

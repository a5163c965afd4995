"""Hugging Face ``config.json`` contents of the real model shapes we benchmark with dummy weights.

``qwen3.5-35b-a3b`` is exactly transformers' ``Qwen3_5MoeTextConfig()`` defaults (34.66 B
parameters, 2.946 B active per token). ``qwen3.5-397b-a17b``, ``qwen3-next-80b-a3b`` and
``qwen3.5-27b`` (dense) carry the published checkpoints' text-model values (layers, widths, heads,
experts, vocabulary); ``phloem estimate`` sizes their memory (docs/models.md). ``tiny`` is a
small shape of the 35B-A3B's architecture for CPU runs of the benchmarks. Every shape's vocabulary covers the demo
tokenizer's (1,920 ids), which ``phloem serve --shape`` serves it with, so text prompts work.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["SHAPES", "ensure_shape_model", "write_shape"]


def _qwen35_moe(**overrides: Any) -> dict[str, Any]:
    text: dict[str, Any] = {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1048576,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "eos_token_id": 248044,
    }
    text.update(overrides)
    return text


def _qwen35_dense() -> dict[str, Any]:
    text = _qwen35_moe(
        architectures=["Qwen3_5ForCausalLM"],
        model_type="qwen3_5_text",
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_value_heads=48,
        intermediate_size=17408,
        max_position_embeddings=262144,
    )
    for moe_key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        del text[moe_key]
    return text


SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.5-35b-a3b": _qwen35_moe(),
    "qwen3.5-397b-a17b": _qwen35_moe(
        hidden_size=4096,
        num_hidden_layers=60,
        num_attention_heads=32,
        linear_num_value_heads=64,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
        max_position_embeddings=262144,
    ),
    "qwen3-next-80b-a3b": _qwen35_moe(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        vocab_size=151936,
        num_hidden_layers=48,
        num_experts=512,
        num_experts_per_tok=10,
        max_position_embeddings=262144,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        eos_token_id=151645,
    ),
    "qwen3.5-27b": _qwen35_dense(),
    "tiny": _qwen35_moe(
        vocab_size=2048,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        max_position_embeddings=65536,
        eos_token_id=1,
    ),
}


def write_shape(name: str, folder: Path) -> Path:
    """Write ``config.json`` of shape ``name`` into ``folder`` (for ``load_format="dummy"``)."""
    if name not in SHAPES:
        raise ValueError(f"shape: expected one of {sorted(SHAPES)}, got {name!r}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    return folder


def ensure_shape_model(name: str, data_dir: Path) -> Path:
    """A servable folder for shape ``name``: its ``config.json`` and the demo model's tokenizer.

    For ``phloem serve --shape`` (dummy weights). The demo tokenizer's vocabulary fits in the
    shape's, so every text prompt encodes to valid ids; sampled ids beyond the tokenizer's
    decode to nothing (benchmarks send token ids and read ``token_ids``).

    Raises:
        ValueError: ``name`` is not a known shape.
        OSError: ``data_dir`` cannot be written.
    """
    from phloem.runtime.default_model import ensure_default_model

    folder = write_shape(name, data_dir / "shapes" / name)
    tokenizer_dir = ensure_default_model(data_dir)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (folder / file).write_bytes((tokenizer_dir / file).read_bytes())
    return folder

"""The model trained by ``train.py``: transformers' ``Qwen3_5MoeForCausalLM`` plus one MTP layer.

The MTP layer is laid out as Qwen3.5 / Qwen3-Next checkpoints store it (``mtp.*``), and computes
what vLLM's ``Qwen3NextMultiTokenPredictor`` computes::

    x = mtp.fc(cat(mtp.pre_fc_norm_embedding(embed(token[t+1])), mtp.pre_fc_norm_hidden(h[t])))
    x = mtp.layers.0(x)              # a gated full-attention decoder layer with the sparse MoE
    h'[t] = mtp.norm(x)              # logits = lm_head(h'[t]) predict token[t+2]

``h[t]`` is the trunk's last hidden state (after ``model.norm``), ``embed_tokens`` and ``lm_head``
are the trunk's own. One more step of its own recursion feeds ``h'[t]`` back as ``h`` with the
token it predicted.

Presets (``PRESETS``) are the real Qwen3.5-MoE layer pattern at the real head dims (attention
head_dim 256 with a quarter of it rotated, GDN key/value head dim 128), small elsewhere.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

# transformers must take its torch fallbacks for GDN, never flash-linear-attention's GPU kernels.
if not torch.cuda.is_available():
    sys.modules.setdefault("fla", None)  # type: ignore[arg-type]

from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (  # noqa: E402
    Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm,
)

MAX_LEN = 8192

PRESETS: dict[str, dict[str, Any]] = {
    # 4.2M parameters, 16.9 MB in fp32: trains on one CPU thread in minutes.
    "cpu": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                linear_num_key_heads=1, linear_num_value_heads=2, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=128, shared_expert_intermediate_size=128, dtype="float32",
                seq_len=256, batch_size=8, lr=3e-3),
    # 12.2M parameters, 24.3 MB in bf16: the size meant for <= 15 minutes on one H200 (not yet run).
    "gpu": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=1,
                linear_num_key_heads=2, linear_num_value_heads=4, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=64, shared_expert_intermediate_size=64, dtype="bfloat16",
                seq_len=512, batch_size=64, lr=2e-3),
}
_TRAINING_KEYS = ("dtype", "seq_len", "batch_size", "lr")


def model_config(preset: str, vocab_size: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """``config.json`` for ``preset``, in the form transformers saves a text-only Qwen3.5-MoE."""
    p = {k: v for k, v in PRESETS[preset].items() if k not in _TRAINING_KEYS}
    layers = p["num_hidden_layers"]
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "dtype": PRESETS[preset]["dtype"],
        "vocab_size": vocab_size,
        **p,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "head_dim": 256,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": MAX_LEN,
        # 64 of the 256 head dims rotate; the M-RoPE sections sum to 64 / 2 (plain RoPE for text).
        "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "use_cache": True,
    }


def hf_config(config: dict[str, Any]) -> Qwen3_5MoeTextConfig:
    c = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return Qwen3_5MoeTextConfig(**c)


class MTP(nn.Module):
    """One multi-token-prediction layer; its parameter names are the checkpoint's after ``mtp.``."""

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # A full-attention layer: borrow the index of a trunk layer of that type (it only names a
        # cache slot, which training and evaluation do not use).
        full = config.layer_types.index("full_attention")
        self.layers = nn.ModuleList([Qwen3_5MoeDecoderLayer(config, full)])
        self.norm = Qwen3_5MoeRMSNorm(hidden, eps=eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)
        x = self.fc(x)
        # attention_mask None: causal attention over the sequence (sdpa's is_causal).
        x = self.layers[0](x, position_embeddings=position_embeddings, attention_mask=None)
        return self.norm(x)


def build(config: dict[str, Any]) -> tuple[Qwen3_5MoeForCausalLM, MTP]:
    cfg = hf_config(config)
    cfg._attn_implementation = "sdpa"
    model = Qwen3_5MoeForCausalLM(cfg)
    mtp = MTP(cfg)
    # The decoder layer's own init (the model's _init_weights) for the MTP layer's norms and GDN-free
    # parts: zero-centred norms start at zero (scale 1), linears normal(0, 0.02).
    for name, p in mtp.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.zero_()
            else:
                p.normal_(0.0, cfg.initializer_range)
    return model, mtp


def position_embeddings(model: Qwen3_5MoeForCausalLM, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE cos/sin for positions 0..T-1 (text positions: the same on all three M-RoPE axes)."""
    b, t = hidden.shape[:2]
    pos = torch.arange(t, device=hidden.device).view(1, 1, -1).expand(3, b, -1)
    return model.model.rotary_emb(hidden, pos)


def mtp_step(model: Qwen3_5MoeForCausalLM, mtp: MTP, tokens: torch.Tensor, hidden: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP step: ``tokens[:, t]`` is the token after the one ``hidden[:, t]`` predicted from.
    Returns (the MTP hidden state, its logits)."""
    out = mtp(model.model.embed_tokens(tokens), hidden, rope)
    return out, model.lm_head(out)


def to_checkpoint(model: Qwen3_5MoeForCausalLM, mtp: MTP, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor under its checkpoint name: experts one by one (as published Qwen3.5
    checkpoints and ``runtime.default_model`` store them), the MTP layer under ``mtp.``."""
    out: dict[str, torch.Tensor] = {}
    items = list(model.state_dict().items()) + [(f"mtp.{k}", v) for k, v in mtp.state_dict().items()]
    for name, tensor in items:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        tensor = tensor.detach().to(dtype).contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :inter].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    return out


def load_mtp(folder: Any, model: Qwen3_5MoeForCausalLM) -> MTP:
    """The ``mtp.*`` tensors of a saved folder, in an ``MTP`` matching ``model``'s config."""
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    mtp = MTP(model.config)
    state: dict[str, torch.Tensor] = {}
    own = mtp.state_dict()
    for name, tensor in weights.items():
        if not name.startswith("mtp."):
            continue
        name = name.removeprefix("mtp.")
        if ".experts." in name and name.split(".experts.")[1][0].isdigit():
            prefix, rest = name.split(".experts.")
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            if proj == "down_proj":
                state.setdefault(f"{prefix}.experts.down_proj", own[f"{prefix}.experts.down_proj"].clone())[e] = tensor
            else:
                gu = state.setdefault(f"{prefix}.experts.gate_up_proj", own[f"{prefix}.experts.gate_up_proj"].clone())
                inter = gu.shape[1] // 2
                gu[e, :inter] = tensor if proj == "gate_proj" else gu[e, :inter]
                gu[e, inter:] = tensor if proj == "up_proj" else gu[e, inter:]
        else:
            state[name] = tensor
    mtp.load_state_dict(state, strict=True)
    return mtp.to(next(model.parameters()).dtype)

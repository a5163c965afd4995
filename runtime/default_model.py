"""The built-in demo model: a tiny ``Qwen3_5MoeForCausalLM`` with RANDOM weights, built on first use.

``phloem serve`` without ``--model`` serves it, so the whole stack (sessions, cache, fork, API)
runs anywhere in seconds with nothing to download. Its output is gibberish by construction.

    data_dir/models/phloem-tiny-qwen3.5/
        config.json            real architecture, tiny shapes (see ``_model_config``)
        model.safetensors      fp32, Hugging Face names, per-expert layout, seeded
        tokenizer.json         byte-level BPE trained here on ``runtime/_corpus.txt``
        tokenizer_config.json  ChatML chat template, eos ``<|im_end|>``
        README.md              says the weights are random

Both ``Engine.from_pretrained`` and transformers' ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained`` read the folder. The build is deterministic (same files every
time), takes well under a second after torch is imported, and is atomic: it happens in a
temporary sibling folder that is renamed into place, so a folder with the final name is always
complete, and two processes racing to build it both end up using one complete copy.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from phloem.runtime.progress import progress_bar

__all__ = ["DEFAULT_MODEL_NAME", "SPECIAL_TOKENS", "ensure_default_model"]

DEFAULT_MODEL_NAME = "phloem-tiny-qwen3.5"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md")
_TARGET_VOCAB = 2000
_SEED = 20250601
_MAX_LEN = 8192

# ChatML as Qwen renders it, with tools in the system turn, <tool_call> JSON in assistant turns
# and tool results as <tool_response> blocks inside one user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- (messages[0].content or '') + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are in <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments in"
    " <tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\":"
    " <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + (messages[0].content or '') + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_README = """# phloem-tiny-qwen3.5

**The weights of this model are random.** It generates gibberish. It exists so that `phloem serve`
and `phloem demo` run anywhere without a download: the architecture (`Qwen3_5MoeForCausalLM`:
3 Gated-DeltaNet layers + 1 gated full-attention layer, 8 experts top-2 + a shared expert) is real,
only tiny, so sessions, the prefix cache, forks and the API behave exactly as with a real model.

The tokenizer is a byte-level BPE trained on a few KB of English (any text round-trips), with the
ChatML special tokens `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (end of turn, the EOS).

Built by `phloem.runtime.default_model.ensure_default_model`; delete this folder to rebuild it.
Serve a real model with `phloem serve --model /path/to/hf-folder`.
"""


def ensure_default_model(data_dir: Path, show_progress: bool | None = None) -> Path:
    """Return the demo model folder under ``data_dir``, building it on first use.

    Args:
        data_dir: The Phloem data directory; the model goes to ``data_dir/models/phloem-tiny-qwen3.5``.
        show_progress: A progress bar while building: False never, None when stderr is a
            terminal (``runtime.progress``).

    Returns:
        The model folder (complete: the build is atomic).

    Raises:
        OSError: ``data_dir`` is not writable, or a non-model folder occupies the name.
    """
    final = Path(data_dir).expanduser() / "models" / DEFAULT_MODEL_NAME
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.", dir=final.parent))
    try:
        _build(build, show_progress)
        try:
            os.rename(build, final)
        except OSError as exc:
            # Lost a race with another process: its copy is as good as ours.
            if not _is_complete(final):
                raise OSError(f"{final} exists but is not a complete demo model; delete it to rebuild") from exc
        _fsync_dir(final.parent)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return final


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _FILES)


def _build(folder: Path, show_progress: bool | None) -> None:
    # The bar's units: training the tokenizer, each weight tensor, writing the checkpoint.
    num_tensors = len(_weight_shapes(_model_config(_TARGET_VOCAB, 0, 0)))
    with progress_bar(num_tensors + 2, "building the demo model", "step", show_progress) as advance:
        tokenizer = _train_tokenizer()
        advance(1)
        tokenizer.save(str(folder / "tokenizer.json"))
        special: dict[str, int] = {}
        for token in SPECIAL_TOKENS:
            token_id = tokenizer.token_to_id(token)
            assert token_id is not None, f"tokenizer: special token {token!r} missing after training"
            special[token] = token_id
        vocab_size = 64 * math.ceil(tokenizer.get_vocab_size() / 64)
        config = _model_config(vocab_size, eos_id=special["<|im_end|>"], pad_id=special["<|endoftext|>"])
        _write_json(folder / "config.json", config)
        weights = _random_weights(config, advance)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        advance(1)
    _write_json(folder / "tokenizer_config.json", _tokenizer_config(special))
    (folder / "README.md").write_text(_README)
    for name in _FILES:
        with open(folder / name, "rb") as f:
            os.fsync(f.fileno())


def _train_tokenizer() -> Tokenizer:
    corpus = resources.files("phloem.runtime").joinpath("_corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TARGET_VOCAB,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any UTF-8 text encodes (and round-trips) whatever the corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(), trainer=trainer)
    return tokenizer


def _tokenizer_config(special: dict[str, int]) -> dict[str, Any]:
    added = {
        str(token_id): {
            "content": token,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for token, token_id in special.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": _MAX_LEN,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }


def _model_config(vocab_size: int, eos_id: int, pad_id: int) -> dict[str, Any]:
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
        "max_position_embeddings": _MAX_LEN,
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


def _weight_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
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


def _random_weights(config: dict[str, Any], advance: Callable[[int], None]) -> dict[str, torch.Tensor]:
    """Seeded weights of a scale that keeps activations O(1) and next-token logits far from uniform.

    (Hugging Face's init, std 0.02 with zero norms, gives near-uniform logits: greedy output would
    then hinge on rounding noise and differ between implementations.)
    """
    gen = torch.Generator().manual_seed(_SEED)

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std + mean

    weights: dict[str, torch.Tensor] = {}
    for name, shape in sorted(_weight_shapes(config).items()):
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


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

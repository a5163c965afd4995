"""The trained built-in model (runtime/_trained_model, tools/train): transformers and Phloem agree.

Greedy tokens of transformers' ``Qwen3_5MoeForCausalLM`` and Phloem's ``Engine.generate`` are
equal on the CPU in fp32, on a chat prompt in the template and on plain text, and the engine
loads the folder with its ``mtp.*`` tensors present (the Qwen3.5 / Qwen3-Next MTP layout).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from phloem.engine import CacheConfig, Engine, EngineConfig, SamplingParams, SchedulerConfig
from phloem.runtime.default_model import trained_model_path

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def folder() -> Path:
    return trained_model_path()


@pytest.fixture(scope="module")
def hf(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_checkpoint_holds_the_mtp_layer_in_the_qwen_layout(folder: Path) -> None:
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        hidden = f.get_slice("model.embed_tokens.weight").get_shape()[1]
        assert f.get_slice("mtp.fc.weight").get_shape() == [hidden, 2 * hidden]
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                 "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.self_attn.q_proj.weight",
                 "mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.experts.0.gate_proj.weight",
                 "mtp.layers.0.mlp.shared_expert.down_proj.weight", "mtp.layers.0.mlp.shared_expert_gate.weight"):
        assert name in names, name
    # The MTP layer shares the trunk's embedding and head: no mtp.embed_tokens / mtp.lm_head.
    assert not any(n.startswith("mtp.") and ("embed_tokens" in n or "lm_head" in n) for n in names)


@pytest.mark.slow  # loads the trained model in transformers
def test_greedy_tokens_equal_transformers_on_cpu_fp32(folder: Path, hf: torch.nn.Module) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 17 * 23?"}],
                                   tools=[{"type": "function", "function": {
                                       "name": "calculator", "description": "Evaluate an arithmetic expression",
                                       "parameters": {"type": "object", "properties": {
                                           "expression": {"type": "string"}}, "required": ["expression"]}}}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [tok.encode(chat), tok.encode("def mean(xs):\n"), tok.encode("The module")]
    config = EngineConfig(cache=CacheConfig(num_pages=64, num_state_slots=8, page_size=16),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256))
    engine = Engine.from_pretrained(folder, config, dtype="float32", device="cpu")
    outs = engine.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            # No EOS for transformers either (min_new_tokens would mask EOS where the model wants it).
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=[],
                              pad_token_id=hf.config.pad_token_id)
        assert out.token_ids == ref[0, len(prompt):].tolist(), tok.decode(prompt)
    # It has learned something: asked a calculator question, it calls the calculator.
    call = '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
    assert tok.decode(outs[0].token_ids).startswith(call)

"""The one-token decode path without a router launch (``kernels/moe/route_partial.py``) at the model
level, torch backend: its layers' accumulators are zero between steps, the transposed router follows
an in-place weight edit, and turning it off (``KernelOps.route_partial``) gives the same greedy
tokens (fp32)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phloem.engine import CacheConfig, Engine, SamplingParams
from phloem.engine.models._moe import SparseMoe

PROMPT = [5, 17, 42, 99, 3, 250, 7, 11]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
OPTIONS = dict(dtype="float32", cache=CacheConfig(num_pages=64, num_state_slots=8, enable_prefix_caching=False))


def _moe_layers(engine: Engine) -> list[SparseMoe]:
    return [layer.mlp for layer in engine.runner.model.model.layers if isinstance(layer.mlp, SparseMoe)]


def test_accumulators_are_zero_between_steps_and_the_router_copy_follows_edits(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), **OPTIONS)
    tokens = engine.generate([PROMPT], PARAMS)[0].token_ids
    moes = _moe_layers(engine)
    assert moes and all(m._route is not None for m in moes), "every MoE layer took the router-in-projection path"
    assert all(not m._route[2].any() for m in moes if m._route is not None), "an accumulator left non-zero"

    moe = moes[0]
    norm = engine.runner.model.model.layers[0].post_attention_layernorm
    before = moe.decode_route(norm)
    assert before is not None and torch.equal(before[0], moe.router.weight.t())
    with torch.no_grad():
        moe.router.weight.mul_(2.0)
    after = moe.decode_route(norm)
    assert after is not None and torch.equal(after[0], moe.router.weight.t()) and after[2] is before[2]
    with torch.no_grad():
        moe.router.weight.mul_(0.5)

    plain = Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), **OPTIONS)
    for m in _moe_layers(plain):
        m.ops = dataclasses.replace(m.ops, route_partial=False)
    assert plain.generate([PROMPT], PARAMS)[0].token_ids == tokens
    assert all(m._route is None for m in _moe_layers(plain))

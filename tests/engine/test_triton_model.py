"""The whole model on the Triton op table, run by Triton's interpreter on CPU, against the torch
references: the same greedy tokens (fp32), for batched decode and for the one-token steps that
take the Triton GEMV (``KernelConfig.triton_gemv``), with the MoE router in the projection before it
(``kernels/moe/route_partial.py``, the default) and in its own launch (``KernelOps.route_partial`` off). Every Triton kernel the model calls on a GPU runs
here except FlashInfer's attention and fla's chunked prefill (their torch fallbacks run instead).
Also at TP=2 over gloo, every rank under the interpreter: the fused one-token path with its
all-reduces in front of the norm prologues.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phloem.engine import CacheConfig, Engine, SamplingParams
from phloem.kernels.config import KernelConfig

pytest.importorskip("triton")

PROMPTS = [[5, 17, 42, 99, 3, 250, 7] * 2, list(range(30, 50))]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


# The fused one-token ops each decode path calls, with and without the router's own launch
# (kernels/moe/route_partial.py); every layer of the tiny MoE checkpoint is a MoE layer.
ROUTED_OPS = ("add_rms_norm_linear", "add_rms_norm_conv_linear", "gated_rms_norm_linear_route",
              "sigmoid_gate_linear_route", "fused_moe_token_route_partial")  # fmt: skip
ROUTER_OPS = ("add_rms_norm_linear", "add_rms_norm_conv_linear", "gated_rms_norm_linear", "sigmoid_gate_linear",
              "add_rms_norm_router", "fused_moe_token_routed")  # fmt: skip


@pytest.mark.slow  # the whole model under the Triton interpreter: minutes a case on one core
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter (CPU machines)")
@pytest.mark.parametrize("route_partial", ["1", "0"], ids=["router-in-projection", "router-launch"])
def test_the_triton_op_table_gives_the_reference_tokens(
    route_partial: str, tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    options = dict(dtype="float32", cache=CacheConfig(num_pages=64, num_state_slots=8, enable_prefix_caching=False))
    reference = Engine.from_pretrained(path, **options)
    _route_partial(reference, route_partial == "1")
    assert reference.runner.model.model.layers[0].mlp.ops.backend == "torch"
    batched = [o.token_ids for o in reference.generate(PROMPTS, PARAMS)]
    alone = reference.generate(PROMPTS[:1], PARAMS)[0].token_ids

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = _count_fused_ops(monkeypatch)
    engine = Engine.from_pretrained(path, kernels=KernelConfig(backend="triton", triton_gemv=True), **options)
    _route_partial(engine, route_partial == "1")
    ops = engine.runner.model.model.layers[0].mlp.ops
    assert ops.backend == "triton" and ops.linear.__module__ == "phloem.kernels.linear.triton_gemv"
    assert ops.route_partial == (route_partial == "1")
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == batched
    assert not any(calls.values()), f"batched decode steps are not one-token steps: {calls}"
    assert engine.generate(PROMPTS[:1], PARAMS)[0].token_ids == alone
    # The one-token steps took every fused projection of their path (3 decode steps of the 4-layer
    # model) and none of the other path's.
    used = ROUTED_OPS if route_partial == "1" else ROUTER_OPS
    assert all(calls[name] for name in used) and not any(calls[name] for name in calls if name not in used), calls


def _route_partial(engine: Engine, on: bool) -> None:
    """Every MoE layer of ``engine`` with the router in the projection before it (``on``, the
    default of the fused one-token path) or in a launch of its own (``KernelOps.route_partial``)."""
    for layer in engine.runner.model.model.layers:
        layer.mlp.ops = dataclasses.replace(layer.mlp.ops, route_partial=on)


def _count_fused_ops(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Wrap the fused one-token ops (kernels.linear.reference's Triton versions, the one-token experts)
    to count their calls."""
    # imported under the interpreter (set above)
    from phloem.kernels.linear import triton_gemv as gemv
    from phloem.kernels.moe import triton_decode as fused_moe

    calls: dict[str, int] = {}
    for name in dict.fromkeys(ROUTED_OPS + ROUTER_OPS):
        module = fused_moe if name.startswith("fused_moe") else gemv
        calls[name] = 0
        op = getattr(module, name)

        def counted(*args: object, _op: Callable[..., object] = op, _name: str = name, **launch: object) -> object:
            calls[_name] += 1
            return _op(*args, **launch)

        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.slow  # two ranks of the model under the Triton interpreter, over gloo
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter (CPU machines)")
def test_the_triton_op_table_under_tp2_gives_the_reference_tokens(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP=2 over gloo with every rank on the Triton op table (the workers inherit
    ``TRITON_INTERPRET``): the fused one-token path with its all-reduces in front of the norm
    prologues, and batched steps, give the TP=1 torch reference's tokens. Rank 0's one-token steps
    take the Triton fused projections of the router-launch path (no route-partial under TP)."""
    from phloem.engine import ParallelConfig

    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    options = dict(dtype="float32", cache=CacheConfig(num_pages=64, num_state_slots=8, enable_prefix_caching=False))
    reference = Engine.from_pretrained(path, **options)
    alone = reference.generate(PROMPTS[:1], PARAMS)[0].token_ids
    batched = [o.token_ids for o in reference.generate(PROMPTS, PARAMS)]

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = _count_fused_ops(monkeypatch)
    kernels = KernelConfig(backend="triton", triton_gemv=True)
    with Engine.from_pretrained(path, kernels=kernels, parallel=ParallelConfig(tensor_parallel_size=2), **options) as engine:
        ops = engine.runner.model.model.layers[0].mlp.ops
        assert ops.backend == "triton" and engine.workers is not None
        assert engine.generate(PROMPTS[:1], PARAMS)[0].token_ids == alone
        assert all(calls[name] for name in ROUTER_OPS), calls
        assert not any(calls[name] for name in calls if name not in ROUTER_OPS), calls
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == batched

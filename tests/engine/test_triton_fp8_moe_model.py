"""The tiny MoE model quantized to block FP8 at load, on the Triton op table under the interpreter:
its experts' kernels read the FP8 bytes and scales (``SparseMoe`` hands them ``Fp8Weight``s,
``Experts.operands``) and give the greedy tokens of the torch backend, which dequantizes the
selected experts only (fp32 activations: both sides compute with the same dequantized values).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phloem.engine import CacheConfig, Engine, SamplingParams
from phloem.engine.config import LoadConfig
from phloem.kernels.config import KernelConfig
from phloem.kernels.linear.fp8 import Fp8Weight

pytest.importorskip("triton")

PROMPT = [5, 17, 42, 99, 3, 250, 7]
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
# The experts' launchers each step reaches: the prefill's grouped GEMV (fused_moe_tuned) and the
# one-token decode path with the router in the projection before it.
EXPERT_OPS = ("fused_moe_tuned", "fused_moe_token_route_partial")


@pytest.mark.slow  # the whole model under the Triton interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter (CPU machines)")
def test_fp8_experts_on_triton_give_the_torch_tokens(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    options = dict(
        load=LoadConfig(quantization="fp8", dtype="float32"),
        cache=CacheConfig(num_pages=32, num_state_slots=4, enable_prefix_caching=False),
    )
    reference = Engine.from_pretrained(path, **options)
    assert reference.runner.model.model.layers[0].mlp.ops.backend == "torch"
    gate_up, _ = reference.runner.model.model.layers[0].mlp.experts.operands()
    assert isinstance(gate_up, Fp8Weight) and gate_up.data.dtype == torch.float8_e4m3fn
    expected = reference.generate([PROMPT], PARAMS)[0].token_ids

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    operands = _record_expert_operands(monkeypatch)
    engine = Engine.from_pretrained(path, kernels=KernelConfig(backend="triton"), **options)
    assert engine.runner.model.model.layers[0].mlp.ops.backend == "triton"
    assert engine.generate([PROMPT], PARAMS)[0].token_ids == expected
    # 4 MoE layers: one prefill step, two one-token decode steps; every call took FP8 experts.
    assert {name: len(kinds) for name, kinds in operands.items()} == {"fused_moe_tuned": 4, "fused_moe_token_route_partial": 8}
    assert all(kinds == {Fp8Weight} for kinds in map(set, operands.values())), operands


def _record_expert_operands(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[type]]:
    """Wrap the experts' launchers (imported under the interpreter, set above) to record the type
    of the gate/up weights each call got."""
    from phloem.kernels.moe import triton_decode

    seen: dict[str, list[type]] = {name: [] for name in EXPERT_OPS}
    for name in EXPERT_OPS:
        op = getattr(triton_decode, name)
        # The gate/up weights' position: (x, w_gate_up, ...) / (s, acc, norm_w, eps, w_gate_up, ...).
        at = 1 if name == "fused_moe_tuned" else 4

        def recorded(*args: object, _op: Callable[..., object] = op, _name: str = name, _at: int = at, **kw: object) -> object:
            seen[_name].append(type(args[_at]))
            return _op(*args, **kw)

        monkeypatch.setattr(triton_decode, name, recorded)
    return seen

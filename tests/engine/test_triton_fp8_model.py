"""A block-FP8 model (``LoadConfig.quantization="fp8"``) on the Triton op table under the
interpreter: its one-token decode steps take the FP8 GEMV for the attention ``qkv_proj`` /
``o_proj`` and the GDN ``out_proj`` (``Fp8Weight`` operands, never dequantized), its experts'
kernels read the FP8 bytes and scales on every step (``SparseMoe`` hands them ``Fp8Weight``s,
``Experts.operands``), and the greedy tokens equal the torch reference's, which dequantizes the
same FP8 weights (the selected experts only; fp32 model).
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

PROMPT = [5, 17, 42, 99, 3, 250, 7, 11]
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)
# The fused one-token projections that read a quantized weight, with the router in the projection
# before the experts (the default): qkv_proj, o_proj (attention) and out_proj (GDN).
FP8_OPS = ("add_rms_norm_linear", "sigmoid_gate_linear_route", "gated_rms_norm_linear_route")
# The experts' launchers each step reaches: the prefill's grouped GEMV (fused_moe_tuned) and the
# one-token decode path with the router in the projection before it.
EXPERT_OPS = ("fused_moe_tuned", "fused_moe_token_route_partial")


@pytest.mark.slow  # the whole model under the Triton interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter (CPU machines)")
def test_fp8_model_on_the_triton_kernels_gives_the_reference_tokens(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    options = dict(
        dtype="float32", load=LoadConfig(quantization="fp8"),
        cache=CacheConfig(num_pages=64, num_state_slots=8, enable_prefix_caching=False),
    )  # fmt: skip
    reference = Engine.from_pretrained(path, **options)
    assert reference.runner.model.model.layers[0].mlp.ops.backend == "torch"
    gate_up, _ = reference.runner.model.model.layers[0].mlp.experts.operands()
    assert isinstance(gate_up, Fp8Weight) and gate_up.data.dtype == torch.float8_e4m3fn
    want = reference.generate([PROMPT], PARAMS)[0].token_ids

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fp8_calls = _count_fp8_operands(monkeypatch)
    expert_operands = _record_expert_operands(monkeypatch)
    engine = Engine.from_pretrained(path, kernels=KernelConfig(backend="triton", triton_gemv=True), **options)
    assert engine.runner.model.model.layers[0].mlp.ops.backend == "triton"
    assert engine.generate([PROMPT], PARAMS)[0].token_ids == want
    # 3 one-token steps of the 4-layer model (GDN, GDN, GDN, attention).
    assert fp8_calls == {"add_rms_norm_linear": 3, "sigmoid_gate_linear_route": 3, "gated_rms_norm_linear_route": 9}
    # 4 MoE layers: one prefill step, three one-token decode steps; every call took FP8 experts.
    assert {name: len(kinds) for name, kinds in expert_operands.items()} == {
        "fused_moe_tuned": 4, "fused_moe_token_route_partial": 12}
    assert all(kinds == {Fp8Weight} for kinds in map(set, expert_operands.values())), expert_operands


def _count_fp8_operands(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of ``FP8_OPS`` given an ``Fp8Weight``; the launcher's ``dense`` (for shapes
    the kernel does not cover) raises on an ``Fp8Weight``, so each of them ran the FP8 kernel."""
    from phloem.kernels.linear import triton_gemv as gemv  # under the interpreter (set above)

    def no_dense(w: torch.Tensor | Fp8Weight) -> torch.Tensor:
        assert not isinstance(w, Fp8Weight), "an FP8 weight was dequantized on the one-token path"
        return w

    monkeypatch.setattr(gemv, "dense", no_dense)
    calls = dict.fromkeys(FP8_OPS, 0)
    for name in FP8_OPS:
        op = getattr(gemv, name)

        def counted(*args: object, _op: Callable[..., object] = op, _name: str = name, **launch: object) -> object:
            calls[_name] += any(isinstance(a, Fp8Weight) for a in args)
            return _op(*args, **launch)

        monkeypatch.setattr(gemv, name, counted)
    return calls


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

"""W8A8 prefill (``KernelConfig.fp8_w8a8``): the dense projections of FP8 weights quantize their
activations per token and 128-column group (``engine.models._fp8.project``) and the MoE layers'
FP8 experts run both projections as grouped W8A8 GEMMs (``engine.models._moe.fused_moe_w8a8``),
against the weight-only path (the weights dequantized on read) on the trained built-in model (a
MoE: 4 layers of 8 experts, top-2, and the shared expert).

In fp32 (torch references) the comparison isolates the activation quantization; in bf16 (the
served dtype) bf16 rounding adds noise of the same size. Both paths quantize the weights at load
(``quantization="fp8"``). Measured on CPU over 2 windows of 254 tokens (508 positions) of
``test_fp8_kv_accuracy``'s text:

    fp32   weight-only vs unquantized     mean KL 1.18e-3   max KL 0.168   top-1 98.6 %
    fp32   W8A8 vs weight-only            mean KL 7.71e-4   max KL 0.052   top-1 97.8 %
    fp32   W8A8 vs unquantized            mean KL 1.43e-3
    bf16   weight-only vs unquantized     mean KL 1.32e-3   max KL 0.128   top-1 97.4 %
    bf16   W8A8 vs weight-only            mean KL 1.58e-3   max KL 0.201   top-1 98.0 %
    bf16   W8A8 vs unquantized            mean KL 1.42e-3

Of the fp32 W8A8 vs weight-only KL, the dense projections alone (experts weight-only) give
3.8e-4 (top-1 98.8 %) and the experts the rest, so quantizing the activations adds about a fifth
to what quantizing the weights costs (fp32). Bounds with margin, W8A8 vs weight-only: fp32 mean
KL <= 1.5e-3, max KL <= 0.2, top-1 >= 96 %; bf16 mean KL <= 3e-3, max KL <= 0.6, top-1 >= 95 %;
and in both dtypes W8A8's mean KL from the unquantized model <= 1.5 x the weight-only path's.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import phloem.engine.loader as loader
import phloem.kernels.linear.w8a8 as w8a8_dense
import phloem.kernels.moe.reference as moe_reference
import phloem.kernels.moe.w8a8 as moe_w8a8
from phloem.engine.config import LoadConfig, ModelConfig
from phloem.engine.models._fp8 import dequantize_on_read, make_fp8, project, weight_operand
from phloem.engine.models._moe import SparseMoe, fused_moe_w8a8
from phloem.kernels.config import KernelConfig
from phloem.kernels.dispatch import get_ops
from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_quantize
from phloem.kernels.linear.w8a8 import fp8_w8a8_block_matmul_reference
from phloem.runtime.builtin_model import trained_model_path

sys.path.insert(0, str(Path(__file__).parent))
from test_fp8_kv_accuracy import TEXTS, WINDOW, prefill_logits  # noqa: E402

CPU = torch.device("cpu")


def _quantize(linear: nn.Linear) -> nn.Linear:
    """``linear``'s weight made block FP8 in place, as the loader stores it (fp32 reads)."""
    data, scale = fp8_block_quantize(linear.weight.data, (1, 128))
    make_fp8(linear, "weight")
    linear.weight.data.copy_(data)
    linear.weight_scale_inv.data.copy_(scale)
    dequantize_on_read(linear, "weight", torch.float32)
    return linear


def _fp8_linear(n: int, k: int) -> nn.Linear:
    return _quantize(nn.Linear(k, n, bias=False))


def test_project_runs_the_w8a8_op_only_on_fp8_weights_when_asked() -> None:
    torch.manual_seed(0)
    fp8, plain = _fp8_linear(40, 300), nn.Linear(300, 40, bias=False)
    x = torch.randn(6, 300)
    on, off = get_ops(CPU, KernelConfig(fp8_w8a8=True)), get_ops(CPU)
    with torch.no_grad():
        assert torch.equal(project(on, fp8, x), fp8_w8a8_block_matmul_reference(x, weight_operand(fp8, "weight")))
        assert torch.equal(project(off, fp8, x), fp8(x))
        assert torch.equal(project(on, plain, x), plain(x))
        assert not torch.equal(project(on, fp8, x), fp8(x))


def _fp8_experts(e: int, n: int, k: int, seed: int) -> Fp8Weight:
    gen = torch.Generator().manual_seed(seed)
    data, scale = fp8_block_quantize(torch.randn(e, n, k, generator=gen) / k**0.5, (1, 128))
    return Fp8Weight(data, scale, torch.float32)


def _expert(w: Fp8Weight, expert: int) -> Fp8Weight:
    return Fp8Weight(w.data[expert], w.scale_inv[expert], w.dtype)


def test_fused_moe_w8a8_is_the_dense_w8a8_per_token_and_slot() -> None:
    """Against a loop over ``(token, slot)`` pairs of the dense W8A8 reference on the pair's expert:
    the same quantized rows and products (fp32), summed in another order; the shared-expert slot
    (``moe_route_shared``'s expert ``E``) is a slot like the others."""
    t, k, e, hidden, inter = 7, 3, 5, 200, 136
    gate_up, down = _fp8_experts(e, 2 * inter, hidden, seed=1), _fp8_experts(e, hidden, inter, seed=2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(t, hidden, generator=gen)
    weights, ids = moe_reference.moe_route_shared(torch.randn(t, e, generator=gen), k - 1, True)
    got = fused_moe_w8a8(get_ops(CPU, KernelConfig(fp8_w8a8=True)), x, gate_up, down, weights, ids)
    want = torch.zeros(t, hidden)
    for i in range(t):
        for j, expert in enumerate(ids[i].tolist()):
            g, u = fp8_w8a8_block_matmul_reference(x[i : i + 1], _expert(gate_up, expert)).chunk(2, dim=-1)
            h = fp8_w8a8_block_matmul_reference(torch.nn.functional.silu(g) * u, _expert(down, expert))
            want[i] += weights[i, j] * h[0]
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    weight_only = moe_reference.fused_moe(x, gate_up, down, weights, ids)
    assert 0 < (got - weight_only).abs().max() <= 0.1 * weight_only.abs().max()


@pytest.mark.slow  # the grouped GEMM under the Triton interpreter (a few seconds)
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter (CPU machines)")
def test_fused_moe_w8a8_on_the_triton_table_gives_the_references_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton table's grouped GEMM in ``fused_moe_w8a8`` (the SwiGLU rows of the chunked gate/up
    output into the down GEMM) against the torch table's, fp32, within 1e-5 of the output scale.
    The launcher's activation quantization is the torch one here: the interpreter's fp32 -> e4m3
    cast is not round-to-nearest-even (``tests/kernels/test_triton_w8a8.py``'s NOTE), and SwiGLU
    rows are not exact e4m3 values; that kernel is checked on its own there."""
    from phloem.kernels.linear.w8a8 import fp8_act_quant

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_ops = get_ops(CPU, KernelConfig(backend="triton", fp8_w8a8=True))
    from phloem.kernels.moe import triton_grouped_w8a8

    monkeypatch.setattr(triton_grouped_w8a8, "fp8_act_quant", fp8_act_quant)
    t, k, e, hidden, inter = 9, 3, 5, 200, 136
    gate_up, down = _fp8_experts(e, 2 * inter, hidden, seed=4), _fp8_experts(e, hidden, inter, seed=5)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(t, hidden, generator=gen)
    weights, ids = moe_reference.moe_route_shared(torch.randn(t, e, generator=gen), k - 1, True)
    got = fused_moe_w8a8(triton_ops, x, gate_up, down, weights, ids)
    want = fused_moe_w8a8(get_ops(CPU, KernelConfig(fp8_w8a8=True)), x, gate_up, down, weights, ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def _count_w8a8_ops(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the torch table's dense and grouped W8A8 projections and ``fused_moe`` calls of the
    models loaded after it (``get_ops`` binds the module attributes)."""
    calls = {"fp8_w8a8_block_matmul": 0, "fp8_w8a8_grouped_linear": 0, "fused_moe": 0}
    patched = (
        (w8a8_dense, "fp8_w8a8_block_matmul_reference"), (moe_w8a8, "fp8_w8a8_grouped_linear_reference"),
        (moe_reference, "fused_moe"),
    )  # fmt: skip
    for module, name in patched:
        op, key = getattr(module, name), name.removesuffix("_reference")

        def counted(*args: object, _op: Callable[..., object] = op, _key: str = key) -> object:
            calls[_key] += 1
            return _op(*args)

        monkeypatch.setattr(module, name, counted)
    return calls


def test_prefill_runs_every_fp8_projection_w8a8_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """One prefill: with ``fp8_w8a8`` every MoE layer's experts take two grouped W8A8 projections
    (gate/up, down) and no ``fused_moe``, each attention layer its ``qkv_proj`` and ``o_proj``
    and each GDN layer its ``out_proj`` (its ``in_proj`` is not FP8) the dense W8A8 GEMM; off, none.
    The logits' distance from the weight-only path is bounded by
    ``test_w8a8_prefill_stays_close_to_the_weight_only_path``."""
    path = trained_model_path()
    cfg = ModelConfig.from_pretrained(path)
    calls = _count_w8a8_ops(monkeypatch)
    w8a8 = loader.load_model(path, cfg, LoadConfig(quantization="fp8"), kernels=KernelConfig(fp8_w8a8=True))
    weight_only = loader.load_model(path, cfg, LoadConfig(quantization="fp8"))
    moe_layers = [m for m in w8a8.modules() if isinstance(m, SparseMoe)]
    assert len(moe_layers) == cfg.num_hidden_layers and all(
        isinstance(w, Fp8Weight) for m in moe_layers for w in m.experts.operands()
    )
    tokens = list(range(5, 5 + 40))
    got = prefill_logits(w8a8, cfg, tokens, torch.float32)
    dense = 2 * len(cfg.full_attention_layers) + len(cfg.linear_attention_layers)
    assert calls == {"fp8_w8a8_block_matmul": dense, "fp8_w8a8_grouped_linear": 2 * len(moe_layers), "fused_moe": 0}
    want = prefill_logits(weight_only, cfg, tokens, torch.float32)
    assert calls == {
        "fp8_w8a8_block_matmul": dense, "fp8_w8a8_grouped_linear": 2 * len(moe_layers), "fused_moe": len(moe_layers)}
    assert not torch.equal(got, want)


def test_the_mtp_layers_fc_runs_w8a8_when_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MTP step with an FP8 ``fc`` (``quantization="fp8"`` leaves it unquantized; an FP8
    checkpoint may not): ``fc``, then its attention layer's ``qkv_proj`` and ``o_proj`` take the
    dense W8A8 GEMM, its experts the grouped one."""
    from test_mtp import make_batch, make_caches

    from phloem.engine.config import SpeculativeConfig
    from phloem.engine.models.mtp import mtp_forward

    path = trained_model_path()
    cfg = ModelConfig.from_pretrained(path)
    calls = _count_w8a8_ops(monkeypatch)
    model = loader.load_model(path, cfg, LoadConfig(quantization="fp8"), kernels=KernelConfig(fp8_w8a8=True),
                              speculative=SpeculativeConfig(method="mtp", num_draft_tokens=1))  # fmt: skip
    assert not isinstance(weight_operand(model.mtp.fc, "weight"), Fp8Weight)
    _quantize(model.mtp.fc)
    tokens = list(range(5, 5 + 20))
    hidden = torch.randn(len(tokens), cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = mtp_forward(model, torch.tensor(tokens), hidden, make_batch([tokens], [0]), make_caches(cfg, 1))
    assert out.isfinite().all()
    assert calls == {"fp8_w8a8_block_matmul": 3, "fp8_w8a8_grouped_linear": 2, "fused_moe": 0}


def _compare(model_a: nn.Module, model_b: nn.Module, cfg: ModelConfig, windows: list[list[int]],
             dtype: torch.dtype) -> tuple[float, float, float]:  # fmt: skip
    """(mean KL(a || b), max KL, top-1 agreement) over every position of ``windows``."""
    kls, agree = [], []
    for tokens in windows:
        ref = prefill_logits(model_a, cfg, tokens, dtype)
        got = prefill_logits(model_b, cfg, tokens, dtype)
        kls.append((ref.exp() * (ref - got)).sum(-1))
        agree.append(ref.argmax(-1) == got.argmax(-1))
    kl = torch.cat(kls)
    return kl.mean().item(), kl.max().item(), torch.cat(agree).float().mean().item()


# dtype -> (mean KL, max KL, top-1) bounds of W8A8 against the weight-only path.
BOUNDS = {"float32": (1.5e-3, 0.2, 0.96), "bfloat16": (3e-3, 0.6, 0.95)}


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_w8a8_prefill_stays_close_to_the_weight_only_path(dtype: str) -> None:
    from transformers import AutoTokenizer

    path = trained_model_path()
    ids = AutoTokenizer.from_pretrained(path).encode("".join(TEXTS) + inspect.getsource(textwrap))
    windows = [ids[i : i + WINDOW] for i in range(0, 2 * WINDOW, WINDOW)]
    cfg = ModelConfig.from_pretrained(path)
    kv = getattr(torch, dtype)
    orig = loader.load_model(path, cfg, LoadConfig(dtype=dtype))
    weight_only = loader.load_model(path, cfg, LoadConfig(quantization="fp8", dtype=dtype))
    w8a8 = loader.load_model(path, cfg, LoadConfig(quantization="fp8", dtype=dtype), kernels=KernelConfig(fp8_w8a8=True))
    mean_kl, max_kl, top1 = _compare(weight_only, w8a8, cfg, windows, kv)
    print(f"{dtype} W8A8 vs weight-only: mean KL {mean_kl:.2e}, max KL {max_kl:.2e}, top-1 {top1:.4f}")
    mean_bound, max_bound, top1_bound = BOUNDS[dtype]
    assert 0 < mean_kl <= mean_bound and max_kl <= max_bound and top1 >= top1_bound, (mean_kl, max_kl, top1)
    weight_cost = _compare(orig, weight_only, cfg, windows, kv)[0]
    both_cost = _compare(orig, w8a8, cfg, windows, kv)[0]
    print(f"{dtype} vs unquantized: weight-only mean KL {weight_cost:.2e}, W8A8 {both_cost:.2e}")
    assert both_cost <= 1.5 * weight_cost, (both_cost, weight_cost)


def test_the_dense_projections_it_covers_are_fp8_in_that_model() -> None:
    path = trained_model_path()
    model = loader.load_model(path, ModelConfig.from_pretrained(path), LoadConfig(quantization="fp8"))
    for name in ("qkv_proj", "o_proj", "out_proj"):
        modules = [m for n, m in model.named_modules() if n.endswith(name)]
        assert modules and all(isinstance(weight_operand(m, "weight"), Fp8Weight) for m in modules), name

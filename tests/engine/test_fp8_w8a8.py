"""W8A8 prefill (``KernelConfig.fp8_w8a8``): the dense projections of FP8 weights quantize their
activations per token and 128-column group (``engine.models._fp8.project``), against the
weight-only path (the weights dequantized on read) on the trained built-in model.

In fp32 (torch references) the comparison isolates the activation quantization; in bf16 (the
served dtype) bf16 rounding adds noise of the same size. Both paths quantize the weights at load
(``quantization="fp8"``). Measured on CPU over 2 windows of 254 tokens (508 positions) of
``test_fp8_kv_accuracy``'s text:

    fp32   weight-only vs unquantized     mean KL 1.18e-3   max KL 0.168   top-1 98.6 %
    fp32   W8A8 vs weight-only            mean KL 3.74e-4   max KL 0.059   top-1 99.0 %
    fp32   W8A8 vs unquantized            mean KL 1.31e-3   max KL 0.161   top-1 98.8 %
    bf16   weight-only vs unquantized     mean KL 1.32e-3   max KL 0.128   top-1 97.4 %
    bf16   W8A8 vs weight-only            mean KL 9.53e-4   max KL 0.220   top-1 98.2 %
    bf16   W8A8 vs unquantized            mean KL 1.17e-3   max KL 0.043   top-1 96.9 %

so quantizing the activations adds about a tenth to what quantizing the weights costs (fp32).
Bounds with margin, W8A8 vs weight-only: fp32 mean KL <= 1e-3, max KL <= 0.2, top-1 >= 97 %;
bf16 mean KL <= 3e-3, max KL <= 0.6, top-1 >= 95 %; and in both dtypes W8A8's mean KL from the
unquantized model <= 1.5 x the weight-only path's.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import phloem.engine.loader as loader
from phloem.engine.config import LoadConfig, ModelConfig
from phloem.engine.models._fp8 import dequantize_on_read, make_fp8, project, weight_operand
from phloem.kernels.config import KernelConfig
from phloem.kernels.dispatch import get_ops
from phloem.kernels.linear.fp8 import Fp8Weight, fp8_block_quantize
from phloem.kernels.linear.w8a8 import fp8_w8a8_block_matmul_reference
from phloem.runtime.builtin_model import trained_model_path

sys.path.insert(0, str(Path(__file__).parent))
from test_fp8_kv_accuracy import TEXTS, WINDOW, prefill_logits  # noqa: E402

CPU = torch.device("cpu")


def _fp8_linear(n: int, k: int) -> nn.Linear:
    linear = nn.Linear(k, n, bias=False)
    data, scale = fp8_block_quantize(linear.weight.data, (1, 128))
    make_fp8(linear, "weight")
    linear.weight.data.copy_(data)
    linear.weight_scale_inv.data.copy_(scale)
    dequantize_on_read(linear, "weight", torch.float32)
    return linear


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
BOUNDS = {"float32": (1e-3, 0.2, 0.97), "bfloat16": (3e-3, 0.6, 0.95)}


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

"""The FP8 correctness model on the GPU (issue 51): the trained built-in model quantized to block FP8
at load (``LoadConfig(quantization="fp8")``, Qwen's release format).

1. Its CUDA-graph + fused path (the FP8 one-token GEMV and expert kernels, reading the e4m3 bytes
   and scales) gives the FP8 eager path's greedy tokens, 256 tokens x 8 prompts: the eager path
   runs without graphs, fused projections or Triton GEMVs, so every weight is read dequantized to
   bf16 (``engine.models._fp8.dequantize_on_read``). Where they part, the eager engine's logits at
   that point must be a bf16 tie (``trained_ties``), as for the bf16 model.
2. Its next-token logits stay close to the bf16 model's: over 64 points (each prompt's end and
   every 32nd token of the bf16 model's greedy continuation), mean KL(bf16 || FP8) <= 4e-3, max KL
   <= 0.6, top-1 agreement >= 93 %. The CPU measurements these bounds leave margin over
   (``tests/engine/test_fp8_w8a8.py``, bf16 weight-only vs unquantized): mean KL 1.32e-3, max KL
   0.128, top-1 97.4 %.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from probe import next_token_logits
from trained_ties import first_unexplained, prompts

from phloem.engine import CacheConfig, Engine, EngineConfig, LoadConfig, RunnerConfig, SamplingParams, SchedulerConfig
from phloem.kernels.config import KernelConfig
from phloem.runtime.default_model import trained_model_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW_TOKENS = 256
BF16 = LoadConfig(device="cuda", dtype="bfloat16")
FP8 = replace(BF16, quantization="fp8")
GPU = EngineConfig(load=FP8, cache=CacheConfig(num_pages=512, num_state_slots=32),
                   scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16))  # fmt: skip
EAGER = dict(
    runner=RunnerConfig(enable_cuda_graph=False), cache=replace(GPU.cache, enable_prefix_caching=False),
    kernels=KernelConfig(triton_gemv=False, fused_decode=False, triton_decode_attention=False),
)  # fmt: skip


def engine(folder: Path, **sections: Any) -> Engine:
    return Engine.from_pretrained(folder, GPU, **sections)


def test_fp8_graph_and_fused_path_gives_the_fp8_eager_tokens() -> None:
    folder = trained_model_path()
    ids = prompts(folder)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    fast = engine(folder)
    assert fast.runner.graphs is not None and fast.runner.model.model.layers[0].mlp.ops.backend == "triton"
    tested = [o.token_ids for o in fast.generate(ids, params)]
    del fast
    reference = engine(folder, **EAGER)
    want = [o.token_ids for o in reference.generate(ids, params)]
    unexplained = [
        line for n, (prompt, got, ref) in enumerate(zip(ids, tested, want))
        if (line := first_unexplained(reference, prompt, got, ref, f"prompt {n}")) is not None
    ]  # fmt: skip
    assert all(len(t) == NEW_TOKENS for t in tested + want)
    assert not unexplained, unexplained


def test_fp8_logits_stay_close_to_the_bf16_models() -> None:
    folder = trained_model_path()
    ids = prompts(folder)
    bf16 = engine(folder, load=BF16, **EAGER)
    continued = [o.token_ids for o in bf16.generate(ids, SamplingParams(max_tokens=NEW_TOKENS - 32, ignore_eos=True))]
    points = [p + c[:k] for p, c in zip(ids, continued) for k in range(0, NEW_TOKENS - 32, 32)]
    assert len(points) == 64
    want = torch.stack([next_token_logits(bf16, t).float() for t in points])
    del bf16
    fp8 = engine(folder, **EAGER)
    got = torch.stack([next_token_logits(fp8, t).float() for t in points])
    kl = (want.log_softmax(-1).exp() * (want.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
    top1 = (want.argmax(-1) == got.argmax(-1)).float().mean().item()
    print(f"FP8 vs bf16 over {len(points)} points: mean KL {kl.mean().item():.2e}, max KL {kl.max().item():.2e}, top-1 {top1:.3f}")
    assert kl.mean().item() <= 4e-3 and kl.max().item() <= 0.6 and top1 >= 0.93

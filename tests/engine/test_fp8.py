"""Block-FP8 weights (issue 51, first piece): Qwen's FP8 checkpoints load as published, bf16
checkpoints and dummy weights quantize at load, all on the dequantize-to-model-dtype reference path.

Tolerances, on every prompt token's logits, ``scale = max(1, max|ref|)``:

- FP8 checkpoint (loaded as FP8, run in fp32) vs Hugging Face transformers (fp32) on the same
  checkpoint dequantized to fp32: ``max|ours - hf| <= 1e-4 * scale``, the fp32 parity bound of
  ``test_model_parity`` (both sides run the same dequantized values). Observed <= 2.2e-6 * scale
  (Qwen3.5-MoE 1.5e-6, Qwen3.5 1.6e-6, Qwen3-Next 2.2e-6), greedy tokens equal.
- The same FP8 checkpoint vs our own model loaded from the dequantized fp32 checkpoint: equal to
  ``1e-5 * scale`` (the same weights, the same ops).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import phloem.engine.loader as loader
from phloem.engine.config import LoadConfig, ModelConfig
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.models._fp8 import FP8_DTYPE, is_fp8
from phloem.engine.parallel import TPGroup
from phloem.kernels.linear.reference import fp8_block_dequant, fp8_block_quantize

ARCHS = ["Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"]
# What Qwen's FP8 releases quantize (by checkpoint name); everything else stays as stored.
_PROJECTIONS = re.compile(
    r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|in_proj_qkv|in_proj_z|in_proj_qkvz|out_proj)\.weight$"
    r"|\.experts\.(gate_up_proj|down_proj)$"  # fused expert tensors [E, rows, cols]: blocks per expert
)
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PAGE_SIZE, NUM_PAGES = 4, 32


def _read(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({n: f.get_tensor(n) for n in f.keys()})
    return out


def _write(folder: Path, tensors: dict[str, torch.Tensor], config: dict, files: int = 1) -> Path:
    """One ``model.safetensors``, or ``files`` shards with an index, tensors dealt round-robin (so
    a weight and its scale usually land in different files)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if files == 1:
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"), {"format": "pt"})
        return folder
    names = sorted(tensors)
    weight_map = {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::files]}
        save_file(part, str(folder / file), {"format": "pt"})
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def fp8_checkpoint(src: Path, dst: Path, keep: str | None = None, files: int = 1) -> tuple[Path, Path]:
    """``src`` quantized to Qwen's FP8 format (e4m3 projections + ``weight_scale_inv`` per 128x128
    block, a ``quantization_config``) and the same weights dequantized to fp32; ``(fp8, dequantized)``.
    Tensors whose name matches the regex ``keep`` stay as stored."""
    config = json.loads((src / "config.json").read_text())
    fp8: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in _read(src).items():
        if _PROJECTIONS.search(name) and not (keep and re.search(keep, name)):
            q, s = fp8_block_quantize(t.float())
            fp8[name], fp8[name + "_scale_inv"] = q, s
            deq[name] = fp8_block_dequant(q, s)
        else:
            fp8[name] = deq[name] = t
    return (
        _write(dst / "fp8", fp8, {**config, "quantization_config": QUANT_CONFIG}, files),
        _write(dst / "dequantized", deq, {**config, "dtype": "float32"}, files),
    )


def prefill_logits(model: loader.Qwen3HybridForCausalLM, cfg: ModelConfig, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    pages = -(-n // PAGE_SIZE)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        page_table=torch.arange(1, NUM_PAGES + 1, dtype=torch.int32)[None],
        slot_mapping=torch.arange(PAGE_SIZE, PAGE_SIZE + n),
        read_slots=torch.tensor([1]),
        write_slots=torch.tensor([0]),
        has_initial_state=torch.tensor([False]),
        logits_indices=torch.arange(n),
        query_lens_cpu=(n,),
        is_decode=False,
    )
    assert pages < NUM_PAGES
    kv = (len(cfg.full_attention_layers), NUM_PAGES + 1, 2, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    num_gdn = len(cfg.linear_attention_layers)
    caches = ModelCaches(
        kv=torch.zeros(kv),
        conv=torch.zeros(num_gdn, 2, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1),
        ssm=torch.zeros(num_gdn, 2, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
    )
    with torch.no_grad():
        return model.compute_logits(model(batch, caches)).float()


TOKENS = [(i * 37 + 11) % 256 for i in range(13)]


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return (ours - ref).abs().max().item() / max(1.0, ref.abs().max().item())


@pytest.mark.slow  # transformers on three architectures
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_checkpoint_matches_hf_on_its_dequantized_weights(
    arch: str, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    fp8_path, deq_path = fp8_checkpoint(tiny_checkpoint(arch), tmp_path)
    cfg = ModelConfig.from_pretrained(fp8_path)
    model = loader.load_model(fp8_path, cfg, LoadConfig())
    # Stored as published: every projection with a scale is FP8, nothing else is.
    names = dict(model.named_parameters())
    fp8_names = {n for n, p in names.items() if p.dtype == FP8_DTYPE}
    assert fp8_names and all("o_proj" in n or "qkv_proj" in n or "out_proj" in n or "gate_up" in n or "down" in n
                             for n in fp8_names), fp8_names
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert not any("in_proj" in n for n in fp8_names)  # fused with in_proj_b/a (unquantized): dequantized
    ours = prefill_logits(model, cfg, TOKENS)
    hf = AutoModelForCausalLM.from_pretrained(deq_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0].float()
    err = _rel_err(ours, ref)
    print(f"{arch}: FP8 vs HF dequantized fp32, max-abs / scale = {err:.2e}")
    assert err <= 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    own = prefill_logits(loader.load_model(deq_path, cfg, LoadConfig()), cfg, TOKENS)
    assert _rel_err(ours, own) <= 1e-5


@pytest.mark.parametrize(("arch", "layout", "experts"), [
    ("Qwen3_5MoeForCausalLM", "language_model", "fused"), ("Qwen3NextForCausalLM", "plain", "fused"),
])
def test_fp8_fused_experts_sharded_files(
    arch: str, layout: str, experts: str, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Fused ``[E, 2I, H]`` expert tensors with ``[E, ceil(2I/128), ceil(H/128)]`` scales, the
    multimodal ``model.language_model.`` prefix, and weights in another file than their scales:
    the FP8 load equals our load of the same checkpoint dequantized to fp32."""
    fp8_path, deq_path = fp8_checkpoint(tiny_checkpoint(arch, layout, experts), tmp_path, files=3)
    cfg = ModelConfig.from_pretrained(fp8_path)
    model = loader.load_model(fp8_path, cfg, LoadConfig())
    assert any(n.endswith("experts.parametrizations.gate_up_proj.original") and p.dtype == FP8_DTYPE
               for n, p in model.named_parameters())
    ours = prefill_logits(model, cfg, TOKENS)
    own = prefill_logits(loader.load_model(deq_path, cfg, LoadConfig()), cfg, TOKENS)
    assert _rel_err(ours, own) <= 1e-5
    for rank in range(2):  # and under TP=2 row shards (column-parallel tensors kept unquantized)
        tp = TPGroup(rank, 2, torch.device("cpu"))
        kept = r"o_proj|out_proj|down_proj"
        f8, dq = fp8_checkpoint(tiny_checkpoint(arch, layout, experts), tmp_path / "tp", keep=kept, files=3)
        got = loader.load_model(f8, cfg, LoadConfig(), tp)
        want = dict(loader.load_model(dq, cfg, LoadConfig(), tp).named_parameters())
        fp8 = set()
        for name, module in got.named_modules():
            for attr in getattr(module, "parametrizations", {}):
                fp8.add(f"{name}.{attr}")
                assert torch.equal(getattr(module, attr), want[f"{name}.{attr}"]), (rank, name, attr)
        assert any(n.endswith("experts.gate_up_proj") for n in fp8) and any(n.endswith("qkv_proj.weight") for n in fp8)


def test_fp8_checkpoint_differs_from_bf16_weights_it_came_from(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """The FP8 model is not the original weights' model, and a checkpoint with wrong scales gives other logits (the parity test above can fail)."""
    src = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    fp8_path, _ = fp8_checkpoint(src, tmp_path)
    cfg = ModelConfig.from_pretrained(fp8_path)
    ours = prefill_logits(loader.load_model(fp8_path, cfg, LoadConfig()), cfg, TOKENS)
    orig = prefill_logits(loader.load_model(src, cfg, LoadConfig()), cfg, TOKENS)
    assert _rel_err(ours, orig) > 0  # random tiny weights amplify e4m3 rounding: no useful upper bound
    tensors = _read(fp8_path)
    name = next(n for n in tensors if n.endswith("o_proj.weight_scale_inv"))
    tensors[name] = tensors[name] * 2
    bad = _write(tmp_path / "bad", tensors, json.loads((fp8_path / "config.json").read_text()))
    assert _rel_err(prefill_logits(loader.load_model(bad, cfg, LoadConfig()), cfg, TOKENS), ours) > 1e-3


def test_fp8_weights_stay_fp8_and_dequantize_on_read(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    fp8_path, deq_path = fp8_checkpoint(tiny_checkpoint("Qwen3NextForCausalLM"), tmp_path)
    cfg = ModelConfig.from_pretrained(fp8_path)
    model = loader.load_model(fp8_path, cfg, LoadConfig())
    full = loader.load_model(deq_path, cfg, LoadConfig())
    layer = model.model.layers[cfg.full_attention_layers[0]]
    attn = layer.self_attn
    assert is_fp8(attn.qkv_proj, "weight") and not is_fp8(layer.input_layernorm, "weight")
    assert attn.qkv_proj.parametrizations.weight.original.dtype == FP8_DTYPE
    ref = dict(full.named_parameters())
    for name, module in model.named_modules():
        for attr in ("weight", "gate_up_proj", "down_proj"):
            if hasattr(module, "parametrizations") and attr in module.parametrizations:
                key = f"{name}.{attr}"
                assert torch.equal(getattr(module, attr), ref[key]), key


def test_mismatched_scale_shape_and_other_formats_are_refused(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    fp8_path, _ = fp8_checkpoint(tiny_checkpoint("Qwen3_5ForCausalLM"), tmp_path)
    cfg = ModelConfig.from_pretrained(fp8_path)
    config = json.loads((fp8_path / "config.json").read_text())
    tensors = _read(fp8_path)
    name = next(n for n in tensors if n.endswith("o_proj.weight_scale_inv"))
    tensors[name] = torch.ones(tensors[name].shape[0] + 1, tensors[name].shape[1])
    with pytest.raises(ValueError, match="block scales of shape"):
        loader.load_model(_write(tmp_path / "bad_scale", tensors, config), cfg, LoadConfig())
    other = {**config, "quantization_config": {**QUANT_CONFIG, "weight_block_size": [64, 64]}}
    with pytest.raises(ValueError, match="weight_block_size"):
        loader.load_model(_write(tmp_path / "other", _read(fp8_path), other), cfg, LoadConfig())


@pytest.mark.parametrize("arch", ARCHS)
def test_quantize_at_load_round_trip(arch: str, tiny_checkpoint: Callable[..., Path]) -> None:
    """``quantization="fp8"``: each quantized weight within half an e4m3 step of the original,
    ``|deq - w| <= max(2^-4 |w|, 2^-10 scale)`` elementwise with ``scale = amax(|block|) / 448`` of its
    128x128 block (3 mantissa bits; the subnormal step is ``2^-9``); lm_head, embeddings, norms,
    routers and GDN in_proj stay exact."""
    path = tiny_checkpoint(arch)
    cfg = ModelConfig.from_pretrained(path)
    full = dict(loader.load_model(path, cfg, LoadConfig()).named_parameters())
    model = loader.load_model(path, cfg, LoadConfig(quantization="fp8"))
    quantized = 0
    for name, module in model.named_modules():
        for attr in ("weight", "gate_up_proj", "down_proj"):
            key = f"{name}.{attr}" if name else attr
            if key not in full:
                continue
            w, orig = getattr(module, attr), full[key]
            if hasattr(module, "parametrizations") and attr in module.parametrizations:
                quantized += 1
                assert module.parametrizations[attr].original.dtype == FP8_DTYPE
                # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 above the subnormals,
                # and each block's amax maps to 448 exactly.
                _, block_scale = fp8_block_quantize(orig)
                scale = block_scale.repeat_interleave(128, -2)[..., : orig.shape[-2], :]
                scale = scale.repeat_interleave(128, -1)[..., : orig.shape[-1]]
                bound = torch.maximum(orig.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
                assert ((w - orig).abs() <= bound).all(), key
                assert (w - orig).abs().max() > 0, key
            else:
                assert torch.equal(w, orig), key
                assert not re.search(r"(qkv_proj|o_proj|out_proj|gate_up_proj|down_proj)", key) or "in_proj" in key, key
    assert quantized >= 2 * cfg.num_hidden_layers


def test_dummy_fp8_loads(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    cfg = ModelConfig.from_pretrained(path)
    model = loader.load_model(path, cfg, LoadConfig(load_format="dummy", quantization="fp8", dtype="bfloat16"))
    fp8 = [n for n, p in model.named_parameters() if p.dtype == FP8_DTYPE]
    assert any("experts" in n for n in fp8) and any("qkv_proj" in n for n in fp8)
    logits = prefill_logits(model, cfg, TOKENS)
    assert torch.isfinite(logits).all()
    ref = prefill_logits(loader.load_model(path, cfg, LoadConfig(load_format="dummy", dtype="bfloat16")), cfg, TOKENS)
    assert 0 < _rel_err(logits, ref) < 0.5


def test_load_config_rejects_other_quantizations() -> None:
    with pytest.raises(ValueError, match="quantization"):
        LoadConfig(quantization="int4")


def _greedy(model: loader.Qwen3HybridForCausalLM, cfg: ModelConfig, tokens: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """``n`` greedy tokens (each step a fresh prefill of the whole sequence) and the last logits."""
    seq = list(tokens)
    for _ in range(n):
        logits = prefill_logits(model, cfg, seq)
        seq.append(int(logits[-1].argmax()))
    return seq[len(tokens):], logits


@pytest.mark.slow  # the trained model, 2 x 12 prefills
def test_trained_model_quantized_at_load_equals_its_dequantized_reference() -> None:
    """The FP8 model (quantized at load) gives the greedy tokens of the same model whose FP8
    weights are dequantized into plain fp32 parameters (the reference path equals the reference)."""
    from phloem.runtime.default_model import trained_model_path

    path = trained_model_path()
    cfg = ModelConfig.from_pretrained(path)
    fp8 = loader.load_model(path, cfg, LoadConfig(quantization="fp8", dtype="float32"))
    ref = loader.load_model(path, cfg, LoadConfig(dtype="float32"))
    orig = dict(ref.named_parameters())
    params = dict(ref.named_parameters())
    copied = 0
    with torch.no_grad():
        for name, module in fp8.named_modules():
            for attr in getattr(module, "parametrizations", {}):
                params[f"{name}.{attr}"].copy_(getattr(module, attr))
                copied += 1
    assert copied >= 3 * cfg.num_hidden_layers
    prompt = [(i * 101 + 7) % cfg.vocab_size for i in range(20)]
    tokens, logits = _greedy(fp8, cfg, prompt, 12)
    ref_tokens, ref_logits = _greedy(ref, cfg, prompt, 12)
    assert tokens == ref_tokens
    assert _rel_err(logits, ref_logits) <= 1e-5
    del orig


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3.5 MoE checkpoint whose TP=2 column shards fall on 128 multiples (o_proj at 128,
    out_proj at 128, the shared expert's down_proj (FFN 256) at 128) and whose routed experts'
    down_proj shards at column 64, inside a scale block."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=128, shared_expert_intermediate_size=256, rms_norm_eps=1e-6,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 2, 4], "mrope_interleaved": True},
        eos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("wide")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # tests/conftest.py's _reinit_ scales: logits far from uniform, so greedy tokens are decided by
    # the weights, not by rounding (HF's std-0.02 init gives near-ties).
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 8.0, generator=gen).log())
            elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (3.0 if name == "lm_head.weight" else 1.0) / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow  # builds a checkpoint and loads it six times
def test_tp2_shards_split_block_scales_with_their_weights(wide_checkpoint: Path, tmp_path: Path) -> None:
    """Each TP=2 rank's FP8 weights, dequantized, equal that rank's shard of the dequantized
    checkpoint exactly (whose shards rebuild TP=1: test_tensor_parallel), column-parallel o_proj,
    out_proj and down_proj included. The routed experts' down_proj (column 64 at TP=2) is kept
    unquantized here, and refused with a clear error when quantized."""
    fp8_path, deq_path = fp8_checkpoint(wide_checkpoint, tmp_path, keep=r"experts\.\d+\.down_proj")
    cfg = ModelConfig.from_pretrained(fp8_path)
    for rank in range(2):
        tp = TPGroup(rank, 2, torch.device("cpu"))
        ours = loader.load_model(fp8_path, cfg, LoadConfig(), tp)
        ref = dict(loader.load_model(deq_path, cfg, LoadConfig(), tp).named_parameters())
        fp8 = set()
        for name, module in ours.named_modules():
            for attr in getattr(module, "parametrizations", {}):
                fp8.add(f"{name}.{attr}")
                assert torch.equal(getattr(module, attr), ref[f"{name}.{attr}"]), (rank, name, attr)
        for kind in ("o_proj.weight", "out_proj.weight", "qkv_proj.weight", "experts.gate_up_proj"):
            assert any(n.endswith(kind) for n in fp8), kind
    bad, _ = fp8_checkpoint(wide_checkpoint, tmp_path / "all")
    with pytest.raises(ValueError, match="column shard starting at 64"):
        loader.load_model(bad, cfg, LoadConfig(), TPGroup(1, 2, torch.device("cpu")))


def test_tp2_row_shards_on_unaligned_rows(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """Qwen3-Next's per-key-head in_proj_qkvz and the q/k/v, gate/up rows shard at rows that are
    not 128 multiples: the row-expanded scales follow them (column-parallel tensors kept bf16)."""
    fp8_path, deq_path = fp8_checkpoint(tiny_checkpoint("Qwen3NextForCausalLM"), tmp_path, keep=r"o_proj|out_proj|down_proj")
    cfg = ModelConfig.from_pretrained(fp8_path)
    for rank in range(2):
        tp = TPGroup(rank, 2, torch.device("cpu"))
        model = loader.load_model(fp8_path, cfg, LoadConfig(), tp)
        ref = dict(loader.load_model(deq_path, cfg, LoadConfig(), tp).named_parameters())
        n_fp8 = 0
        for name, module in model.named_modules():
            for attr in getattr(module, "parametrizations", {}):
                n_fp8 += 1
                assert torch.equal(getattr(module, attr), ref[f"{name}.{attr}"]), (rank, name)
        assert n_fp8 >= cfg.num_hidden_layers


@pytest.mark.slow  # two engines, prefill + decode + a prefix hit
def test_engine_on_fp8_checkpoint_gives_the_dequantized_checkpoints_tokens(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """The whole engine (scheduler, paged cache, prefix hits, batched decode) on FP8 weights gives
    the tokens of the same engine on the dequantized fp32 checkpoint."""
    from phloem.engine import CacheConfig, Engine, SamplingParams

    fp8_path, deq_path = fp8_checkpoint(tiny_checkpoint("Qwen3_5MoeForCausalLM"), tmp_path)
    options = dict(cache=CacheConfig(page_size=16, num_pages=64, num_state_slots=16))
    prompts = [[(i * 7 + j) % 256 for j in range(n)] for i, n in enumerate((5, 23, 40))]
    params = SamplingParams(max_tokens=10)
    outs = []
    for path in (fp8_path, deq_path):
        engine = Engine.from_pretrained(path, **options)
        try:
            first = engine.generate(prompts, params)
            again = engine.generate([p + o.token_ids for p, o in zip(prompts, first)], params)  # prefix hits
            outs.append(([o.token_ids for o in first], [o.token_ids for o in again], [o.num_cached_tokens for o in again]))
        finally:
            engine.close()
    assert outs[0] == outs[1]
    assert all(n > 0 for n in outs[0][2])


def test_expert_parallel_ranks_zero_the_fp8_experts_they_do_not_hold(wide_checkpoint: Path, tmp_path: Path) -> None:
    """With experts split whole across two ranks, each rank's FP8 experts equal the dequantized
    checkpoint's on that rank, zero rows included (their scales are defined, not garbage)."""
    fp8_path, deq_path = fp8_checkpoint(wide_checkpoint, tmp_path, keep=r"experts\.\d+\.down_proj|o_proj|out_proj")
    cfg = ModelConfig.from_pretrained(fp8_path)
    for rank in range(2):
        tp = TPGroup(rank, 2, torch.device("cpu"), expert_parallel=True)
        model = loader.load_model(fp8_path, cfg, LoadConfig(), tp)
        ref = dict(loader.load_model(deq_path, cfg, LoadConfig(), tp).named_parameters())
        checked = 0
        for name, module in model.named_modules():
            if name.endswith("mlp.experts") and "gate_up_proj" in getattr(module, "parametrizations", {}):
                w = module.gate_up_proj
                assert torch.isfinite(w).all() and torch.equal(w, ref[f"{name}.gate_up_proj"]), (rank, name)
                checked += 1
        assert checked


@pytest.mark.slow  # a two-rank tensor-parallel process group over gloo
def test_tp2_engine_on_fp8_checkpoint_gives_tp1_tokens(wide_checkpoint: Path, tmp_path: Path) -> None:
    """TP=2 over gloo on FP8 weights (column-parallel o_proj / out_proj / shared down_proj FP8)
    gives TP=1's tokens, prefix hits included."""
    from phloem.engine import CacheConfig, Engine, SamplingParams
    from phloem.engine.config import ParallelConfig

    fp8_path, _ = fp8_checkpoint(wide_checkpoint, tmp_path, keep=r"experts\.\d+\.down_proj")
    options = dict(cache=CacheConfig(page_size=16, num_pages=64, num_state_slots=16))
    prompts = [[(i * 11 + j * 3) % 256 for j in range(n)] for i, n in enumerate((9, 33))]
    params = SamplingParams(max_tokens=8)
    outs = []
    for parallel in (ParallelConfig(), ParallelConfig(tensor_parallel_size=2)):
        engine = Engine.from_pretrained(fp8_path, parallel=parallel, **options)
        try:
            first = engine.generate(prompts, params)
            again = engine.generate([p + o.token_ids for p, o in zip(prompts, first)], params)
            outs.append(([o.token_ids for o in first], [o.token_ids for o in again], [o.num_cached_tokens for o in again]))
        finally:
            engine.close()
    assert outs[0] == outs[1]
    assert all(n > 0 for n in outs[0][2])


@pytest.mark.slow  # the trained model, FP8 and fp32, with its MTP layer
def test_trained_model_fp8_against_its_fp32_weights_and_mtp(tmp_path: Path) -> None:
    """Quantizing the trained model at load costs little accuracy: next-token argmax agrees with
    the fp32 model at >= 90 % of 64 prompt positions (observed 96.9 %; max-abs logit error 0.28 x
    the logit scale, 2.4 on 8.6: this 128-wide model has few weights per output to average the
    rounding over). And its MTP layer, FP8 as published, loads with its scales (``mtp.*``)."""
    from phloem.engine.config import SpeculativeConfig
    from phloem.runtime.default_model import trained_model_path

    path = trained_model_path()
    cfg = ModelConfig.from_pretrained(path)
    fp8 = loader.load_model(path, cfg, LoadConfig(quantization="fp8", dtype="float32"))
    ref = loader.load_model(path, cfg, LoadConfig(dtype="float32"))
    prompt = [(i * 101 + 7) % cfg.vocab_size for i in range(64)]
    ours, full = prefill_logits(fp8, cfg, prompt), prefill_logits(ref, cfg, prompt)
    agree = (ours.argmax(-1) == full.argmax(-1)).float().mean().item()
    print(f"trained model FP8 vs fp32: argmax agreement {agree:.3f}, max-abs / scale {_rel_err(ours, full):.3f}")
    assert agree >= 0.9 and 0 < _rel_err(ours, full) < 0.5
    fp8_path, deq_path = fp8_checkpoint(path, tmp_path)
    mtp = SpeculativeConfig(method="mtp", num_draft_tokens=1)
    model = loader.load_model(fp8_path, cfg, LoadConfig(), speculative=mtp)
    want = dict(loader.load_model(deq_path, cfg, LoadConfig(), speculative=mtp).named_parameters())
    in_mtp = 0
    for name, module in model.named_modules():
        for attr in getattr(module, "parametrizations", {}):
            assert torch.equal(getattr(module, attr), want[f"{name}.{attr}"]), name
            in_mtp += name.startswith("mtp.")
    assert in_mtp >= 3  # its attention / MoE projections


def test_scale_files_are_opened_once_per_load(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file is opened a few times per load (names, shapes, tensors, scales), not once per
    scale: a large shard's header is megabytes of JSON."""
    fp8_path, _ = fp8_checkpoint(tiny_checkpoint("Qwen3_5MoeForCausalLM"), tmp_path, files=3)
    weight_map = json.loads((fp8_path / "model.safetensors.index.json").read_text())["weight_map"]
    num_scales = sum(name.endswith("_scale_inv") for name in weight_map)
    opens: list[str] = []
    real = loader.safe_open

    def counting(file: Any, *args: Any, **kwargs: Any) -> Any:
        opens.append(str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", counting)
    loader.load_model(fp8_path, ModelConfig.from_pretrained(fp8_path), LoadConfig(show_progress=False))
    assert len(opens) <= 4 * 3 < num_scales, opens


def test_weight_operand_hands_ops_the_stored_fp8_bytes() -> None:
    from torch import nn

    from phloem.engine.models._fp8 import dequantize_on_read, make_fp8, weight_operand
    from phloem.kernels.linear.fp8 import Fp8Weight, dense, fp8_block_quantize

    plain = nn.Linear(300, 8, bias=False)
    assert weight_operand(plain, "weight") is plain.weight
    m = nn.Linear(300, 8, bias=False)
    q, s = fp8_block_quantize(torch.randn(8, 300), (1, 128))
    make_fp8(m, "weight")
    m.weight.data.copy_(q)
    m.weight_scale_inv.data.copy_(s)
    dequantize_on_read(m, "weight", torch.bfloat16)
    op = weight_operand(m, "weight")
    assert isinstance(op, Fp8Weight) and op.data.dtype == torch.float8_e4m3fn and op.shape == (8, 300)
    assert op.scale_inv.shape == (8, 3) and torch.equal(op.data.view(torch.uint8), q.view(torch.uint8))
    assert dense(op).dtype == torch.bfloat16 and torch.equal(dense(op), m.weight)

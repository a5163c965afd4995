"""``Qwen3HybridForCausalLM`` + ``engine.loader`` against Hugging Face transformers on tiny checkpoints.

Tolerances, on the logits of every token a case produces, with ``scale = max(1, max|hf|)``
(about 10-15 here; ~50 for the tied checkpoint, whose lm_head is the unit-variance embedding):

- fp32: ``max|ours - hf| <= 1e-4 * scale``. Observed <= 9e-6 * scale (max-abs <= 1.1e-4).
- bf16, ours vs HF both in bf16: ``max|ours - hf| <= 2e-2 * scale``. Observed <= 7.6e-3 * scale
  (max-abs 6.25e-2: one bf16 ulp of a logit in [8, 16)).
- Both: the same greedy token wherever HF's top-2 margin exceeds twice the tolerance.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from phloem.engine.config import LoadConfig, ModelConfig
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.loader import load_model
from phloem.engine.models import Qwen3HybridForCausalLM

PAGE_SIZE = 4
MAX_PAGES = 16  # per request: 64 tokens
NUM_SLOTS = 8
FP32_REL_TOL = 1e-4
BF16_REL_TOL = 2e-2


@dataclass(frozen=True)
class Case:
    arch: str
    layout: str = "plain"
    experts: str = "per_expert"
    num_layers: int = 4
    tie: bool = False

    @property
    def id(self) -> str:
        extra = [self.experts] if self.experts != "per_expert" else []
        extra += [f"{self.num_layers}l"] if self.num_layers != 4 else []
        extra += ["tied"] if self.tie else []
        return "-".join([self.arch.removesuffix("ForCausalLM"), self.layout, *extra])


ARCHS = ("Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")
CASES = [Case(a, layout) for a in ARCHS for layout in ("plain", "language_model")] + [
    Case("Qwen3_5MoeForCausalLM", "language_model", "fused"),
    Case("Qwen3NextForCausalLM", "plain", "fused"),
    Case("Qwen3_5MoeForCausalLM", num_layers=8),
    Case("Qwen3_5ForCausalLM", tie=True),
]


@dataclass(frozen=True)
class Step:
    """One request's share of a batch: ``token_ids`` at positions ``num_cached...``."""

    req_idx: int
    token_ids: Sequence[int]
    num_cached: int
    read_slot: int
    write_slot: int


def _page(req_idx: int, j: int) -> int:
    # Request i owns pages 1 + i*MAX_PAGES ...; page 0 is never used, so a stray index shows.
    return 1 + req_idx * MAX_PAGES + j


def make_batch(steps: Sequence[Step], device: str = "cpu") -> ForwardBatch:
    ids: list[int] = []
    positions: list[int] = []
    for s in steps:
        ids += list(s.token_ids)
        positions += range(s.num_cached, s.num_cached + len(s.token_ids))
    owners = [s.req_idx for s in steps for _ in s.token_ids]
    slot_mapping = [_page(r, p // PAGE_SIZE) * PAGE_SIZE + p % PAGE_SIZE for r, p in zip(owners, positions)]
    query_lens = tuple(len(s.token_ids) for s in steps)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)

    def t(x: Sequence[object], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=t(ids, torch.int64),
        positions=t(positions, torch.int64),
        query_start_loc=qsl.to(device),
        seq_lens=t([s.num_cached + len(s.token_ids) for s in steps], torch.int32),
        page_table=t([[_page(s.req_idx, j) for j in range(MAX_PAGES)] for s in steps], torch.int32),
        slot_mapping=t(slot_mapping, torch.int64),
        read_slots=t([s.read_slot for s in steps], torch.int64),
        write_slots=t([s.write_slot for s in steps], torch.int64),
        has_initial_state=t([s.num_cached > 0 for s in steps], torch.bool),
        logits_indices=torch.arange(len(ids), device=device),
        query_lens_cpu=query_lens,
        is_decode=all(len(s.token_ids) == 1 and s.num_cached > 0 for s in steps),
    )


def make_caches(cfg: ModelConfig, dtype: torch.dtype) -> ModelCaches:
    """KV pages hold large finite garbage (never-written positions must not be attended); state
    slots are NaN (a slot without initial state must never be read)."""
    gen = torch.Generator().manual_seed(7)
    num_pages = 1 + 4 * MAX_PAGES
    kv_shape = (len(cfg.full_attention_layers), num_pages, 2, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    num_gdn = len(cfg.linear_attention_layers)
    conv_shape = (num_gdn, NUM_SLOTS, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1)
    heads = (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    ssm_shape = (num_gdn, NUM_SLOTS, *heads)
    return ModelCaches(
        kv=(torch.randn(kv_shape, generator=gen) * 100).to(dtype),
        conv=torch.full(conv_shape, float("nan"), dtype=dtype),
        ssm=torch.full(ssm_shape, float("nan")),
    )


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model: Qwen3HybridForCausalLM, steps: Sequence[Step], caches: ModelCaches) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(make_batch(steps), caches))


def hf_logits(hf: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([list(tokens)])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel_tol: float = FP32_REL_TOL) -> float:
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= rel_tol * scale, f"max-abs {err:.3e} > {rel_tol:g} * scale {scale:.2f}"
    margin = ref.topk(2, dim=-1).values.diff(dim=-1).abs().squeeze(-1)
    clear = margin > 2 * rel_tol * scale
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear]), "greedy tokens differ"
    return err / scale


def load(tiny_checkpoint: Callable[..., Path], case: Case, dtype: torch.dtype = torch.float32):
    path = tiny_checkpoint(case.arch, case.layout, case.experts, dtype, case.num_layers, case.tie)
    cfg = ModelConfig.from_pretrained(path)
    return load_model(path, cfg, LoadConfig()), cfg


@pytest.fixture(params=CASES, ids=lambda c: c.id)
def case(request: pytest.FixtureRequest) -> Case:
    return request.param


def test_prefill_one_prompt(case: Case, tiny_checkpoint, hf_model) -> None:
    model, cfg = load(tiny_checkpoint, case)
    tokens = prompt(13, seed=1)
    ours = run(model, [Step(0, tokens, 0, read_slot=3, write_slot=2)], make_caches(cfg, torch.float32))
    assert_logits_close(ours, hf_logits(hf_model(case.arch, num_layers=case.num_layers, tie=case.tie), tokens))


def test_prefill_varlen_batch(case: Case, tiny_checkpoint, hf_model) -> None:
    model, cfg = load(tiny_checkpoint, case)
    hf = hf_model(case.arch, num_layers=case.num_layers, tie=case.tie)
    a, b = prompt(11, seed=2), prompt(5, seed=3)
    ours = run(model, [Step(0, a, 0, 1, 1), Step(1, b, 0, 2, 2)], make_caches(cfg, torch.float32))
    assert_logits_close(ours[:11], hf_logits(hf, a))
    assert_logits_close(ours[11:], hf_logits(hf, b))


def test_prefill_then_decode(case: Case, tiny_checkpoint, hf_model) -> None:
    model, cfg = load(tiny_checkpoint, case)
    hf = hf_model(case.arch, num_layers=case.num_layers, tie=case.tie)
    _check_decode(model, cfg, hf, torch.float32, FP32_REL_TOL)


def _check_decode(model, cfg, hf, dtype: torch.dtype, rel_tol: float, num_steps: int = 6) -> None:
    """Two prompts prefilled together, then decoded together on HF's greedy tokens; the state
    slots ping-pong (read one, write the other) as after a fork."""
    seqs = [prompt(9, seed=4), prompt(6, seed=5)]
    for _ in range(num_steps):
        for seq in seqs:
            seq.append(int(hf_logits(hf, seq)[-1].argmax()))
    refs = [hf_logits(hf, seq) for seq in seqs]
    lens = [9, 6]
    caches = make_caches(cfg, dtype)
    prefill = run(model, [Step(i, seqs[i][: lens[i]], 0, 7, 2 * i) for i in range(2)], caches)
    assert_logits_close(prefill[:9], refs[0][:9], rel_tol)
    assert_logits_close(prefill[9:], refs[1][:6], rel_tol)
    for step in range(num_steps):
        read, write = (step % 2, (step + 1) % 2)
        steps = [
            Step(i, [seqs[i][lens[i] + step]], lens[i] + step, 2 * i + read, 2 * i + write) for i in range(2)
        ]
        logits = run(model, steps, caches)
        for i in range(2):
            assert_logits_close(logits[i : i + 1], refs[i][lens[i] + step : lens[i] + step + 1], rel_tol)


def test_chunked_prefill(case: Case, tiny_checkpoint, hf_model) -> None:
    model, cfg = load(tiny_checkpoint, case)
    tokens = prompt(23, seed=6)
    caches = make_caches(cfg, torch.float32)
    # The split is mid-page (10 % PAGE_SIZE != 0); chunk 2 reads slot 1 and writes slot 2.
    first = run(model, [Step(0, tokens[:10], 0, read_slot=5, write_slot=1)], caches)
    checkpoint = caches.conv[:, 1].clone(), caches.ssm[:, 1].clone()
    second = run(model, [Step(0, tokens[10:], 10, read_slot=1, write_slot=2)], caches)
    assert torch.equal(caches.conv[:, 1], checkpoint[0]) and torch.equal(caches.ssm[:, 1], checkpoint[1])
    ref = hf_logits(hf_model(case.arch, num_layers=case.num_layers, tie=case.tie), tokens)
    assert_logits_close(torch.cat((first, second)), ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_decode(arch: str, tiny_checkpoint, hf_model) -> None:
    model, cfg = load(tiny_checkpoint, Case(arch), torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    _check_decode(model, cfg, hf_model(arch, dtype=torch.bfloat16), torch.bfloat16, BF16_REL_TOL)


def test_text_mrope_is_plain_rope() -> None:
    """Qwen3.5's interleaved M-RoPE with equal t/h/w positions equals the plain partial RoPE."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from phloem.kernels.attention.rope import apply_partial_rope, rope_inv_freq

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    config = Qwen3_5MoeTextConfig(head_dim=256, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope)
    positions = torch.arange(0, 5000, 37)
    q, k = torch.randn(len(positions), 4, 256), torch.randn(len(positions), 2, 256)
    cos, sin = Qwen3_5MoeTextRotaryEmbedding(config)(q, positions[None, None].expand(3, 1, -1))
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_ours, k_ours = apply_partial_rope(q, k, positions, rope_inv_freq(64, 1e7))
    torch.testing.assert_close(q_ours, q_ref[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(k_ours, k_ref[0].transpose(0, 1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_load_format(arch: str, tiny_checkpoint) -> None:
    path = tiny_checkpoint(arch)
    cfg = ModelConfig.from_pretrained(path)
    real = load_model(path, cfg, LoadConfig())
    dummy = load_model(path, cfg, LoadConfig(load_format="dummy"))
    again = load_model(path, cfg, LoadConfig(load_format="dummy"))
    other_seed = load_model(path, cfg, LoadConfig(load_format="dummy", seed=1))
    shapes = {n: tuple(p.shape) for n, p in real.named_parameters()}
    assert {n: tuple(p.shape) for n, p in dummy.named_parameters()} == shapes
    for name, p in dummy.named_parameters():
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu", name
        assert torch.isfinite(p).all(), name
        assert torch.equal(p, dict(again.named_parameters())[name]), f"{name} not deterministic"
    gdn = dummy.model.layers[0].linear_attn
    assert torch.equal(gdn.dt_bias, torch.ones_like(gdn.dt_bias))
    assert (gdn.A_log.float().exp() >= 0.0099).all() and (gdn.A_log.float().exp() <= 16.1).all()
    assert not torch.equal(dummy.model.embed_tokens.weight, other_seed.model.embed_tokens.weight)
    logits = run(dummy, [Step(0, prompt(9, seed=8), 0, 0, 1)], make_caches(cfg, torch.bfloat16))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_real_shapes_build_on_meta() -> None:
    """Qwen3.5-35B-A3B's text model (transformers' default config) is 34.66B parameters (69 GB bf16)."""
    from transformers import Qwen3_5MoeTextConfig

    raw = Qwen3_5MoeTextConfig().to_dict() | {"architectures": ["Qwen3_5MoeForCausalLM"]}
    with torch.device("meta"):
        model = Qwen3HybridForCausalLM(ModelConfig.from_dict(raw))
    assert sum(p.numel() for p in model.parameters()) == 34_660_610_688
    # 256 routed experts + the shared expert stored as expert 256 (same parameter count as HF).
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (257, 1024, 2048)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dummy_load_on_cuda(tiny_checkpoint) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    model = load_model(path, ModelConfig.from_pretrained(path), LoadConfig(load_format="dummy", device="cuda"))
    assert all(p.is_cuda for p in model.parameters()) and model.rope_inv_freq.is_cuda


def _rewrite(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(src, dst)
    with safe_open(dst / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


BAD_CHECKPOINTS = {
    "missing": (
        {"model.layers.3.self_attn.k_norm.weight": None},
        r"missing weight 'model\.layers\.3\.self_attn\.k_norm\.weight'",
    ),
    "missing-expert-part": (
        {"model.layers.1.mlp.experts.5.up_proj.weight": None},
        r"missing weight 'model\.layers\.1\.mlp\.experts\.gate_up_proj'.*\(5, 'up', None\)",
    ),
    "missing-qwen3next-ba": (
        {"model.layers.0.linear_attn.in_proj_ba.weight": None},
        r"missing weight 'model\.layers\.0\.linear_attn\.in_proj_[ab]\.weight'",
    ),
    "unknown": (
        {"model.layers.0.linear_attn.bogus": torch.zeros(2)},
        r"unknown weight 'model\.layers\.0\.linear_attn\.bogus'",
    ),
    "unknown-layer": (
        {"model.layers.9.input_layernorm.weight": torch.zeros(64)},
        r"unknown weight 'model\.layers\.9\.input_layernorm\.weight'",
    ),
    "bad-shape": ({"model.norm.weight": torch.zeros(32)}, r"'model\.norm\.weight': expected shape \(64,\)"),
}


@pytest.mark.parametrize(("changes", "message"), BAD_CHECKPOINTS.values(), ids=BAD_CHECKPOINTS.keys())
def test_bad_checkpoint_raises(changes: dict, message: str, tiny_checkpoint, tmp_path: Path) -> None:
    """A tensor mapped to ``None`` is removed, any other is added or replaced."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in changes.items():
            if tensor is None:
                del tensors[name]
            else:
                tensors[name] = tensor

    path = _rewrite(tiny_checkpoint("Qwen3NextForCausalLM"), tmp_path / "ckpt", edit)
    with pytest.raises(ValueError, match=message):
        load_model(path, ModelConfig.from_pretrained(path), LoadConfig())

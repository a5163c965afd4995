"""The MTP layer (``engine.models.mtp``): loaded and run as the training reference runs it.

* On the trained built-in model (fp32): the MTP step's logits equal those of the training-time
  implementation (``tools/train/modeling.py``'s ``MTP`` on transformers' trunk) for a batch of
  sequences, and ``propose_drafts``' recursion drafts what that reference drafts when it is run
  on the growing sequence (its own state and draft appended at the next position).
* Its top-1 accuracy on held-out text (the built-in model's held-out corpus,
  ``tools/train/prepare.py``: not trained on) is the documented 54.2 % within a few points, and
  the drafts' agreement with the trunk's own greedy continuation is measured (printed).
* Tiny checkpoints of the three architectures with ``mtp.*`` tensors load with speculation on
  (plain and published layouts, fused and per-expert experts) and run; dummy weights cover it;
  a checkpoint without ``mtp.*`` is refused with a clear error.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from phloem.engine.config import EngineConfig, LoadConfig, ModelConfig, SpeculativeConfig
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.loader import load_model
from phloem.engine.models.mtp import MultiTokenPredictor, mtp_kv_layers, propose_drafts, shifted_ids
from phloem.runtime.builtin_model import trained_model_path

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
PAGE_SIZE = 16
MAX_PAGES = 24  # per request: 384 tokens
FP32_REL_TOL = 1e-4
ARCHS = ("Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")
DOCUMENTED_MTP_TOP1 = 0.542  # docs/default-model.md, runtime/_trained_model/training/eval.json


# --- a varlen batch over per-request page ranges, and caches with the MTP layer's KV ------------


def _page(req: int, j: int) -> int:
    return 1 + req * MAX_PAGES + j  # page 0 is never used


def make_batch(seqs: Sequence[Sequence[int]], cached: Sequence[int], slots: Sequence[int] | None = None) -> ForwardBatch:
    """Request ``i`` runs ``seqs[i]`` at positions ``cached[i]...``; GDN state in slot ``slots[i]``
    (read when ``cached[i] > 0``, then written)."""
    slots = list(range(len(seqs))) if slots is None else list(slots)
    ids, positions, mapping = [], [], []
    for i, (seq, start) in enumerate(zip(seqs, cached)):
        for p in range(start, start + len(seq)):
            positions.append(p)
            mapping.append(_page(i, p // PAGE_SIZE) * PAGE_SIZE + p % PAGE_SIZE)
        ids += list(seq)
    lens = [len(s) for s in seqs]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64),
        seq_lens=torch.tensor([c + n for c, n in zip(cached, lens)], dtype=torch.int32),
        page_table=torch.tensor([[_page(i, j) for j in range(MAX_PAGES)] for i in range(len(seqs))], dtype=torch.int32),
        slot_mapping=torch.tensor(mapping, dtype=torch.int64),
        read_slots=torch.tensor(slots, dtype=torch.int64),
        write_slots=torch.tensor(slots, dtype=torch.int64),
        has_initial_state=torch.tensor([c > 0 for c in cached]),
        logits_indices=torch.arange(len(ids)),
        query_lens_cpu=tuple(lens),
        is_decode=all(n == 1 and c > 0 for n, c in zip(lens, cached)),
    )


def make_caches(cfg: ModelConfig, num_seqs: int, dtype: torch.dtype = torch.float32) -> ModelCaches:
    """KV of the trunk's attention layers and the MTP layer's (``mtp_kv_layers``); never-written
    KV is large garbage, never-written state NaN, so a stray read shows."""
    gen = torch.Generator().manual_seed(7)
    num_pages = 1 + num_seqs * MAX_PAGES
    kv = (mtp_kv_layers(cfg), num_pages, 2, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    gdn = len(cfg.linear_attention_layers)
    return ModelCaches(
        kv=(torch.randn(kv, generator=gen) * 100).to(dtype),
        conv=torch.full((gdn, num_seqs, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), float("nan"), dtype=dtype),
        ssm=torch.full((gdn, num_seqs, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                        cfg.linear_value_head_dim), float("nan")),
    )  # fmt: skip


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, rel_tol: float = FP32_REL_TOL) -> None:
    scale = max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= rel_tol * scale, f"max-abs {err:.3e} > {rel_tol:g} * scale {scale:.2f}"


# --- the trained built-in model against the training reference ---------------------------------


def _train_module(name: str):
    sys.path.insert(0, str(ROOT / "tools" / "train"))
    try:
        spec = importlib.util.spec_from_file_location(f"train_{name}", ROOT / "tools" / "train" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "tools" / "train"))


@pytest.fixture(scope="module")
def trained() -> tuple:
    path = trained_model_path()
    cfg = ModelConfig.from_pretrained(path)
    model = load_model(path, cfg, LoadConfig(dtype="float32"), speculative=SpeculativeConfig("mtp", 3))
    return model, cfg


@pytest.fixture(scope="module")
def reference() -> tuple:
    """transformers' trunk and the training-time MTP layer (``tools/train/modeling.py``), fp32."""
    from transformers import AutoModelForCausalLM

    modeling = _train_module("modeling")
    hf = AutoModelForCausalLM.from_pretrained(trained_model_path(), dtype=torch.float32).eval()
    return hf, modeling.load_mtp(trained_model_path(), hf).eval(), modeling


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(trained_model_path())


TEXTS = (
    "def mean(xs):\n    return sum(xs) / len(xs)\n",
    "<|im_start|>user\nWhat is the weather in Rome?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n",
    "The module provides a simple way to parse command-line arguments, and the class",
)


def _ref_mtp(reference, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training reference's MTP over one sequence (causal, positions 0..T-1): (h', logits)."""
    hf, mtp, modeling = reference
    rope = modeling.position_embeddings(hf, hidden)
    return modeling.mtp_step(hf, mtp, tokens, hidden, rope)


@torch.no_grad()
def test_mtp_step_matches_training_reference(trained, reference, tokenizer) -> None:
    model, cfg = trained
    hf = reference[0]
    seqs = [tokenizer.encode(t) for t in TEXTS]
    inputs, nexts = [s[:-1] for s in seqs], torch.tensor([s[-1] for s in seqs])
    caches = make_caches(cfg, len(seqs))
    batch = make_batch(inputs, [0] * len(seqs))
    hidden = model(batch, caches)
    mtp = model.mtp
    assert isinstance(mtp, MultiTokenPredictor) and mtp.cache_idx == len(cfg.full_attention_layers)
    ids = shifted_ids(batch, nexts)
    out = mtp(model.model.embed_tokens(ids), hidden, batch, caches, model.rope_inv_freq)
    logits = model.compute_logits(out)
    start = 0
    for seq in seqs:
        n = len(seq) - 1
        x = torch.tensor([seq])
        h = hf.model(input_ids=x[:, :-1]).last_hidden_state
        assert_logits_close(hidden[start : start + n], h[0], FP32_REL_TOL)
        _, ref_logits = _ref_mtp(reference, x[:, 1:], h)
        assert_logits_close(logits[start : start + n], ref_logits[0])
        assert torch.equal(logits[start : start + n].argmax(-1), ref_logits[0].argmax(-1))
        start += n


@torch.no_grad()
def test_drafts_match_reference_recursion(trained, reference, tokenizer) -> None:
    """``propose_drafts`` (prefill, then one decode step) drafts what the reference drafts: step
    ``j`` is the reference MTP over the sequence grown by the previous steps' states and drafts."""
    model, cfg = trained
    hf = reference[0]
    k = 3
    seqs = [tokenizer.encode(t) for t in TEXTS]
    caches = make_caches(cfg, len(seqs))
    prompts = [s[:-2] for s in seqs]
    prefill = make_batch(prompts, [0] * len(seqs))
    hidden = model(prefill, caches)
    last = prefill.query_start_loc[1:] - 1
    first = model.compute_logits(hidden[last]).argmax(-1)
    propose_drafts(model, prefill, caches, hidden, first, k)  # fills the MTP KV of the prompts
    # One decode step on the true next tokens (the MTP KV of the prompt's positions stays valid).
    step = make_batch([[s[-2]] for s in seqs], [len(p) for p in prompts])
    hidden = model(step, caches)
    nexts = torch.tensor([s[-1] for s in seqs])
    drafts = propose_drafts(model, step, caches, hidden, nexts, k)
    assert drafts.shape == (len(seqs), k)
    for i, seq in enumerate(seqs):
        x = torch.tensor([seq])
        h = hf.model(input_ids=x[:, :-1]).last_hidden_state  # trunk states at 0..n-1
        tokens, states = x[:, 1:], h
        expected = []
        for _ in range(k):
            h_mtp, logits = _ref_mtp(reference, tokens, states)
            top2 = logits[0, -1].topk(2).values
            assert top2[0] - top2[1] > 1e-3, "reference top-2 tie: pick other text"
            draft = logits[0, -1].argmax()
            expected.append(int(draft))
            tokens = torch.cat((tokens, draft.view(1, 1)), dim=1)
            states = torch.cat((states, h_mtp[:, -1:]), dim=1)
        assert drafts[i].tolist() == expected, f"sequence {i}"


# --- acceptance on held-out text ----------------------------------------------------------------


@pytest.fixture(scope="module")
def heldout_tokens(tokenizer) -> torch.Tensor:
    """The built-in model's held-out corpus (every 20th document of ``prepare.py``'s seeded
    corpus, not trained on), tokenized as ``tools/train/eval.py`` tokenizes it."""
    prepare = _train_module("prepare")
    _, held = prepare.split(prepare.build_documents(prepare.DEFAULT_STDLIB_BYTES, prepare.DEFAULT_TRANSCRIPTS))
    return torch.tensor(tokenizer.encode(prepare.EOT.join(held) + prepare.EOT), dtype=torch.long)


@torch.no_grad()
def mtp_top1(model, cfg, tokens: torch.Tensor, windows: Sequence[int], length: int = 256, per_batch: int = 4) -> tuple[int, int, int]:
    """eval.py's step-1 measure through the engine's forward: over windows ``x`` of ``length + 1``
    tokens, the trunk reads ``x[:-1]``, the MTP layer ``h[t]`` and the true ``x[t+1]`` and predicts
    ``x[t+2]`` (t < length - 1). Returns (MTP right, trunk right on x[t+1], positions)."""
    right = lm_right = counted = 0
    for b in range(0, len(windows), per_batch):
        xs = [tokens[w * length : (w + 1) * length + 1] for w in windows[b : b + per_batch]]
        caches = make_caches(cfg, len(xs))
        batch = make_batch([x[:-1].tolist() for x in xs], [0] * len(xs))
        hidden = model(batch, caches)
        out = model.mtp(model.model.embed_tokens(shifted_ids(batch, torch.stack([x[-1] for x in xs]))), hidden,
                        batch, caches, model.rope_inv_freq)
        drafts, greedy = model.compute_logits(out).argmax(-1), model.compute_logits(hidden).argmax(-1)
        for i, x in enumerate(xs):
            rows = slice(i * length, (i + 1) * length)
            right += int((drafts[rows][: length - 1] == x[2:]).sum())
            lm_right += int((greedy[rows] == x[1:]).sum())
            counted += length - 1
    return right, lm_right, counted


def test_mtp_top1_on_heldout_text_is_the_documented_one(trained, heldout_tokens) -> None:
    """Every 8th 256-token window of the held-out text (42 of its 331; the composition of the
    whole: transcripts and standard-library text interleave). eval.py measured 54.2 % on all."""
    model, cfg = trained
    total = (len(heldout_tokens) - 1) // 256
    right, lm_right, counted = mtp_top1(model, cfg, heldout_tokens, range(0, total, 8))
    top1 = right / counted
    print(f"\nMTP step-1 top-1 on held-out text: {top1:.4f} ({right}/{counted}); trunk: {lm_right / counted:.4f}")
    assert abs(top1 - DOCUMENTED_MTP_TOP1) < 0.03


@torch.no_grad()
def greedy_agreement(model, cfg, prompts: Sequence[Sequence[int]], new_tokens: int, k: int) -> dict[str, list[float]]:
    """Greedy decoding with the trunk, drafting ``k`` tokens with ``propose_drafts`` after every
    step (no verification): how often draft ``j`` equals the trunk's own greedy token ``j`` ahead
    (``top1``) and how often drafts 1..j all do (``chain``: what verification would accept)."""
    n = len(prompts)
    caches = make_caches(cfg, n)
    batch = make_batch(prompts, [0] * n)
    seqs = [list(p) for p in prompts]
    drafts_at: list[torch.Tensor] = []  # drafts_at[s][i]: drafts after greedy token s of request i
    for _ in range(new_tokens):
        hidden = model(batch, caches)
        last = batch.query_start_loc[1:] - 1
        nxt = model.compute_logits(hidden[last]).argmax(-1)
        drafts_at.append(propose_drafts(model, batch, caches, hidden, nxt, k))
        for i in range(n):
            seqs[i].append(int(nxt[i]))
        batch = make_batch([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs])
    right, chain, counted = [0] * k, [0] * k, [0] * k
    for s, drafts in enumerate(drafts_at):
        for i in range(n):
            future = seqs[i][len(prompts[i]) + s + 1 :]
            ok = True
            for j in range(min(k, len(future))):
                hit = int(drafts[i, j]) == future[j]
                ok = ok and hit
                right[j] += hit
                chain[j] += ok
                counted[j] += 1
    return {"top1": [r / c for r, c in zip(right, counted)], "chain": [c / t for c, t in zip(chain, counted)],
            "positions": counted}


def test_drafts_agree_with_the_trunks_greedy_continuation(trained, heldout_tokens) -> None:
    """Measured, printed; the bound only says drafting works (random drafts agree ~0 %)."""
    model, cfg = trained
    prompts = [heldout_tokens[w * 256 : w * 256 + 64].tolist() for w in range(0, 331, 41)][:8]
    stats = greedy_agreement(model, cfg, prompts, new_tokens=64, k=3)
    print(f"\ndrafts vs the trunk's greedy continuation (8 prompts x 64 tokens): {json.dumps(stats)}")
    assert stats["top1"][0] > 0.4 and stats["chain"][2] > 0.2


# --- tiny checkpoints of the three architectures -----------------------------------------------


def _tiny_loads(tiny_checkpoint: Callable[..., Path], arch: str, **kw) -> tuple:
    path = tiny_checkpoint(arch, mtp=True, **kw)
    cfg = ModelConfig.from_pretrained(path)
    return load_model(path, cfg, LoadConfig(), speculative=SpeculativeConfig("mtp", 2)), cfg, path


def _run_drafts(model, cfg) -> torch.Tensor:
    seqs = [list(range(3, 14)), list(range(40, 45))]
    caches = make_caches(cfg, 2)
    batch = make_batch(seqs, [0, 0])
    hidden = model(batch, caches)
    drafts = propose_drafts(model, batch, caches, hidden, torch.tensor([7, 9]), 3)
    assert drafts.shape == (2, 3) and drafts.dtype == torch.int64
    assert ((drafts >= 0) & (drafts < cfg.vocab_size)).all()
    return drafts


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoint_loads_mtp_layer_and_matches_plain_torch(arch: str, tiny_checkpoint) -> None:
    """Every ``mtp.*`` tensor lands (the loader's coverage check), and the MTP step equals an
    independent plain-torch evaluation of the formula on the checkpoint's own tensors."""
    model, cfg, path = _tiny_loads(tiny_checkpoint, arch)
    mlp = type(model.mtp.layers[0].mlp).__name__
    assert mlp == ("SwiGluMlp" if arch == "Qwen3_5ForCausalLM" else "SparseMoe")
    seq, nxt = list(range(3, 14)), 7
    caches = make_caches(cfg, 1)
    batch = make_batch([seq], [0])
    with torch.no_grad():
        hidden = model(batch, caches)
        out = model.mtp(model.model.embed_tokens(shifted_ids(batch, torch.tensor([nxt]))), hidden, batch, caches,
                        model.rope_inv_freq)
    ref = _plain_mtp(_tensors(path), cfg, torch.tensor(seq[1:] + [nxt]), hidden)
    assert_logits_close(out, ref)
    _run_drafts(model, cfg)


@pytest.mark.parametrize("layout,experts", [("language_model", "per_expert"), ("language_model", "fused"),
                                            ("plain", "fused")])
def test_tiny_checkpoint_layouts_load_the_same_mtp_layer(layout: str, experts: str, tiny_checkpoint) -> None:
    base, _, _ = _tiny_loads(tiny_checkpoint, "Qwen3_5MoeForCausalLM")
    other, cfg, _ = _tiny_loads(tiny_checkpoint, "Qwen3_5MoeForCausalLM", layout=layout, experts=experts)
    ours, theirs = dict(base.mtp.named_parameters()), dict(other.mtp.named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert torch.equal(_run_drafts(base, cfg), _run_drafts(other, cfg))


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_load_builds_the_mtp_layer(arch: str, tiny_checkpoint) -> None:
    path = tiny_checkpoint(arch)
    cfg = ModelConfig.from_pretrained(path)
    load = LoadConfig(load_format="dummy", dtype="float32")
    plain = load_model(path, cfg, load)
    model = load_model(path, cfg, load, speculative=SpeculativeConfig("mtp", 1))
    assert plain.mtp is None and isinstance(model.mtp, MultiTokenPredictor)
    for p in model.mtp.parameters():
        assert torch.isfinite(p).all() and p.abs().sum() > 0
    # The trunk's random weights are those without speculation (the MTP layer's are drawn last).
    trunk = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        if not name.startswith("mtp."):
            assert torch.equal(p, trunk[name]), name
    _run_drafts(model, cfg)


@pytest.mark.parametrize("layout", ["plain", "language_model"])
def test_speculation_without_mtp_tensors_is_refused(layout: str, tiny_checkpoint, tmp_path: Path) -> None:
    # The tiny checkpoints without ``mtp=True`` hold no MTP layer (the published layout's stand-in
    # ``mtp.fc.weight`` is dropped here to make a folder with none at all).
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM", layout=layout)
    if layout == "language_model":
        folder = tmp_path / "no_mtp"
        folder.mkdir()
        from safetensors import safe_open

        tensors = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                tensors.update({n: f.get_tensor(n) for n in f.keys() if not n.startswith("mtp.")})
        save_file(tensors, str(folder / "model.safetensors"))
        (folder / "config.json").write_text((path / "config.json").read_text())
        path = folder
    cfg = ModelConfig.from_pretrained(path)
    with pytest.raises(ValueError, match=r"speculative: method 'mtp' needs the checkpoint's MTP layer \(mtp\.\* tensors\)"):
        load_model(path, cfg, LoadConfig(), speculative=SpeculativeConfig("mtp", 2))
    assert load_model(path, cfg, LoadConfig()).mtp is None  # speculation off: loads as before


def test_speculative_config() -> None:
    assert SpeculativeConfig.parse("mtp:3") == SpeculativeConfig("mtp", 3)
    assert SpeculativeConfig.parse(" MTP:1 ") == SpeculativeConfig("mtp", 1)
    assert SpeculativeConfig.parse(None) == SpeculativeConfig.parse("off") == SpeculativeConfig()
    assert not SpeculativeConfig().enabled and SpeculativeConfig("mtp", 2).uses_mtp
    assert EngineConfig().speculative == SpeculativeConfig()
    for bad in ("mtp", "mtp:0", "mtp:5", "eagle:2", "mtp:x", "3"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig(None, 2)


# --- an independent plain-torch MTP step over checkpoint tensors --------------------------------


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({n: f.get_tensor(n).float() for n in f.keys()})
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _plain_mtp(w: dict[str, torch.Tensor], cfg: ModelConfig, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP formula for one sequence at positions 0..T-1, from per-expert checkpoint tensors."""
    eps, d, hq, hkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    p = "mtp."
    e = w["model.embed_tokens.weight"][tokens]
    x = torch.cat((_rms(e, w[p + "pre_fc_norm_embedding.weight"], eps), _rms(hidden, w[p + "pre_fc_norm_hidden.weight"], eps)), -1)
    x = x @ w[p + "fc.weight"].T
    lp = p + "layers.0."
    t = x.shape[0]
    h = _rms(x, w[lp + "input_layernorm.weight"], eps)
    qg = (h @ w[lp + "self_attn.q_proj.weight"].T).view(t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, hq * d)
    k = (h @ w[lp + "self_attn.k_proj.weight"].T).view(t, hkv, d)
    v = (h @ w[lp + "self_attn.v_proj.weight"].T).view(t, hkv, d)
    q, k = _rms(q, w[lp + "self_attn.q_norm.weight"], eps), _rms(k, w[lp + "self_attn.k_norm.weight"], eps)
    rd = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1)[:, None], torch.cat((ang.sin(), ang.sin()), -1)[:, None]

    def rope(y: torch.Tensor) -> torch.Tensor:
        r, rest = y[..., :rd], y[..., rd:]
        half = torch.cat((-r[..., rd // 2 :], r[..., : rd // 2]), -1)
        return torch.cat((r * cos + half * sin, rest), -1)

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, hq * d)
    x = x + (attn * torch.sigmoid(gate)) @ w[lp + "self_attn.o_proj.weight"].T
    h = _rms(x, w[lp + "post_attention_layernorm.weight"], eps)
    m = lp + "mlp."
    if cfg.num_experts:
        probs = (h @ w[m + "gate.weight"].T).softmax(-1)
        top, idx = probs.topk(cfg.num_experts_per_tok, -1)
        if cfg.norm_topk_prob or cfg.architecture == "Qwen3_5MoeForCausalLM":
            top = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(h)
        for row in range(t):
            for weight, ex in zip(top[row], idx[row]):
                ep = f"{m}experts.{int(ex)}."
                out[row] += weight * _swiglu(h[row], w[ep + "gate_proj.weight"], w[ep + "up_proj.weight"],
                                             w[ep + "down_proj.weight"])
        s = m + "shared_expert."
        shared = _swiglu(h, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"])
        out = out + torch.sigmoid(h @ w[m + "shared_expert_gate.weight"].T) * shared
    else:
        out = _swiglu(h, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
    return _rms(x + out, w[p + "norm.weight"], eps)


@pytest.mark.parametrize(("layout", "experts"), [("plain", "per_expert"), ("language_model", "fused")])
def test_tp2_shards_rebuild_the_mtp_layer(layout: str, experts: str, tiny_checkpoint) -> None:
    """Each of two ranks loads its shard of the MTP layer (shard-only groups: no collectives run),
    sharded as the trunk's layers are (``mtp.fc`` by input columns); the shards rebuild the TP=1
    layer. (The TP=2 forward itself is not run here: the next piece's gloo engine test does.)"""
    from phloem.engine.parallel.group import TPGroup

    path = tiny_checkpoint("Qwen3NextForCausalLM" if layout == "plain" else "Qwen3_5MoeForCausalLM", layout, experts,
                           mtp=True)
    cfg = ModelConfig.from_pretrained(path)
    spec = SpeculativeConfig("mtp", 2)
    full = dict(load_model(path, cfg, LoadConfig(), speculative=spec).mtp.named_parameters())
    ranks = [dict(load_model(path, cfg, LoadConfig(), TPGroup(r, 2, torch.device("cpu")), speculative=spec)
                  .mtp.named_parameters()) for r in range(2)]  # fmt: skip
    assert ranks[0].keys() == full.keys()
    q, k = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for name, param in full.items():
        parts = [r[name] for r in ranks]
        if name == "fc.weight" or name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
            rebuilt = torch.cat(parts, dim=-1)
        elif name.endswith("experts.gate_up_proj"):
            halves = [p.chunk(2, dim=1) for p in parts]
            rebuilt = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)
        elif name.endswith("gate_up_proj.weight"):
            halves = [p.chunk(2) for p in parts]
            rebuilt = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif name.endswith("qkv_proj.weight"):
            split = [p.split([q, k // 2, k // 2]) for p in parts]  # q rows hold query and gate
            rebuilt = torch.cat([torch.cat([s[i] for s in split]) for i in range(3)])
        elif name.endswith(("norm.weight", "router.weight")) or name.startswith("pre_fc_norm"):
            assert torch.equal(parts[0], parts[1]), name
            rebuilt = parts[0]
        else:
            rebuilt = torch.cat(parts)
        assert rebuilt.shape == param.shape and torch.equal(rebuilt, param), name

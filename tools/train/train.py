"""Trains the built-in Qwen3.5-MoE model with its MTP layer and writes the Hugging Face folder.

    # CPU: the small preset, one thread, 18 minutes
    python3 tools/train/train.py --preset cpu --device cpu --minutes 18 --out runtime/_trained_model
    # GPU (one H200, bf16 autocast): the larger preset, 15 minutes
    python3 tools/train/train.py --preset gpu --device cuda --minutes 15 --out /tmp/phloem-gpu-model

The corpus and tokenizer come from ``prepare.py`` (run here when ``--data`` has none). The trunk
is transformers' ``Qwen3_5MoeForCausalLM`` (on the CPU its torch fallbacks for Gated DeltaNet);
the MTP layer is ``modeling.MTP``. The loss is the next-token cross-entropy, plus
``--mtp-weight`` times the MTP layer's next-next-token cross-entropy, plus (``--mtp-steps 2``)
half that weight on a second step of the MTP recursion (teacher-forced), plus the router's
load-balancing loss. AdamW, linear warm-up then cosine decay over the time budget.

Writes to ``--out``: ``config.json``, ``model.safetensors`` (the trunk and ``mtp.*``),
``tokenizer.json``, ``tokenizer_config.json`` (ChatML template), ``README.md``, and
``training/loss_curve.json`` + ``training/loss_curve.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from modeling import PRESETS, build, model_config, mtp_step, position_embeddings, to_checkpoint  # noqa: E402
from prepare import prepare  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func  # noqa: E402

from phloem.runtime._default_model_tokenizer import SPECIAL_TOKENS, tokenizer_config  # noqa: E402


def load_tokens(data: Path) -> tuple[Tokenizer, torch.Tensor, torch.Tensor]:
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))

    def encode(name: str) -> torch.Tensor:
        return torch.tensor(tok.encode((data / name).read_text(encoding="utf-8")).ids, dtype=torch.long)

    return tok, encode("train.txt"), encode("heldout.txt")


def batches(tokens: torch.Tensor, batch: int, length: int, seed: int):
    """Random windows of ``length`` tokens, forever (seeded)."""
    rng = random.Random(seed)
    high = len(tokens) - length - 1
    while True:
        starts = [rng.randrange(high) for _ in range(batch)]
        yield torch.stack([tokens[s : s + length] for s in starts])


def losses(model, mtp, x: torch.Tensor, mtp_steps: int) -> dict[str, torch.Tensor]:
    out = model.model(input_ids=x, output_router_logits=True)
    h = out.last_hidden_state
    logits = model.lm_head(h)
    vocab = logits.shape[-1]
    result = {"lm": F.cross_entropy(logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))}
    rope = position_embeddings(model, h[:, :-1])
    m, mlogits = mtp_step(model, mtp, x[:, 1:], h[:, :-1], rope)
    # Position t of the MTP sequence predicts x[t + 2].
    result["mtp1"] = F.cross_entropy(mlogits[:, :-1].reshape(-1, vocab), x[:, 2:].reshape(-1))
    if mtp_steps >= 2:
        rope2 = position_embeddings(model, m[:, :-1])
        _, m2logits = mtp_step(model, mtp, x[:, 2:], m[:, :-1], rope2)
        result["mtp2"] = F.cross_entropy(m2logits[:, :-1].reshape(-1, vocab), x[:, 3:].reshape(-1))
    cfg = model.config
    result["aux"] = load_balancing_loss_func(out.router_logits, cfg.num_experts, cfg.num_experts_per_tok, None)
    return result


@torch.no_grad()
def heldout_loss(model, held: torch.Tensor, length: int, windows: int, device: str) -> float:
    """Mean next-token loss over the first ``windows`` non-overlapping windows of held-out text
    (the curve's points: 8 windows, the first few held-out documents; the final figure: all)."""
    total, count = 0.0, 0
    for i in range(min(windows, (len(held) - 1) // length)):
        x = held[i * length : (i + 1) * length + 1].unsqueeze(0).to(device)
        logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits[0].float(), x[0, 1:], reduction="sum").item()
        count += length
    return total / max(count, 1)


def plot(curve: dict[str, list], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(values: list[float], n: int = 20) -> list[float]:
        return [sum(values[max(0, i - n + 1) : i + 1]) / len(values[max(0, i - n + 1) : i + 1])
                for i in range(len(values))]

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, color in (("lm", "train next-token", "C0"), ("mtp1", "train MTP step 1 (next-next-token)", "C1")):
        ax.plot(curve["tokens"], curve[key], color=color, lw=0.5, alpha=0.3)
        ax.plot(curve["tokens"], smooth(curve[key]), color=color, lw=1.5, label=f"{label}, mean of 20 steps")
    if curve["eval_tokens"]:
        ax.plot(curve["eval_tokens"], curve["heldout"], "o-", color="C2", ms=3,
                label="held-out next-token (first held-out windows)")
    if curve.get("unigram"):
        ax.axhline(curve["unigram"], color="gray", ls="--", lw=1, label="unigram baseline (all held-out)")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(f"phloem built-in model, preset {curve['preset']}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def unigram_loss(train: torch.Tensor, held: torch.Tensor, vocab: int) -> float:
    """Held-out cross-entropy of the training unigram distribution (add-0.5 smoothing)."""
    counts = torch.bincount(train, minlength=vocab).double() + 0.5
    logp = (counts / counts.sum()).log()
    return float(-logp[held].mean())


README = """# phloem-qwen3.5-moe-trained ({preset} preset)

A tiny `Qwen3_5MoeForCausalLM` (the real Qwen3.5-MoE layer pattern: Gated-DeltaNet layers with
gated full attention every 4th layer, attention head_dim 256 with partial RoPE, GDN head dim 128,
{experts} experts top-{topk} + a shared expert) plus one MTP layer (`mtp.*`, the Qwen3.5 /
Qwen3-Next layout), trained by Phloem's `tools/train/train.py` on a corpus it generates itself
(Python {python} standard-library sources and synthetic ChatML agent transcripts with tool calls).

{params} parameters ({mtp_params} in the MTP layer), {dtype}. Trained {minutes:.1f} minutes on {device},
{tokens} tokens. Held-out next-token loss {heldout:.3f} nats/token over all held-out text (unigram
baseline {unigram:.3f}); `tools/train/eval.py` reports it per half of the corpus and the MTP layer's
accuracy (`training/eval.json` when written there).

It writes ChatML turns, `<tool_call>` JSON for the tools it has seen (calculator, get_weather,
kv_get/kv_set, list_files/read_file/run_tests) and Python-looking code; it knows no facts and
cannot reason. See `docs/default-model.md` in the Phloem repository.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--minutes", type=float, default=18.0, help="training time budget")
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write")
    parser.add_argument("--data", type=Path, default=Path("/tmp/phloem-train-data"),
                        help="corpus folder (prepare.py writes it when it has no tokenizer.json)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on the CPU")
    parser.add_argument("--mtp-weight", type=float, default=0.5)
    parser.add_argument("--mtp-steps", type=int, choices=(1, 2), default=2)
    parser.add_argument("--eval-every", type=float, default=60.0, help="seconds between held-out evaluations")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default: the preset's)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    if not (args.data / "tokenizer.json").is_file():
        prepare(args.data)
    tok, train, held = load_tokens(args.data)
    special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    vocab = 64 * math.ceil(tok.get_vocab_size() / 64)
    config = model_config(args.preset, vocab, eos_id=special["<|im_end|>"], pad_id=special["<|endoftext|>"])
    model, mtp = build(config)
    model.to(args.device).train()
    mtp.to(args.device).train()
    params = list(model.parameters()) + list(mtp.parameters())
    n_params = sum(p.numel() for p in params)
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(f"preset {args.preset}: {n_params / 1e6:.2f}M parameters ({n_mtp / 1e6:.2f}M MTP), vocab {vocab}, "
          f"{len(train)} train / {len(held)} held-out tokens", flush=True)

    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=preset["lr"], betas=(0.9, 0.95), fused=args.device.startswith("cuda") or None)
    seq, bsz = args.seq_len or preset["seq_len"], args.batch_size or preset["batch_size"]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if args.device.startswith("cuda") else None
    unigram = unigram_loss(train, held, vocab)
    curve: dict[str, Any] = {"preset": args.preset, "unigram": unigram, "step": [], "tokens": [], "seconds": [],
                             "lm": [], "mtp1": [], "mtp2": [], "eval_tokens": [], "heldout": []}
    budget = args.minutes * 60
    warmup = 30
    start = time.monotonic()
    last_eval = start
    step = 0
    for x in batches(train, bsz, seq + 1, args.seed):
        elapsed = time.monotonic() - start
        if elapsed >= budget:
            break
        frac = elapsed / budget
        lr = preset["lr"] * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        x = x.to(args.device)
        if autocast is not None:
            with autocast:
                parts = losses(model, mtp, x, args.mtp_steps)
        else:
            parts = losses(model, mtp, x, args.mtp_steps)
        loss = parts["lm"] + args.mtp_weight * parts["mtp1"] + config["router_aux_loss_coef"] * parts["aux"]
        if "mtp2" in parts:
            loss = loss + 0.5 * args.mtp_weight * parts["mtp2"]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        curve["step"].append(step)
        curve["tokens"].append(step * bsz * seq)
        curve["seconds"].append(round(time.monotonic() - start, 2))
        for key in ("lm", "mtp1", "mtp2"):
            curve[key].append(round(parts[key].item(), 4) if key in parts else None)
        if time.monotonic() - last_eval >= args.eval_every:
            model.eval()
            curve["eval_tokens"].append(step * bsz * seq)
            curve["heldout"].append(round(heldout_loss(model, held, seq, 8, args.device), 4))
            model.train()
            last_eval = time.monotonic()
            print(f"step {step} {curve['seconds'][-1]:.0f}s lr {lr:.2e} lm {curve['lm'][-1]:.3f} "
                  f"mtp1 {curve['mtp1'][-1]:.3f} held-out {curve['heldout'][-1]:.3f} "
                  f"(unigram {unigram:.3f})", flush=True)
    trained_s = time.monotonic() - start
    model.eval()
    mtp.eval()
    final = heldout_loss(model, held, seq, len(held), args.device)  # every held-out window
    curve["eval_tokens"].append(step * bsz * seq)
    curve["heldout"].append(round(final, 4))
    print(f"done: {step} steps, {step * bsz * seq} tokens, {trained_s:.0f}s; held-out {final:.3f} "
          f"unigram {unigram:.3f}", flush=True)

    out = args.out
    (out / "training").mkdir(parents=True, exist_ok=True)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[preset["dtype"]]
    weights = to_checkpoint(model.cpu(), mtp.cpu(), dtype)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text((args.data / "tokenizer.json").read_text(encoding="utf-8"), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(special), indent=2, ensure_ascii=False)
                                               + "\n", encoding="utf-8")
    manifest = json.loads((args.data / "manifest.json").read_text())
    (out / "README.md").write_text(README.format(
        preset=args.preset, experts=config["num_experts"], topk=config["num_experts_per_tok"],
        python=manifest["python"], params=f"{n_params / 1e6:.2f}M", mtp_params=f"{n_mtp / 1e6:.2f}M",
        dtype=preset["dtype"], minutes=trained_s / 60, device=args.device, tokens=step * bsz * seq,
        heldout=final, unigram=unigram))
    curve.update(seconds_total=round(trained_s, 1), threads=args.threads, device=args.device,
                 corpus=manifest, mtp_weight=args.mtp_weight, mtp_steps=args.mtp_steps)
    (out / "training" / "loss_curve.json").write_text(json.dumps(curve) + "\n")
    plot(curve, out / "training" / "loss_curve.png")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()

"""Evaluates a model folder written by ``train.py`` on the held-out part of its corpus.

    python3 tools/train/eval.py --model runtime/_trained_model --data /tmp/phloem-train-data

Reports (and with ``--json`` writes):

* ``heldout_loss``: next-token cross-entropy (nats/token) over non-overlapping windows of the
  held-out text, and ``unigram_loss``: the held-out cross-entropy of the training text's token
  frequencies (add-0.5 smoothing) -- the baseline a model that ignores context reaches;
* ``mtp_top1``: the MTP layer's top-1 accuracy at 1, 2 and 3 steps of its own recursion. Step 1
  reads the trunk's hidden state at ``t`` and the true token ``t+1`` and predicts ``t+2``; step
  ``k`` reads step ``k-1``'s MTP hidden state and its own predicted token and predicts ``t+1+k``
  (run over all positions in parallel, causal attention over the same step's sequence).
  ``mtp_chain`` is the fraction of positions whose steps 1..k are all right (what speculative
  decoding with k drafts would accept in full); ``lm_top1`` is the trunk's own next-token accuracy;
* ``samples``: greedy completions (transformers) of a few prompts, and whether the agent prompt's
  completion holds a ``<tool_call>``.

The corpus folder comes from ``prepare.py`` (same arguments as for training).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from modeling import load_mtp, mtp_step, position_embeddings  # noqa: E402
from prepare import CALCULATOR, EOT, LIST_FILES, READ_FILE, RUN_TESTS, WEATHER  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

# docs/examples/agent.py's opening turn.
AGENT_SYSTEM = "You are a careful coding agent. Use the tools, read their results, then answer."
AGENT_TASK = "The test in test_stats.py fails. Find out why and fix stats.py."
CHATS = [
    ("agent", [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": AGENT_TASK}],
     [LIST_FILES, READ_FILE, RUN_TESTS]),
    ("calculator", [{"role": "user", "content": "What is 17 * 23?"}], [CALCULATOR]),
    ("weather", [{"role": "user", "content": "What is the weather in Rome?"}], [WEATHER]),
    ("chat", [{"role": "user", "content": "Who are you?"}], []),
]
TEXTS = [("code", "def mean(xs):\n"), ("prose", "The module")]


@torch.no_grad()
def score(model, mtp, tokens: torch.Tensor, unigram_logp: torch.Tensor, length: int, max_windows: int,
          steps: int = 3) -> dict[str, Any]:
    """Next-token loss, unigram loss and top-1, and the MTP recursion's top-1, over windows of ``tokens``."""
    loss_sum, n, lm_right = 0.0, 0, 0
    right, chain, counted = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    windows = min(max_windows, (len(tokens) - 1) // length)
    for i in range(windows):
        x = tokens[i * length : (i + 1) * length + 1].unsqueeze(0)
        h = model.model(input_ids=x[:, :-1]).last_hidden_state
        logits = model.lm_head(h)
        loss_sum += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
        lm_right += int((logits[0].argmax(-1) == x[0, 1:]).sum())
        n += length
        if mtp is None:
            continue
        # MTP recursion over positions t = 0..T-2 of this window (T = length + 1 tokens in x).
        hidden, inputs = h[:, :-1], x[:, 1:-1]
        ok = torch.ones(inputs.shape[1], dtype=torch.bool)
        for k in range(steps):
            rope = position_embeddings(model, hidden)
            hidden, mlogits = mtp_step(model, mtp, inputs, hidden, rope)
            draft = mlogits[0].argmax(-1)
            valid = len(x[0]) - (k + 2)  # the target x[t + 2 + k] exists for t < valid
            hit = draft[:valid] == x[0, k + 2 : k + 2 + valid]
            ok = ok[:valid] & hit
            right[k] += hit.sum()
            chain[k] += ok.sum()
            counted[k] += valid
            inputs = draft.unsqueeze(0)
    scored = tokens[1 : windows * length + 1]
    result: dict[str, Any] = {"tokens": n, "loss": round(loss_sum / max(n, 1), 4),
                              "unigram_loss": round(float(-unigram_logp[scored].mean()), 4),
                              "lm_top1": round(lm_right / max(n, 1), 4)}
    if mtp is not None:
        result["mtp_top1"] = {str(k + 1): round(float(right[k] / counted[k]), 4) for k in range(steps)}
        result["mtp_chain"] = {str(k + 1): round(float(chain[k] / counted[k]), 4) for k in range(steps)}
    return result


@torch.no_grad()
def evaluate(model_dir: Path, data: Path, length: int = 256, max_windows: int = 400,
             new_tokens: int = 64) -> dict[str, Any]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mtp = load_mtp(model_dir, model).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)

    def encode(text: str) -> torch.Tensor:
        return torch.tensor(tok.encode(text), dtype=torch.long)

    held_text = (data / "heldout.txt").read_text(encoding="utf-8")
    train = encode((data / "train.txt").read_text(encoding="utf-8"))
    counts = torch.bincount(train, minlength=model.config.vocab_size).double() + 0.5
    unigram_logp = (counts / counts.sum()).log()
    overall = score(model, mtp, encode(held_text), unigram_logp, length, max_windows)
    result: dict[str, Any] = {
        "heldout_tokens": overall["tokens"], "heldout_loss": overall["loss"],
        "unigram_loss": overall["unigram_loss"], "lm_top1": overall["lm_top1"],
        "mtp_top1": overall["mtp_top1"], "mtp_chain": overall["mtp_chain"],
    }
    # The two halves of the corpus apart: transcripts (ChatML) and standard-library text.
    docs = [d for d in held_text.split(EOT) if d]
    for kind, keep in (("transcripts", lambda d: d.startswith("<|im_start|>")),
                       ("stdlib", lambda d: not d.startswith("<|im_start|>"))):
        part = score(model, None, encode(EOT.join(d for d in docs if keep(d)) + EOT), unigram_logp, length,
                     max_windows)
        result[kind] = {k: part[k] for k in ("tokens", "loss", "unigram_loss", "lm_top1")}
    samples = []
    for name, messages, tools in CHATS:
        prompt = tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=False)
        samples.append((name, prompt))
    samples += TEXTS
    result["samples"] = {}
    for name, prompt in samples:
        ids = torch.tensor([tok.encode(prompt)])
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
        result["samples"][name] = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
    result["agent_tool_call"] = "<tool_call>" in result["samples"]["agent"]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=Path("/tmp/phloem-train-data"))
    parser.add_argument("--max-windows", type=int, default=400, help="256-token held-out windows to score")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = evaluate(args.model, args.data, max_windows=args.max_windows)
    text = json.dumps(result, indent=2, ensure_ascii=False)
    print(text)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

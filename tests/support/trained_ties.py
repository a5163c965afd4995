"""The trained built-in model's GPU prompts, and the tie rule for two greedy token lists.

On the trained model (peaked logits) two bf16 paths should agree token for token. Where they
part, ``first_unexplained`` asks a reference engine for its logits at that point (teacher-forced
on the common prefix) and accepts the difference only when the two tokens' logits there are
within bf16 rounding of each other (a tie), printing the figures; otherwise it is a bug.
Shared by the GPU tests of the graph + fused path and of speculative decoding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from probe import next_token_logits

from phloem.engine import Engine

# A tie: the two logits differ by at most this many bf16 ulps of the larger one (bf16 keeps 8
# significant bits, so one ulp is 2**-7 of the value's power of two).
TIE_ULPS = 4


def prompts(folder: Path) -> list[list[int]]:
    """8 prompts: four chat turns (two with tools) rendered by the model's template, four texts."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    calculator = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression",
                                                   "parameters": {"type": "object", "properties": {
                                                       "expression": {"type": "string"}}, "required": ["expression"]}}}
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}, "required": ["city"]}}}
    chats = [
        ([{"role": "user", "content": "What is 17 * 23?"}], [calculator]),
        ([{"role": "user", "content": "What is the weather in Rome?"}], [weather]),
        ([{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Is it cold in Oslo right now?"}], [weather, calculator]),
        ([{"role": "user", "content": "Who are you?"}], None),
    ]
    texts = ["def mean(xs):\n", "The module", "import os\nimport sys\n\n\nclass ", '"""Text wrapping and filling.']
    rendered = [tok.apply_chat_template(m, tools=t, add_generation_prompt=True, tokenize=False) for m, t in chats]
    return [tok.encode(text) for text in rendered + texts]


def is_tie(a: float, b: float) -> bool:
    ulp = 2.0 ** (torch.tensor(max(abs(a), abs(b), 1e-30)).log2().floor().item() - 7)
    return abs(a - b) <= TIE_ULPS * ulp


def first_unexplained(engine: Engine, prompt: list[int], got: list[int], want: list[int], label: str) -> str | None:
    """None when ``got`` equals ``want`` or parts from it at a tie of ``engine``'s teacher-forced
    logits; else a line saying where and by how much."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        return None
    logits = next_token_logits(engine, prompt + want[:i]).float()
    a, b = logits[want[i]].item(), logits[got[i]].item()
    line = f"{label}: token {i} differs (reference {want[i]} logit {a:.4f}, tested {got[i]} logit {b:.4f}, gap {abs(a - b):.4g})"
    print(line + (" -- a tie within bf16 rounding" if is_tie(a, b) else " -- NOT a tie"))
    return None if is_tie(a, b) else line

"""FP8 KV pages (``kv_cache_dtype="fp8_e4m3"``, unit scale) against the model-dtype pages, on the
trained built-in model (fp32, ``runtime.builtin_model``) over text of the kinds it was trained on
(an agent transcript, Python, the stdlib's ``textwrap`` source).

Every prompt position's next-token distribution is compared with the same prefill on fp32 pages
(the model's dtype) and, for scale, on bf16 pages. Measured on CPU (torch reference attention,
4 windows of 254 tokens, 1,016 positions): fp8 pages mean KL 8.2e-5 nats (max 6.1e-3), top-1
agreement 99.31 % (7 positions, near-ties); bf16 pages mean KL 3.2e-7 (max 2.0e-5), top-1 99.90 %.
The assertions bound fp8 with margin: mean KL <= 1e-3, max KL <= 0.05, top-1 >= 98 %.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import phloem.engine.loader as loader
from phloem.engine.config import LoadConfig, ModelConfig
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.runtime.builtin_model import trained_model_path

PAGE_SIZE = 16
WINDOW = 254
TEXTS = (
    "<|im_start|>system\nYou are a coding agent. Use the tools to read and edit files.<|im_end|>\n"
    "<|im_start|>user\nThe tests in tests/test_parser.py fail after the refactor; find out why.<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"tests/test_parser.py\"}}\n"
    "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nimport pytest\nfrom parser import parse\n\n"
    "def test_empty():\n    assert parse('') == []\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    "import os\nimport sys\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of the file at path.\"\"\"\n"
    "    with open(path, encoding='utf-8') as f:\n        return [line.rstrip('\\n') for line in f]\n\n\n"
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n"
    "        self.counts[key] = self.counts.get(key, 0) + 1\n\n    def most_common(self, n=1):\n"
    "        return sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]\n",
)


def prefill_logits(model: torch.nn.Module, cfg: ModelConfig, tokens: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """Log-probabilities ``[n, vocab]`` of one prefill of ``tokens`` over KV pages of ``kv_dtype``
    (the reference attention reads every key back from the pages, so each position sees them)."""
    n = len(tokens)
    num_pages = -(-n // PAGE_SIZE)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens), positions=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([n], dtype=torch.int32),
        page_table=torch.arange(num_pages, dtype=torch.int32)[None], slot_mapping=torch.arange(n),
        read_slots=torch.tensor([1]), write_slots=torch.tensor([0]), has_initial_state=torch.tensor([False]),
        logits_indices=torch.arange(n), query_lens_cpu=(n,), is_decode=False,
    )  # fmt: skip
    num_gdn = len(cfg.linear_attention_layers)
    caches = ModelCaches(
        kv=torch.zeros(len(cfg.full_attention_layers), num_pages, 2, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                       dtype=kv_dtype),
        conv=torch.zeros(num_gdn, 2, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1),
        ssm=torch.zeros(num_gdn, 2, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
    )
    with torch.no_grad():
        return model.compute_logits(model(batch, caches)).float().log_softmax(-1)


@pytest.fixture(scope="module")
def windows() -> list[list[int]]:
    from transformers import AutoTokenizer

    import textwrap

    # An agent transcript and Python, then the stdlib's textwrap source (the kinds of text it was trained on).
    text = "".join(TEXTS) + inspect.getsource(textwrap)
    ids = AutoTokenizer.from_pretrained(trained_model_path()).encode(text)
    return [ids[i : i + WINDOW] for i in range(0, len(ids) - WINDOW + 1, WINDOW)][:4]


def compare(windows: list[list[int]], kv_dtype: torch.dtype) -> tuple[float, float, float]:
    """(mean KL(fp32 pages || ``kv_dtype`` pages), max KL, top-1 agreement) over every position."""
    cfg = ModelConfig.from_pretrained(trained_model_path())
    model = loader.load_model(trained_model_path(), cfg, LoadConfig())
    kls, agree = [], []
    for tokens in windows:
        ref = prefill_logits(model, cfg, tokens, torch.float32)
        got = prefill_logits(model, cfg, tokens, kv_dtype)
        kls.append((ref.exp() * (ref - got)).sum(-1))
        agree.append(ref.argmax(-1) == got.argmax(-1))
    kl, top1 = torch.cat(kls), torch.cat(agree).float()
    return kl.mean().item(), kl.max().item(), top1.mean().item()


def test_fp8_pages_stay_close_to_the_models_dtype(windows: list[list[int]]) -> None:
    assert len(windows) == 4 and all(len(w) == WINDOW for w in windows)
    mean_kl, max_kl, top1 = compare(windows, torch.float8_e4m3fn)
    print(f"fp8 pages: mean KL {mean_kl:.2e}, max KL {max_kl:.2e}, top-1 {top1:.4f}")
    bf16 = compare(windows, torch.bfloat16)
    print(f"bf16 pages: mean KL {bf16[0]:.2e}, max KL {bf16[1]:.2e}, top-1 {bf16[2]:.4f}")
    assert 0 < mean_kl <= 1e-3 and max_kl <= 0.05 and top1 >= 0.98, (mean_kl, max_kl, top1)
    assert bf16[0] < mean_kl, "bf16 pages should lose less than fp8 pages"

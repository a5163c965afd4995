"""The random-weight test model: built once, atomically and deterministically; read by Phloem and by HF."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import pytest

# transformers must take its torch fallbacks, never flash-linear-attention kernels.
sys.modules["fla"] = None  # type: ignore[assignment]

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from phloem.engine import Engine, SamplingParams  # noqa: E402
from phloem.engine import CacheConfig, EngineConfig  # noqa: E402
from phloem.runtime import EngineClient, ensure_default_model  # noqa: E402
from phloem.runtime.default_model import RANDOM_MODEL_NAME, SPECIAL_TOKENS  # noqa: E402

TEXTS = [
    "An agent calls a tool, reads the result, and decides what to do next.",
    "Héllo wörld — naïve café, Straße, 日本語のテキスト, emoji 🤖🔧, tabs\tand\nnewlines.",
    "  leading spaces, trailing spaces  ",
]
CHAT = [
    {"role": "system", "content": "You are a careful agent."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data_dir = tmp_path_factory.mktemp("data")
    start = time.perf_counter()
    folder = ensure_default_model(data_dir)
    assert time.perf_counter() - start < 5.0, "building the demo model must take < 5 s"
    return folder


def test_layout_and_config(model_dir: Path) -> None:
    assert model_dir.name == RANDOM_MODEL_NAME and model_dir.parent.name == "models"
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == ["README.md", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert "random" in (model_dir / "README.md").read_text().lower()
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert config["vocab_size"] % 64 == 0 and 0 <= config["vocab_size"] - tokenizer.get_vocab_size() < 64
    assert 1500 <= tokenizer.get_vocab_size() <= 2000
    assert config["eos_token_id"] == tokenizer.token_to_id("<|im_end|>")
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]


def test_idempotent_and_leaves_no_temporary_folders(model_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert ensure_default_model(model_dir.parent.parent) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    assert [p.name for p in model_dir.parent.iterdir()] == [RANDOM_MODEL_NAME]


def test_deterministic_and_safe_under_a_race(model_dir: Path, tmp_path: Path) -> None:
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model(tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1
    (other,) = set(results)
    assert [p.name for p in other.parent.iterdir()] == [RANDOM_MODEL_NAME]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name


def test_engine_and_transformers_agree(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False))
    ours = Engine.from_pretrained(model_dir).generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert ours.token_ids == theirs[0, len(prompt) :].tolist()


def test_engine_client_serves_it(model_dir: Path) -> None:
    async def main() -> list[int]:
        async with EngineClient.from_pretrained(model_dir, EngineConfig(cache=CacheConfig(num_pages=64))) as client:
            assert client.model_config.architecture == "Qwen3_5MoeForCausalLM"
            outs = [o async for o in client.generate([5, 6, 7, 8], SamplingParams(max_tokens=8, ignore_eos=True))]
            return [t for o in outs for t in o.new_token_ids]

    streamed = asyncio.run(main())
    engine = Engine.from_pretrained(model_dir, cache=CacheConfig(num_pages=64))
    assert streamed == engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("text", TEXTS, ids=["ascii", "non-ascii", "spaces"])
def test_tokenizer_round_trips(model_dir: Path, text: str) -> None:
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = raw.encode(text).ids
    assert raw.decode(ids) == text
    hf = AutoTokenizer.from_pretrained(model_dir)
    assert hf.encode(text) == ids and hf.decode(ids) == text


def test_special_tokens_and_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.encode("<|im_start|>user\nhi<|im_end|>")[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a careful agent.<|im_end|>\n"
        "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tokenizer.apply_chat_template(CHAT, tokenize=False).endswith("assistant\n")
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    turns = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]
    text = tokenizer.apply_chat_template(turns, tools=[tool], add_generation_prompt=True, tokenize=False)
    assert '<tools>\n{"type": "function", "function": {"name": "weather"' in text
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_foreign_folder_in_the_way_is_reported(tmp_path: Path) -> None:
    squatter = tmp_path / "models" / RANDOM_MODEL_NAME
    squatter.mkdir(parents=True)
    (squatter / "notes.txt").write_text("not a model")
    with pytest.raises(OSError, match="not a complete demo model"):
        ensure_default_model(tmp_path)
    assert sorted(p.name for p in squatter.parent.iterdir()) == [RANDOM_MODEL_NAME]

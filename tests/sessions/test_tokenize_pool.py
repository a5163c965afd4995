"""Tokenization off the event loop (the per-owner bound, the loop's responsiveness) and the
early refusal of inputs whose length alone cannot fit."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from phloem.sessions import ContextLengthExceeded, SessionInput, Tokenizer
from phloem.sessions._inputs import check_input_size
from phloem.sessions.text._tokenize_pool import TokenizePool


def test_one_owner_cannot_take_every_worker() -> None:
    async def main() -> None:
        pool = TokenizePool(workers=2, per_owner=1)
        release = threading.Event()
        started: list[str] = []

        def blocked(name: str) -> str:
            started.append(name)
            assert release.wait(10)
            return name

        a = [asyncio.ensure_future(pool.run("a", lambda i=i: blocked(f"a{i}"))) for i in range(3)]
        await asyncio.sleep(0.1)
        assert started == ["a0"], "a's later jobs wait for its first"
        b = await asyncio.wait_for(pool.run("b", lambda: "b"), 5)
        assert b == "b", "another owner runs on the free worker meanwhile"
        release.set()
        assert await asyncio.gather(*a) == ["a0", "a1", "a2"]
        pool.close()
    asyncio.run(main())


@pytest.mark.slow  # tokenizes a 0.9 MB text
def test_a_long_tokenization_leaves_the_event_loop_free(tokenizer: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog, 12345 times. " * 15_000  # 0.9 MB

    async def main() -> tuple[float, float]:
        pool = TokenizePool(workers=2, per_owner=1)
        lags: list[float] = []

        async def tick() -> None:
            while True:
                start = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - start - 0.01)

        ticker = asyncio.ensure_future(tick())
        start = time.perf_counter()
        ids = await pool.run("a", lambda: tokenizer.encode(text))
        took = time.perf_counter() - start
        ticker.cancel()
        pool.close()
        assert len(ids) > 400_000
        return took, max(lags)

    took, worst = asyncio.run(main())
    assert worst < 0.25 and worst < took / 2, f"the loop stalled {worst:.3f} s of a {took:.3f} s tokenization"


@pytest.mark.parametrize("text", [
    "plain English words, numbers 12345 and punctuation!?",
    "e\u0301\u0323 a\u0313\u0342\u0345 " * 50,  # combining marks NFC composes
    "\u1100\u1161\u11a8" * 100,  # Hangul jamo NFC composes 3 to 1
    "\U0001f600" * 80 + "<|im_start|>" * 20,
    "".join(chr(c) for c in range(32, 3000)),
], ids=["ascii", "combining", "jamo", "emoji-special", "ranges"])
def test_the_early_size_bound_never_exceeds_the_real_count(tokenizer: Tokenizer, text: str) -> None:
    assert 0 < tokenizer.min_tokens(len(text)) <= len(tokenizer.encode(text))


def test_an_input_too_long_by_its_length_is_refused_before_tokenizing(tokenizer: Tokenizer) -> None:
    text = "x" * 10_000_000
    with pytest.raises(ContextLengthExceeded, match="at least"):
        check_input_size(tokenizer, 0, SessionInput(text=text), 8192, generate=True)
    fits = "word " * 100
    check_input_size(tokenizer, 0, SessionInput(messages=({"role": "user", "content": fits},)), 8192, True)


def test_tools_count_toward_the_early_bound_and_it_stays_below_the_real_count(tokenizer: Tokenizer) -> None:
    assert tokenizer.renders_tools_as_json
    tool = {"type": "function", "function": {"name": "f", "description": "d\u00e9 <|im_end|> \U0001f600 " * 20,
                                             "parameters": {"type": "object", "properties": {
                                                 "<|im_start|>k": {"type": "string", "enum": ["a", "b"]}}}}}
    messages = ({"role": "user", "content": "hi"},)
    tools = [tool] * 30
    chars = len(messages[0]["content"]) + sum(
        len(json.dumps(t, ensure_ascii=False, separators=(",", ":"))) for t in tools)
    rendered = tokenizer.render_messages(messages, tools=tools, add_generation_prompt=True)
    assert tokenizer.min_tokens(chars) <= len(rendered)
    # Just under the bound passes (to be rendered and counted); one more token's worth does not.
    least = tokenizer.min_tokens(chars)
    check_input_size(tokenizer, 0, messages, least + 1, generate=True, tools=tools)
    with pytest.raises(ContextLengthExceeded, match="at least"):
        check_input_size(tokenizer, 0, messages, least, generate=True, tools=tools)
    check_input_size(tokenizer, 0, messages, least, generate=True)  # without the tools it fits
    # A session input's messages count them too (the manager passes a new session's tools).
    with pytest.raises(ContextLengthExceeded):
        check_input_size(tokenizer, 0, SessionInput(messages=messages), least, generate=True, tools=tools)

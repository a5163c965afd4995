"""The text a generation releases at its end (the detokenizer's held-back tail, e.g. an
incomplete UTF-8 character) reaches the parsed output too: streamed parts, the settled parts and
the text agree."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from phloem.sessions import GenerateOptions, SessionManager, Tokenizer

ManagerFactory = Callable[..., AbstractAsyncContextManager[SessionManager]]


def test_the_held_back_tail_is_parsed_like_the_text(make_manager: ManagerFactory, tokenizer: Tokenizer) -> None:
    # The first byte of a three-byte character: alone it decodes only when the output ends.
    partial = tokenizer.encode("€")[0]
    assert tokenizer.decode([partial]) == "\ufffd"

    async def body(m: SessionManager) -> None:
        prompt = tokenizer.encode(f"text {uuid.uuid4().hex}")
        options = GenerateOptions(max_tokens=2, temperature=0.0, ignore_eos=True,
                                  logit_bias=((partial, 100.0),))
        [generation] = await m.complete(prompt, options)
        deltas = [d async for d in generation.deltas()]
        result = await generation.result()
        assert result.output_ids == (partial, partial) and result.text.endswith("\ufffd")
        assert result.parsed is not None and result.parsed.content == result.text
        streamed = "".join(d.parsed.content for d in deltas if d.parsed is not None)
        assert streamed == "".join(d.text for d in deltas) == result.text

    async def main() -> None:
        async with make_manager() as manager:
            await body(manager)

    asyncio.run(main())

"""The stock ``openai`` package against the real server, unchanged but for ``base_url``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from phloem.api import Client

pytestmark = pytest.mark.slow  # the session's phloem serve process

MODEL = "phloem-tiny-qwen3.5"


@pytest.fixture
def oai(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def test_models_say_what_the_built_in_model_is(oai: openai.OpenAI) -> None:
    [model] = oai.models.list().data
    assert model.id == MODEL and "built-in 4M-parameter test model" in model.owned_by
    assert "RANDOM" not in model.owned_by


def test_chat_completions_stream_and_not(oai: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": f"conversation {uuid.uuid4().hex}"},
                {"role": "user", "content": "hello"}]
    plain = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                        temperature=0, extra_body={"ignore_eos": True})
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert plain.usage is not None and plain.usage.completion_tokens == 8
    assert plain.usage.prompt_tokens_details is not None
    assert plain.usage.prompt_tokens_details.cached_tokens == 0

    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (plain.usage.prompt_tokens, 8)


def test_completions_text_and_token_prompts(oai: openai.OpenAI) -> None:
    prompt = f"Once upon a time {uuid.uuid4().hex}"
    plain = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                   extra_body={"ignore_eos": True})
    streamed = list(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text
    assert plain.usage is not None and plain.choices[0].finish_reason == "length"


def test_a_completion_streams_a_chunk_per_token_while_its_text_is_held_back(oai: openai.OpenAI) -> None:
    """A stop string that the whole output is a prefix of holds every character back until the
    end; the tokens still come as they are generated, in chunks of empty text (as vLLM streams),
    so a client times the first token and each next one at the engine's pace."""
    prompt = f"Once upon a time {uuid.uuid4().hex}"
    greedy: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = oai.completions.create(prompt=prompt, **greedy).choices[0].text
    assert plain
    chunks = [c for c in oai.completions.create(prompt=prompt, stop=[plain + "\u0001"], stream=True, **greedy)
              if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == plain
    assert chunks[-1].choices[0].finish_reason == "length"
    assert any(c.choices[0].text == "" and c.choices[0].finish_reason is None for c in chunks)


def test_token_prompts_hit_the_prefix_cache(oai: openai.OpenAI, client: Client) -> None:
    """A stateless request whose prompt extends a session's history reuses all of it."""
    session = client.sessions.create(text=f"shared history {uuid.uuid4().hex}")
    session.append(text=" and more", generate={"max_tokens": 5, "temperature": 0, "ignore_eos": True})
    history = [t for turn in session.turns(include_tokens=True) for t in (turn.token_ids or [])]
    out = oai.completions.create(model=MODEL, prompt=history + [42], max_tokens=4, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.prompt_tokens == len(history) + 1
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == len(history)
    session.delete()


def test_errors_use_openai_exceptions(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="best_of"):
        oai.completions.create(model=MODEL, prompt="x", extra_body={"best_of": 2})
    with pytest.raises(openai.BadRequestError, match="context"):
        oai.completions.create(model=MODEL, prompt=[5] * 9000, max_tokens=1)

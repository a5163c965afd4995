"""Anthropic's Messages API through the stock ``anthropic`` client against a real ``phloem
serve`` (the session-wide ``server``): ``system``, a tool forced by ``tool_choice`` (the grammar
makes its ``input`` validate, whatever the random weights), streamed and not, a ``tool_result``
that continues from the prefix cache, ``stop_sequences``, ``thinking`` and the error envelope."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import jsonschema
import pytest

if TYPE_CHECKING:  # the client is imported in the tests: 2 s that every collection would pay
    import anthropic

pytestmark = pytest.mark.slow  # the session's phloem serve process

MODEL = "phloem-tiny-qwen3.5"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 5}},
           "required": ["city", "days"]}
TOOLS: Any = [{"name": "get_weather", "description": "Forecast", "input_schema": WEATHER},
              {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]


@pytest.fixture
def claude(server: Any) -> Iterator[anthropic.Anthropic]:
    import anthropic

    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        yield client


def ask() -> Any:
    return [{"role": "user", "content": f"Weather in Paris? ({uuid.uuid4().hex})"}]


def test_a_forced_tool_then_its_result_from_the_cache(claude: anthropic.Anthropic) -> None:
    kwargs: Any = dict(model=MODEL, max_tokens=300, system="You forecast.", tools=TOOLS,
                       tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                       # Greedy (this client version has no `temperature` argument; the API has).
                       extra_body={"temperature": 0})
    messages = ask()
    reply = claude.messages.create(messages=messages, **kwargs)
    assert reply.stop_reason == "tool_use" and reply.role == "assistant" and reply.id.startswith("msg_")
    [use] = reply.content
    assert use.type == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    assert reply.usage.cache_read_input_tokens == 0 and reply.usage.input_tokens > 0

    with claude.messages.stream(messages=messages, **kwargs) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert events[:2] == ["message_start", "content_block_start"] and events[-2:] == ["message_delta", "message_stop"]
    [again] = streamed.content
    assert (again.name, again.input) == (use.name, use.input) and streamed.stop_reason == "tool_use"
    # The stream's final usage matches the non-streamed one (the prompt is the same).
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == \
        reply.usage.input_tokens + reply.usage.cache_read_input_tokens

    messages += [{"role": "assistant", "content": reply.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=4, system="You forecast.", tools=TOOLS,
                                    messages=messages)
    # The conversation so far came from the prefix cache: the first request's whole prompt.
    assert answer.usage.cache_read_input_tokens >= reply.usage.input_tokens
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_any_tool_and_parallel_calls_validate(claude: anthropic.Anthropic) -> None:
    reply = claude.messages.create(model=MODEL, max_tokens=400, tools=TOOLS, messages=ask(),
                                   tool_choice={"type": "any"})
    assert reply.stop_reason == "tool_use" and reply.content
    for block in reply.content:
        assert block.type == "tool_use" and block.name in ("get_weather", "get_time")
        if block.name == "get_weather":
            jsonschema.validate(block.input, WEATHER)


def test_text_stop_sequences_and_thinking(claude: anthropic.Anthropic) -> None:
    kwargs: Any = dict(model=MODEL, max_tokens=40, messages=ask(), thinking={"type": "disabled"},
                       extra_body={"temperature": 0})
    plain = claude.messages.create(**kwargs)
    [block] = plain.content
    assert block.type == "text" and len(block.text) > 2 and plain.usage.output_tokens <= 40
    cut = block.text[1:].strip()[:2]
    stopped = claude.messages.create(**kwargs, stop_sequences=["never-in-there", cut])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", cut)
    assert stopped.content[0].text == block.text[:block.text.index(cut)]
    hello: Any = dict(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hello"}],
                      extra_body={"temperature": 0})
    with claude.messages.stream(**hello) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == claude.messages.create(**hello).content[0].text


def test_errors_use_anthropics_envelope(claude: anthropic.Anthropic, server: Any) -> None:
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-nope", max_tokens=3, messages=ask())
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError, match="prefilling"):
        claude.messages.create(model=MODEL, max_tokens=3, messages=[*ask(), {"role": "assistant", "content": "It"}])
    raw = httpx.post(f"{server.base_url}/v1/messages", json={"model": MODEL, "messages": ask()})
    assert raw.status_code == 400 and "max_tokens" in raw.json()["error"]["message"]
    count = claude.messages.count_tokens(model=MODEL, messages=ask(), tools=TOOLS)
    assert count.input_tokens > 50

"""Tool calls and structured output on the native session API, through the SDK (typed objects)
against a real ``phloem serve``."""

from __future__ import annotations

import json
import uuid

import jsonschema
import pytest

from phloem.api import Client, ToolCall

pytestmark = pytest.mark.slow  # the session's phloem serve process

LOOKUP = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["id"]}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}]


def test_forced_calls_are_typed_stored_and_continued_from_the_cache(client: Client) -> None:
    session = client.sessions.create(tools=TOOLS, messages=[
        {"role": "system", "content": f"run {uuid.uuid4().hex}"}, {"role": "user", "content": "find 7"}])
    forced = {"max_tokens": 200, "temperature": 0, "tool_choice": {"type": "function", "function": {"name": "lookup"}}}
    result = session.append(generate=forced)
    [call] = result.tool_calls or []
    assert isinstance(call, ToolCall) and call.function.name == "lookup" and result.content is None
    jsonschema.validate(json.loads(call.function.arguments), LOOKUP)
    assert session.turns()[-1].tool_calls == [call]

    with session.stream(messages=[{"role": "tool", "tool_call_id": call.id, "content": "found"}],
                        generate={"max_tokens": 200, "temperature": 0, "tool_choice": "required",
                                  "parallel_tool_calls": False}) as stream:
        text = "".join(event.text for event in stream)
    done = stream.result
    assert done is not None and done.text == text and done.usage.cached_tokens == result.num_tokens
    [again] = done.tool_calls or []
    assert again.function.name == "lookup" and again.id != call.id
    session.delete()


def test_response_format_and_logprobs_on_an_append(client: Client) -> None:
    session = client.sessions.create(text=f"run {uuid.uuid4().hex}")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    out = session.append(text=" JSON:", generate={
        "max_tokens": 200, "temperature": 0, "logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    jsonschema.validate(json.loads(out.text), schema)
    assert out.logprobs is not None and [lp.token_id for lp in out.logprobs] == out.output_ids
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in out.logprobs)
    session.delete()

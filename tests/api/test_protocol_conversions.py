"""The Responses and Anthropic protocols' pure parts: input items and content blocks as chat
messages, response ids, output items and the two event streams (reasoning included, which the
built-in model's template does not produce)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from phloem.api.server.anthropic import convert as anthropic
from phloem.api.server.anthropic.schemas import MessagesRequest
from phloem.api.server.anthropic.stream import MessageEvents
from phloem.api.server.errors import ApiError
from phloem.api.server.responses.input import chat_messages, locate, response_id
from phloem.api.server.responses.output import output_items
from phloem.api.server.responses.schemas import ResponseCreateRequest, decode_items
from phloem.api.server.responses.stream import ResponseEvents
from phloem.sessions import ParsedDelta, ParsedOutput, ParsedToolCall, ToolCallDelta


def test_a_response_id_names_its_session_and_turn() -> None:
    session_id = "sess_01J0ABCDEFGHJKMNPQRSTVWXYZ0123456789"
    assert locate(response_id(session_id, 7)) == (session_id, 7)
    for bad in ("resp_abc", "resp__3", "sess_x_1", "resp_x_1_2", "resp_" + "a" * 200 + "_1"):
        with pytest.raises(ApiError):
            locate(bad)


def test_input_items_become_chat_messages() -> None:
    items = decode_items([
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris "},
                                                         {"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ])
    assert chat_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris weather?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hm", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]


@pytest.mark.parametrize("item, expected", [
    ({"type": "input_image", "image_url": "x"}, "input[0]"),
    ({"type": "message", "role": "user", "content": [{"type": "input_image"}]}, "input[0]"),
    ({"type": "function_call_output", "output": "x"}, "call_id"),
    ({"role": "robot", "content": "x"}, "role"),
], ids=["image", "image-part", "no-call-id", "bad-role"])
def test_unsupported_items_are_refused_by_index(item: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValueError, match="input\\[0\\]") as info:
        decode_items([item])
    assert expected in str(info.value)


def test_a_request_with_unknown_or_unsupported_fields_is_refused() -> None:
    base = {"model": "m", "input": "hi"}
    for extra in ({"top_logprobs": 3}, {"truncation": "sometimes"}, {"background": True},
                  {"tools": [{"type": "web_search"}]}, {"include": ["file_search_call.results"]}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({**base, **extra}, ResponseCreateRequest)
    msgspec.convert({**base, "include": [], "store": False, "user": "u", "truncation": "disabled",
                     "reasoning": {"effort": "none"}, "text": {"format": {"type": "text"}}},
                    ResponseCreateRequest)
    msgspec.convert({**base, "truncation": "auto"}, ResponseCreateRequest)  # implemented (plan_to_fit)


def _types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"].removeprefix("response.") for e in events]


def test_response_events_follow_the_documented_order() -> None:
    events = ResponseEvents("resp_x_0", {"id": "resp_x_0", "status": "in_progress", "output": []})
    stream = events.start()
    stream += events.delta(ParsedDelta(reasoning="think"))
    stream += events.delta(ParsedDelta(reasoning=" more", content="Hi"))
    stream += events.delta(ParsedDelta(content=" there"))
    stream += events.delta(ParsedDelta(tool_calls=(ToolCallDelta(0, "call_a", "f", ""),)))
    stream += events.delta(ParsedDelta(tool_calls=(ToolCallDelta(0, None, None, '{"a": 1}'),)))
    stream += events.close()
    assert _types(stream) == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "content_part.done", "output_item.done",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done"]
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    parsed = ParsedOutput("Hi there", "think more", (ParsedToolCall("call_a", "f", '{"a": 1}'),))
    # The streamed items are the items a non-streamed response has.
    assert events.items == output_items("resp_x_0", parsed, "completed")
    assert [e["output_index"] for e in stream if e["type"] == "response.output_item.done"] == [0, 1, 2]


def test_output_items_of_an_empty_or_cut_output() -> None:
    [message] = output_items("resp_x_1", ParsedOutput(None, None), "completed")
    assert message["content"][0]["text"] == "" and message["id"] == "msg_x_1"
    [reasoning] = output_items("resp_x_1", ParsedOutput(None, "still thinking"), "incomplete")
    assert reasoning["type"] == "reasoning" and reasoning["status"] == "incomplete"


def test_anthropic_messages_become_chat_messages() -> None:
    body = msgspec.convert({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?", "cache_control": {"type": "ephemeral"}}]}]},
        MessagesRequest)
    assert anthropic.chat_messages(body.system, body.messages) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "hm", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]


def test_anthropic_blocks_and_events() -> None:
    parsed = ParsedOutput("Hi", "think", (ParsedToolCall("call_a", "f", '{"a": 1}'),))
    assert anthropic.content_blocks(parsed) == [
        {"type": "thinking", "thinking": "think", "signature": ""}, {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "call_a", "name": "f", "input": {"a": 1}}]
    blocks = MessageEvents()
    stream = blocks.delta(ParsedDelta(reasoning="think", content="Hi"))
    stream += blocks.delta(ParsedDelta(tool_calls=(ToolCallDelta(0, "call_a", "f", ""),
                                                   ToolCallDelta(0, None, None, '{"a": 1}'))))
    stream += blocks.close()
    assert [(e["type"], e["index"], e.get("delta", e.get("content_block", {})).get("type")) for e in stream] == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None)]

"""The OpenAI Responses API through the stock ``openai`` client against a real ``phloem serve``
(the session-wide ``server``): a response is a session turn, ``previous_response_id`` appends at
the head and forks at an older turn, streaming follows the documented events, function tools
round-trip under the grammar, ``store: false`` leaves nothing behind, ``DELETE`` forgets."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from phloem.api.server.responses.input import locate

pytestmark = pytest.mark.slow  # the session's phloem serve process

MODEL = "phloem-tiny-qwen3.5"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}
TOOLS: Any = [{"type": "function", "name": "get_weather", "description": "Forecast", "parameters": CITY},
              {"type": "function", "name": "get_time", "parameters": {
                  "type": "object", "properties": {"zone": {"type": "string", "enum": ["CET", "UTC"]}},
                  "required": ["zone"]}}]


@pytest.fixture
def oai(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def fresh(text: str = "Tell me something.") -> str:
    """A prompt no other test shares (so cache counts come from this test alone)."""
    return f"{text} ({uuid.uuid4().hex})"


def session_of(rid: str) -> str:
    return locate(rid)[0]


def test_a_continuation_appends_to_the_session_and_reports_its_tokens_cached(oai: openai.OpenAI, server: Any) -> None:
    first = oai.responses.create(model=MODEL, input=fresh(), instructions="Be brief.",
                                 max_output_tokens=6, temperature=0)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == 6 and first.usage.input_tokens_details.cached_tokens == 0
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, input="And then?",
                                  instructions="Be brief.", max_output_tokens=6, temperature=0)
    # The whole first response (its prompt and output) came from the session's cache.
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens
    assert second.previous_response_id == first.id and second.instructions == "Be brief."
    assert session_of(second.id) == session_of(first.id)
    turns = httpx.get(f"{server.base_url}/v1/sessions/{session_of(first.id)}/turns").json()["turns"]
    assert len(turns) == 2 and turns[0]["end"] == first.usage.total_tokens
    # GET answers what POST did, rebuilt from the turn's tokens.
    for response in (first, second):
        assert oai.responses.retrieve(response.id).model_dump() == response.model_dump()


def test_an_older_response_forks_copy_on_write(oai: openai.OpenAI, server: Any) -> None:
    root = oai.responses.create(model=MODEL, input=fresh(), max_output_tokens=4, temperature=0)
    head = oai.responses.create(model=MODEL, previous_response_id=root.id, input="one",
                                max_output_tokens=4, temperature=0)
    branch = oai.responses.create(model=MODEL, previous_response_id=root.id, input="two",
                                  max_output_tokens=4, temperature=0)
    assert session_of(head.id) == session_of(root.id) != session_of(branch.id)
    child = httpx.get(f"{server.base_url}/v1/sessions/{session_of(branch.id)}").json()
    assert (child["parent_id"], child["fork_turn"], child["num_turns"]) == (session_of(root.id), 0, 2)
    # The fork shares the root's pages: nothing of the root was computed again.
    assert branch.usage.input_tokens_details.cached_tokens == root.usage.total_tokens
    assert branch.id.endswith("_1") and oai.responses.retrieve(branch.id).model_dump() == branch.model_dump()
    # The fork's inherited turn is the root's response, not one of its own.
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(branch.id[:-2] + "_0")


def test_two_continuations_of_one_response_at_once(oai: openai.OpenAI) -> None:
    root = oai.responses.create(model=MODEL, input=fresh(), max_output_tokens=4, temperature=0)
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda text: oai.responses.create(
            model=MODEL, previous_response_id=root.id, input=text, max_output_tokens=16), ["a", "b"]))
    # One appends to the root's session; the other (the head moved, or an append was running)
    # forks at the root: both continue the same root, from its cache.
    assert sorted(session_of(r.id) == session_of(root.id) for r in replies) == [False, True]
    assert [r.id[-2:] for r in replies] == ["_1", "_1"]
    assert all(r.usage.input_tokens_details.cached_tokens == root.usage.total_tokens for r in replies)


def test_streaming_yields_the_documented_events(oai: openai.OpenAI) -> None:
    kwargs: Any = dict(model=MODEL, input=fresh(), max_output_tokens=5, temperature=0)
    events = list(oai.responses.create(**kwargs, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.id == final.id
    assert final.output_text == "".join(deltas) == events[-4].text
    assert oai.responses.retrieve(final.id).model_dump() == final.model_dump()
    again = oai.responses.create(**kwargs)
    assert again.output_text == final.output_text  # greedy: the same text, streamed or not


def test_function_tools_round_trip_under_the_grammar(oai: openai.OpenAI) -> None:
    kwargs: Any = dict(model=MODEL, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                       max_output_tokens=300, temperature=0)
    asked = oai.responses.create(input=fresh("What is the weather in Paris?"), **kwargs)
    [call] = asked.output
    assert call.type == "function_call" and asked.status == "completed" and call.call_id.startswith("call_")
    schema = next(t["parameters"] for t in TOOLS if t["name"] == call.name)
    jsonschema.validate(json.loads(call.arguments), schema)
    streamed = list(oai.responses.create(input=fresh("What time is it?"), **{
        **kwargs, "tool_choice": {"type": "function", "name": "get_time"}}, stream=True))
    added = next(e for e in streamed if e.type == "response.output_item.added")
    done = next(e for e in streamed if e.type == "response.function_call_arguments.done")
    assert added.item.name == done.name == "get_time" and streamed[-1].type == "response.completed"
    assert json.loads(done.arguments)["zone"] in ("CET", "UTC")

    answer = oai.responses.create(model=MODEL, previous_response_id=asked.id, tools=TOOLS,
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "sunny, 21 C"}], max_output_tokens=8)
    assert answer.usage.input_tokens_details.cached_tokens == asked.usage.total_tokens
    items = list(oai.responses.input_items.list(answer.id))
    assert [(i.type, i.call_id, i.output) for i in items] == [("function_call_output", call.call_id, "sunny, 21 C")]


def test_text_format_constrains_the_output(oai: openai.OpenAI) -> None:
    out = oai.responses.create(model=MODEL, input=fresh("Forecast as JSON"), max_output_tokens=300, temperature=0,
                               text={"format": {"type": "json_schema", "name": "forecast", "schema": CITY,
                                                "strict": True}})
    jsonschema.validate(json.loads(out.output_text), CITY)
    assert out.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError, match="compiled"):
        oai.responses.create(model=MODEL, input="x", text={"format": {
            "type": "json_schema", "name": "bad", "schema": {"type": "nonsense"}}})


def _journal(data_dir: Path) -> set[str]:
    return {p.name for p in (data_dir / "sessions").glob("*.json")}


def _sessions(base_url: str) -> set[str]:
    return {s["id"] for s in httpx.get(f"{base_url}/v1/sessions", params={"limit": 100}).json()["sessions"]}


def test_store_false_leaves_nothing_behind(oai: openai.OpenAI, server: Any) -> None:
    kept = oai.responses.create(model=MODEL, input=fresh(), max_output_tokens=3)
    before, files = _sessions(server.base_url), _journal(server.data_dir)
    alone = oai.responses.create(model=MODEL, input=fresh(), max_output_tokens=3, store=False)
    after_kept = oai.responses.create(model=MODEL, previous_response_id=kept.id, input="more",
                                      max_output_tokens=3, store=False)
    assert after_kept.usage.input_tokens_details.cached_tokens == kept.usage.total_tokens
    for response in (alone, after_kept):
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):
            oai.responses.create(model=MODEL, previous_response_id=response.id, input="x")
    deadline = time.monotonic() + 10  # the temporary fork goes once its generation settled
    while (_sessions(server.base_url), _journal(server.data_dir)) != (before, files):
        assert time.monotonic() < deadline, "store=false left a session behind"
        time.sleep(0.05)
    assert httpx.get(f"{server.base_url}/v1/sessions/{session_of(kept.id)}").json()["num_turns"] == 1


def test_delete_forgets_a_response_and_then_its_session(oai: openai.OpenAI, server: Any) -> None:
    first = oai.responses.create(model=MODEL, input=fresh(), max_output_tokens=3)
    second = oai.responses.create(model=MODEL, previous_response_id=first.id, input="x", max_output_tokens=3)
    oai.responses.delete(first.id)
    for call in (lambda: oai.responses.retrieve(first.id), lambda: oai.responses.delete(first.id),
                 lambda: oai.responses.create(model=MODEL, previous_response_id=first.id, input="x")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert oai.responses.retrieve(second.id).id == second.id  # later responses still stand
    url = f"{server.base_url}/v1/sessions/{session_of(first.id)}"
    assert httpx.get(url).status_code == 200
    oai.responses.delete(second.id)
    assert httpx.get(url).status_code == 404  # no response of the session is left
    # A branch (a fork at turn 0) goes with its own response; its root stays.
    root = oai.responses.create(model=MODEL, input=fresh(), max_output_tokens=3)
    oai.responses.create(model=MODEL, previous_response_id=root.id, input="x", max_output_tokens=3)
    branch = oai.responses.create(model=MODEL, previous_response_id=root.id, input="y", max_output_tokens=3)
    oai.responses.delete(branch.id)
    assert httpx.get(f"{server.base_url}/v1/sessions/{session_of(branch.id)}").status_code == 404
    assert oai.responses.retrieve(root.id).id == root.id


def test_other_instructions_or_tools_render_the_conversation_again(oai: openai.OpenAI) -> None:
    first = oai.responses.create(model=MODEL, input=fresh(), instructions="Be brief.", max_output_tokens=3)
    same = oai.responses.create(model=MODEL, previous_response_id=first.id, input="a", max_output_tokens=3)
    assert session_of(same.id) == session_of(first.id)  # instructions left out: the conversation's
    other = oai.responses.create(model=MODEL, previous_response_id=same.id, input="b",
                                 instructions="Be verbose.", max_output_tokens=3)
    assert session_of(other.id) not in (session_of(first.id),) and other.id.endswith("_0")
    assert other.previous_response_id == same.id
    # The new session holds the whole conversation: three user messages and two replies.
    assert other.usage.input_tokens > same.usage.total_tokens - 10
    tooled = oai.responses.create(model=MODEL, previous_response_id=other.id, input="c", tools=TOOLS,
                                  max_output_tokens=3)
    assert tooled.id.endswith("_0") and tooled.tools[0].name == "get_weather"


def test_bad_requests_are_clear_400s_and_404s(oai: openai.OpenAI) -> None:
    for kwargs, match in [
        (dict(input=[{"type": "input_image", "image_url": "x"}]), "input\\[0\\]"),
        (dict(input="x", tool_choice="required"), "tools"),
        # "auto" and "disabled" are implemented (tests/api/test_openai_fields.py); others are not.
        (dict(input="x", extra_body={"truncation": "sometimes"}), "truncation"),
        (dict(input="x", extra_body={"frobnicate": 1}), "frobnicate"),
        (dict(input=[{"type": "reasoning", "summary": []}]), "at least one message"),
    ]:
        with pytest.raises(openai.BadRequestError, match=match):
            oai.responses.create(model=MODEL, **kwargs)
    for rid in ("resp_nope_1", "nothing", "resp_" + "A" * 36 + "_0"):
        with pytest.raises(openai.NotFoundError):
            oai.responses.retrieve(rid)
        with pytest.raises(openai.NotFoundError):
            oai.responses.create(model=MODEL, previous_response_id=rid, input="x")
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="gpt-4o", input="x")

"""``phloem serve --speculative mtp:3``: greedy chat completions (plain and streamed) through the
HTTP API give the same text as the server without speculation."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow  # two phloem serve processes

MODEL = "phloem-tiny-qwen3.5"
CHATS = (
    [{"role": "user", "content": "What is the weather in Rome?"}],
    [{"role": "system", "content": "You are a helpful coding assistant."},
     {"role": "user", "content": "Write a Python function that returns the mean of a list."}],
    [{"role": "user", "content": "List three uses of the argparse module."}],
)


def _chat(base_url: str, messages: list[dict[str, str]], stream: bool, max_tokens: int = 64) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"] or "")
    text = []
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def test_greedy_chats_equal_with_and_without_speculation(server: Any, speculative_server: Any) -> None:
    for messages in CHATS:
        tag = [{"role": "system", "content": f"conversation {uuid.uuid4().hex[:8]}"}] if len(messages) == 1 else []
        chat = tag + messages
        plain = _chat(server.base_url, chat, stream=False)
        assert plain
        assert _chat(speculative_server.base_url, chat, stream=False) == plain
        assert _chat(speculative_server.base_url, chat, stream=True) == plain
        # A shorter cap lands mid-run: cut exactly.
        assert _chat(speculative_server.base_url, chat, stream=False, max_tokens=5) == _chat(
            server.base_url, chat, stream=False, max_tokens=5)


def _samples(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{base_url}/metrics", timeout=30)
    assert response.status_code == 200
    return {
        s.name + ("" if "le" not in s.labels else f"{{le={s.labels['le']}}}"): s.value
        for family in text_string_to_metric_families(response.text) for s in family.samples
    }


def test_metrics_show_what_speculation_did(server: Any, speculative_server: Any) -> None:
    """``/metrics`` of ``--speculative mtp:3`` counts drafted, accepted and emitted tokens and the
    accepted length per request-step (1 .. 4); a server without speculation exports none of it."""
    before = _samples(speculative_server.base_url)
    _chat(speculative_server.base_url, [{"role": "user", "content": f"Count to ten. {uuid.uuid4().hex[:6]}"}],
          stream=False, max_tokens=32)
    m = _samples(speculative_server.base_url)
    steps = m["phloem_speculative_steps_total"]
    assert steps > before.get("phloem_speculative_steps_total", 0)
    count = m["phloem_speculative_accepted_length_count"]
    emitted, accepted = m["phloem_speculative_emitted_tokens_total"], m["phloem_speculative_accepted_tokens_total"]
    assert count >= steps  # a step speculates for every request of it
    assert m["phloem_speculative_accepted_length_sum"] == emitted and emitted == accepted + count
    assert m["phloem_speculative_drafted_tokens_total"] == 3 * count >= accepted  # mtp:3, far from the context limit
    assert 1.0 <= emitted / count <= 4.0
    assert m["phloem_speculative_accepted_length_bucket{le=4.0}"] == count  # nothing over k + 1
    assert m["phloem_speculative_accepted_length_bucket{le=1.0}"] < count  # the trained MTP layer is accepted
    assert m["phloem_speculative_plain_steps_total"] >= 1  # the prompt's prefill
    assert m["phloem_speculative_over_batch_steps_total"] == 0  # one request at a time, under 32
    assert not any(name.startswith("phloem_speculative") for name in _samples(server.base_url))


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
CONSTRAINED = (
    {"response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}},
    {"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
     "tool_choice": "required", "parallel_tool_calls": False},
    {"temperature": 0.9, "seed": 11},
    {"temperature": 0.9, "seed": 11, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "weather", "schema": WEATHER}}},
)


def test_constrained_and_seeded_chats_equal_with_and_without_speculation(server: Any, speculative_server: Any) -> None:
    """A JSON-schema answer, a required tool call and seeded sampled answers (the coupled rule:
    a seeded request's tokens are its plain ones) are the same with and without speculation."""
    for extra in CONSTRAINED:
        chat = [{"role": "system", "content": f"conversation {uuid.uuid4().hex[:8]}"},
                {"role": "user", "content": "What is the weather in Paris for the next days?"}]
        body = {"model": MODEL, "messages": chat, "max_tokens": 96, "temperature": 0, **extra}
        answers = []
        for base_url in (server.base_url, speculative_server.base_url):
            response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            for call in choice["message"].get("tool_calls") or ():
                call.pop("id")  # a fresh id per call
            answers.append(choice)
        assert answers[1]["message"] == answers[0]["message"]
        assert answers[1]["finish_reason"] == answers[0]["finish_reason"]
        if "response_format" in extra:
            assert set(json.loads(answers[1]["message"]["content"])) >= {"city", "days"}
        if "tools" in extra:
            assert answers[1]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"

"""The Responses and Anthropic routes on a real ``phloem serve`` with API keys: a response id of
another key is 404 everywhere (and stays untouched), Anthropic clients authenticate (also with
``x-api-key``) and get Anthropic's error envelope, and a response survives a server restart (it
is a session turn: journaled)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from live_servers import ServerProcess

from phloem.runtime import ensure_default_model
from phloem.runtime.default_model import RANDOM_MODEL_NAME

pytestmark = pytest.mark.slow  # phloem serve processes of its own

ALICE = "alice-responses-key-0123456"
BOB = "bob-responses-key-78901234"
MODEL = RANDOM_MODEL_NAME  # the model the server below serves


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("keyed-protocols")
    server = ServerProcess(folder, ["--model", str(ensure_default_model(data_dir)),
                                    "--api-key", ALICE, "--api-key", BOB]).start()
    yield server
    server.stop()


def client(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def test_another_keys_response_is_404_everywhere(keyed: ServerProcess) -> None:
    alice, bob = client(keyed, ALICE), client(keyed, BOB)
    mine = alice.responses.create(model=MODEL, input="secret plans", max_output_tokens=3)
    for attempt in (lambda: bob.responses.retrieve(mine.id), lambda: bob.responses.delete(mine.id),
                    lambda: list(bob.responses.input_items.list(mine.id)),
                    lambda: bob.responses.create(model=MODEL, previous_response_id=mine.id, input="x")):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert alice.responses.retrieve(mine.id).model_dump() == mine.model_dump()
    assert [i.content[0].text for i in alice.responses.input_items.list(mine.id)] == ["secret plans"]


def test_anthropic_keys_come_as_x_api_key_or_bearer(keyed: ServerProcess) -> None:
    import anthropic  # here, not at the top: 2 s that every collection would pay

    messages = [{"role": "user", "content": "hello"}]
    with anthropic.Anthropic(base_url=keyed.base_url, api_key=ALICE, max_retries=0) as claude:
        reply = claude.messages.create(model=MODEL, max_tokens=3, messages=messages)  # type: ignore[arg-type]
        assert reply.usage.output_tokens == 3 and reply.stop_reason == "max_tokens"
    with anthropic.Anthropic(base_url=keyed.base_url, api_key="not-a-key-of-this-server", max_retries=0) as wrong:
        with pytest.raises(anthropic.AuthenticationError) as refused:
            wrong.messages.create(model=MODEL, max_tokens=3, messages=messages)  # type: ignore[arg-type]
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # Anthropic's own header (what Claude Code and older clients send).
    body = {"model": MODEL, "max_tokens": 3, "messages": messages}
    plain = httpx.post(f"{keyed.base_url}/v1/messages", json=body, headers={"x-api-key": ALICE}, timeout=60)
    assert plain.status_code == 200 and plain.json()["usage"]["output_tokens"] == 3
    both = httpx.post(f"{keyed.base_url}/v1/messages", json=body, timeout=60,
                      headers={"x-api-key": ALICE, "Authorization": f"Bearer {ALICE}"})
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]


def test_a_response_survives_a_restart(keyed: ServerProcess) -> None:
    alice = client(keyed, ALICE)
    tools = [{"type": "function", "name": "lookup", "parameters": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["id"]}}]
    first = alice.responses.create(model=MODEL, input="find 3", tools=tools, tool_choice="required",  # type: ignore[arg-type]
                                   parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    keyed.stop()
    keyed.start()
    alice = client(keyed, ALICE)
    assert alice.responses.retrieve(first.id).model_dump() == first.model_dump()
    [call] = first.output
    assert call.type == "function_call"
    answer = alice.responses.create(model=MODEL, previous_response_id=first.id, tools=tools,  # type: ignore[arg-type]
                                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}],
                                    max_output_tokens=3)
    assert answer.id.endswith("_1") and answer.usage.input_tokens > first.usage.total_tokens

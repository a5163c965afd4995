"""Reasoning items of the Responses API, end to end, with a thinking chat template (the built-in
model's own template does not think): the prompt opens a ``<think>`` block, so the output is
reasoning (random weights never close it); the response has a ``reasoning`` item, streamed as
``reasoning_text`` events, counted in ``reasoning_tokens``, and rebuilt identically from the
turn's tokens by ``GET``; ``reasoning.effort: "none"`` turns it off. The app runs in process over
its own engine (the template is swapped on the tokenizer)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from transformers import AutoTokenizer

from phloem.api.server.app import create_app
from phloem.api.server.config import HttpConfig
from phloem.runtime import EngineClient, ensure_default_model
from phloem.runtime.default_model import RANDOM_MODEL_NAME
from phloem.sessions import SessionConfig, SessionManager, Tokenizer, model_fingerprint

pytestmark = pytest.mark.slow  # an engine and app in process

MODEL = RANDOM_MODEL_NAME  # the model the app below serves
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[TestClient]:  # type: ignore[type-arg]
    folder = tmp_path_factory.mktemp("responses-reasoning")
    model = ensure_default_model(data_dir)
    hf = AutoTokenizer.from_pretrained(str(model))
    hf.chat_template = THINKING_TEMPLATE
    engine = EngineClient.from_pretrained(model)
    engine.start()
    manager = SessionManager(engine, Tokenizer(hf), SessionConfig(data_dir=folder),
                             model_fingerprint=model_fingerprint(model))
    try:
        with TestClient(create_app(HttpConfig(), engine, manager, model=str(model)), base_url="http://127.0.0.1", timeout=60) as client:
            yield client
    finally:
        asyncio.run(engine.shutdown())


def events(response: Any) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


def test_reasoning_items_are_returned_streamed_counted_and_stored(http: TestClient) -> None:  # type: ignore[type-arg]
    body = {"model": MODEL, "input": f"Think ({uuid.uuid4().hex})", "max_output_tokens": 6, "temperature": 0}
    created = http.post("/v1/responses", json=body).json()
    [item] = created["output"]
    assert item["type"] == "reasoning" and item["content"][0]["type"] == "reasoning_text"
    assert item["content"][0]["text"] and created["status"] == "incomplete"
    assert created["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
    assert http.get(f"/v1/responses/{created['id']}").json() == created

    streamed = events(http.post("/v1/responses", json={**body, "stream": True}))
    kinds = [e["type"] for e in streamed]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    text = "".join(e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta")
    assert text == item["content"][0]["text"]  # greedy: the same reasoning
    assert kinds[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert streamed[-1]["response"]["output"] == [{**item, "id": streamed[-1]["response"]["output"][0]["id"]}]

    # A continuation: the reasoning of the first turn stays in the session's tokens.
    more = http.post("/v1/responses", json={**body, "previous_response_id": created["id"], "input": "More?"}).json()
    assert more["usage"]["input_tokens_details"]["cached_tokens"] == created["usage"]["total_tokens"]
    assert more["output"][0]["type"] == "reasoning"


def test_effort_none_turns_reasoning_off(http: TestClient) -> None:  # type: ignore[type-arg]
    body = {"model": MODEL, "input": f"Answer ({uuid.uuid4().hex})", "max_output_tokens": 4,
            "temperature": 0, "reasoning": {"effort": "none"}}
    created = http.post("/v1/responses", json=body).json()
    assert [i["type"] for i in created["output"]] == ["message"]
    assert created["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    assert created["reasoning"] == {"effort": "none", "summary": None}
    assert http.get(f"/v1/responses/{created['id']}").json() == created

"""OpenAI fields of today, sent by the stock ``openai`` client: chat's ``reasoning_effort`` (the
template's ``enable_thinking``), ``prompt_cache_key``, ``safety_identifier`` and ``verbosity``;
Responses' ``truncation: "auto"`` (the oldest input items dropped to fit a small context window)
and ``"disabled"`` (a 400); an unknown field is still a 400.

The app runs in process (a 256-token context window, a thinking chat template swapped onto the
tokenizer); the client talks to it through Litestar's ``TestClient`` as its HTTP client."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from litestar.testing import TestClient
from transformers import AutoTokenizer

from phloem.api.server.app import create_app
from phloem.api.server.config import HttpConfig
from phloem.engine.config import EngineConfig, SchedulerConfig
from phloem.runtime import EngineClient, ensure_default_model
from phloem.runtime.default_model import RANDOM_MODEL_NAME
from phloem.sessions import SessionConfig, SessionManager, Tokenizer, model_fingerprint

pytestmark = pytest.mark.slow  # an engine and app in process

MODEL = RANDOM_MODEL_NAME
CONTEXT = 256
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


@dataclass
class App:
    oai: openai.OpenAI
    tokenizer: Tokenizer


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Iterator[App]:
    folder = tmp_path_factory.mktemp("openai-fields")
    model = ensure_default_model(data_dir)
    hf = AutoTokenizer.from_pretrained(str(model))
    hf.chat_template = THINKING_TEMPLATE
    tokenizer = Tokenizer(hf)
    engine = EngineClient.from_pretrained(model, EngineConfig(scheduler=SchedulerConfig(max_model_len=CONTEXT)))
    engine.start()
    manager = SessionManager(engine, tokenizer, SessionConfig(data_dir=folder), model_fingerprint=model_fingerprint(model))
    try:
        with TestClient(create_app(HttpConfig(), engine, manager, model=str(model)), base_url="http://127.0.0.1", timeout=60) as http:
            # Not closed itself: closing would close the TestClient's transport (the block does).
            oai = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="unused", max_retries=0, http_client=http)
            yield App(oai, tokenizer)
    finally:
        asyncio.run(engine.shutdown())


def chat(app: App, **fields: Any) -> Any:
    messages = [{"role": "user", "content": "hello there"}]
    return app.oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,  # type: ignore[arg-type]
                                           **fields)


def test_chat_accepts_todays_fields(app: App) -> None:
    out = chat(app, reasoning_effort="low", prompt_cache_key=f"agent-{uuid.uuid4().hex}",
               safety_identifier="user-1234", verbosity="low")
    assert out.choices[0].finish_reason == "length" and out.usage is not None


def test_reasoning_effort_is_the_template_s_thinking_switch(app: App) -> None:
    """"none" and "minimal" close the think block in the prompt (thinking off); the others open
    it; ``chat_template_kwargs``' own ``enable_thinking`` wins."""
    prompt = {effort: chat(app, reasoning_effort=effort, extra_body={"ignore_eos": True}).usage.prompt_tokens
              for effort in ("none", "minimal", "low", "medium", "high")}
    off, on = prompt["none"], prompt["high"]
    assert off > on and prompt["minimal"] == off and prompt["low"] == prompt["medium"] == on
    default = chat(app).usage.prompt_tokens
    assert default == on  # the template's default: thinking on
    forced = chat(app, reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert forced.usage.prompt_tokens == on


def test_an_unknown_field_is_still_a_400(app: App) -> None:
    with pytest.raises(openai.BadRequestError, match="reasoning_efort"):
        chat(app, extra_body={"reasoning_efort": "low"})
    with pytest.raises(openai.BadRequestError, match="truncate"):
        app.oai.responses.create(model=MODEL, input="hi", extra_body={"truncate": "auto"})


def _items(n: int) -> list[dict[str, str]]:
    """``n`` alternating user/assistant messages of ~40 tokens each, unique to this call."""
    tag = uuid.uuid4().hex[:8]
    return [{"role": "user" if i % 2 == 0 else "assistant",
             "content": f"item {i} {tag} " + " ".join(f"word{j}" for j in range(12))} for i in range(n)]


def _tokens(app: App, instructions: str, items: list[dict[str, str]]) -> int:
    messages = [{"role": "system", "content": instructions}, *items]
    return len(app.tokenizer.render_messages(messages, add_generation_prompt=True))


def test_responses_truncation_auto_drops_the_oldest_items(app: App) -> None:
    instructions = "You are terse."
    items = _items(13)
    assert _tokens(app, instructions, items) >= CONTEXT  # too long as a whole
    with pytest.raises(openai.BadRequestError, match="context window"):
        app.oai.responses.create(model=MODEL, input=items, instructions=instructions,  # type: ignore[arg-type]
                                 max_output_tokens=2, truncation="disabled")
    out = app.oai.responses.create(model=MODEL, input=items, instructions=instructions,  # type: ignore[arg-type]
                                   max_output_tokens=2, temperature=0, truncation="auto",
                                   prompt_cache_key="conversation-1", safety_identifier="user-1",
                                   text={"verbosity": "low"})
    assert out.status in ("completed", "incomplete") and out.truncation == "auto"
    # Kept: the instructions and the longest tail of the items that leaves room for a token.
    kept = next(k for k in range(len(items)) if _tokens(app, instructions, items[k:]) < CONTEXT)
    assert kept > 0 and out.usage is not None
    assert out.usage.input_tokens == _tokens(app, instructions, items[kept:])

    # A continuation past the window is cut the same way, its chain's items first.
    first = app.oai.responses.create(model=MODEL, input=items[:4], instructions=instructions,  # type: ignore[arg-type]
                                     max_output_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError, match="context window"):
        app.oai.responses.create(model=MODEL, input=items[4:], previous_response_id=first.id,  # type: ignore[arg-type]
                                 max_output_tokens=2)
    more = app.oai.responses.create(model=MODEL, input=items[4:], previous_response_id=first.id,  # type: ignore[arg-type]
                                    max_output_tokens=2, truncation="auto")
    assert more.usage is not None and more.usage.input_tokens < CONTEXT

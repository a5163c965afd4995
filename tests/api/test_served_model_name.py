"""``--served-model-name`` and ``--chat-template`` take effect in a served app (in process): the
names are listed in ``/v1/models`` and accepted in ``model``, another name is still 404, and the
template file renders the prompt (and is what the tool-call format is read from)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient

from phloem.api.server.app import create_app
from phloem.api.server.config import HttpConfig
from phloem.cli.compose import build_sessions, load_tokenizer
from phloem.cli.config import ServerConfig
from phloem.runtime import EngineClient
from phloem.runtime.builtin_model import DEFAULT_MODEL_NAME, trained_model_path
from phloem.sessions import SessionConfig

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def named_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, ServerConfig]]:  # type: ignore[type-arg]
    folder = tmp_path_factory.mktemp("phloem-served-names")
    template = folder / "template.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    model = str(trained_model_path())
    config = ServerConfig(model=model, chat_template=template, sessions=SessionConfig(data_dir=folder),
                          http=HttpConfig(served_model_names=("qwen", "qwen-latest")))
    engine = EngineClient.from_pretrained(model)
    engine.start()
    manager = build_sessions(config, engine)
    app = create_app(config.http, engine, manager, model=config.model)
    try:
        with TestClient(app, base_url="http://127.0.0.1", timeout=60) as client:
            yield client, config
    finally:
        asyncio.run(engine.shutdown())


def test_every_served_name_is_listed_the_first_reported(named_app: tuple[TestClient, ServerConfig]) -> None:  # type: ignore[type-arg]
    client, _ = named_app
    listed = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == ["qwen", "qwen-latest"]
    assert client.get("/v1/models/qwen-latest").json()["id"] == "qwen-latest"
    assert client.get("/health").json()["model"] == "qwen"


@pytest.mark.parametrize("name", ["qwen", "qwen-latest"])
def test_each_served_name_is_accepted(named_app: tuple[TestClient, ServerConfig], name: str) -> None:  # type: ignore[type-arg]
    client, _ = named_app
    reply = client.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES, "max_tokens": 2})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "qwen"


@pytest.mark.parametrize("name", ["other", DEFAULT_MODEL_NAME])
def test_other_names_are_still_404(named_app: tuple[TestClient, ServerConfig], name: str) -> None:  # type: ignore[type-arg]
    """Served names replace the folder's name (as in vLLM); an unknown name is 404 as before."""
    client, _ = named_app
    reply = client.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES, "max_tokens": 2})
    assert reply.status_code == 404 and "this server serves 'qwen'" in reply.text
    assert client.get(f"/v1/models/{name}").status_code == 404


def test_the_chat_template_file_renders_the_prompt(named_app: tuple[TestClient, ServerConfig]) -> None:  # type: ignore[type-arg]
    client, config = named_app
    tokenizer = load_tokenizer(config)
    assert tokenizer.chat_template == TEMPLATE  # the tool-call format and reasoning tags are read from it
    assert tokenizer.render_text(MESSAGES) == "[user] hello there\n"
    reply = client.post("/v1/chat/completions", json={"model": "qwen", "messages": MESSAGES, "max_tokens": 2})
    assert reply.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("[user] hello there\n"))
    own = load_tokenizer(ServerConfig(model=config.model))
    assert own.render_text(MESSAGES) != tokenizer.render_text(MESSAGES)

"""Schemathesis against the served OpenAPI schema, in process (the Litestar ASGI app over a real
engine): more than 1,000 generated requests across every operation, valid and invalid, with no
5xx, every status, content type and JSON body as the schema documents, and a healthy server
afterwards.

Generated cases are nudged so that they reach real work: half of them name a session that
exists (random ids only ever find 404), half of the OpenAI requests name the served model, and
every generation is capped at a few tokens (the schema allows up to the whole context window,
which would only make the run slow).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from litestar import Litestar
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance, negative_data_rejection, response_schema_conformance,
    status_code_conformance,
)

from phloem.api.server.app import create_app
from phloem.api.server.config import HttpConfig
from phloem.runtime import EngineClient, ensure_default_model
from phloem.runtime.default_model import RANDOM_MODEL_NAME
from phloem.sessions import SessionConfig, SessionManager, Tokenizer, model_fingerprint

pytestmark = pytest.mark.slow  # a schemathesis run over the whole API

MODEL = RANDOM_MODEL_NAME  # the model the app below serves
NUM_POSITIVE = 70
NUM_NEGATIVE = 12
MAX_TOKENS = 3
POSITIVE_CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
                   response_schema_conformance]


@pytest.fixture(scope="module")
def app(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Litestar]:
    folder = tmp_path_factory.mktemp("fuzz")
    model = ensure_default_model(data_dir)
    engine = EngineClient.from_pretrained(model)
    engine.start()
    # schemathesis's ASGI client sends `Host: testserver`.
    config = HttpConfig(max_body_bytes=256 * 1024, allowed_hosts=("testserver",))
    manager = SessionManager(engine, Tokenizer.from_pretrained(model), SessionConfig(data_dir=folder),
                             model_fingerprint=model_fingerprint(model))
    try:
        yield create_app(config, engine, manager, model=str(model))
    finally:
        asgi.shutdown_lifespans()
        asyncio.run(engine.shutdown())


def _cap_generation(body: Any, path: str) -> None:
    """At most ``MAX_TOKENS`` per generation. Only a missing, null or valid count is replaced,
    so an invalid case stays invalid."""
    if not isinstance(body, dict):
        return
    generate = body.get("generate")
    if isinstance(generate, dict):
        _cap(generate, "max_tokens")
    if path == "/v1/responses":
        _cap(body, "max_output_tokens")
    elif "model" in body and not path.endswith("/count_tokens"):
        _cap(body, "max_tokens")
        if body.get("max_completion_tokens") is not None:
            _cap(body, "max_completion_tokens")


def _cap(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is None:
        body[name] = MAX_TOKENS
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        body[name] = min(value, MAX_TOKENS)


def _nudge(case: Any, session_ids: list[str], choice: int) -> None:
    if "session_id" in (case.path_parameters or {}) and choice % 2:
        case.path_parameters["session_id"] = session_ids[choice % len(session_ids)]
    if isinstance(case.body, dict) and "model" in case.body and choice % 2:
        case.body["model"] = MODEL
    _cap_generation(case.body, case.path)


def test_schemathesis_finds_no_5xx_and_no_schema_violation(app: Litestar) -> None:
    schema = schemathesis.openapi.from_asgi("/schema/openapi.json", app)
    with asgi.get_client(app) as client:
        session_ids = [client.post("/v1/sessions", json={"text": f"fuzz {i}"}).json()["id"]
                       for i in range(4)]
    counts = {"positive": 0, "negative": 0}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14, [op.label for op in operations]
    for operation in operations:
        for mode, num_examples in ((GenerationMode.POSITIVE, NUM_POSITIVE),
                                   (GenerationMode.NEGATIVE, NUM_NEGATIVE)):
            checks = POSITIVE_CHECKS if mode.is_positive else [not_a_server_error, negative_data_rejection]

            @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode), choice=st.integers(0, 1 << 16))
            def run(case: Any, choice: int) -> None:
                _nudge(case, session_ids, choice)
                counts[mode.value] += 1
                case.call_and_validate(checks=checks)

            try:
                run()
            except Unsatisfiable:
                assert not mode.is_positive, operation.label  # nothing invalid to send there
    assert counts["positive"] + counts["negative"] >= 1000, counts

    with asgi.get_client(app) as client:
        assert client.get("/health").json()["status"] == "ok"
        sid = client.post("/v1/sessions", json={"text": "still"}).json()["id"]
        after = client.post(f"/v1/sessions/{sid}/append",
                            json={"text": " here", "generate": {"max_tokens": 2}})
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2

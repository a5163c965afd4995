"""A Responses conversation whose session is spilled to host memory, then to disk, between its
responses resumes from the spilled segments: each continuation reports the whole conversation as
cached although the engine's prefix cache was emptied, and its greedy tokens equal those of a
never-spilled twin conversation.

The server is the app on real uvicorn in this process (``live_app``, one per device), driven by
the stock ``openai`` client over HTTP: the test needs the engine itself, to empty its prefix cache
before each compared turn (so a hit can only come from the segment) and to read the resume
counters.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from live_servers import LiveApp, live_app

from phloem.api.server.responses.input import locate
from phloem.cli.config import ServerConfig
from phloem.sessions.config import SessionConfig
from phloem.engine.config import EngineConfig, LoadConfig
from phloem.runtime import ensure_default_model
from phloem.runtime.default_model import RANDOM_MODEL_NAME

pytestmark = pytest.mark.slow  # an engine and app in process

MODEL = RANDOM_MODEL_NAME  # the model the app below serves


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, GPU])])
def app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
        data_dir: Path) -> Iterator[LiveApp]:
    """The app on ``request.param`` (on a GPU: CUDA-graph decode, pinned host copies)."""
    model = ensure_default_model(data_dir)
    config = ServerConfig(model=str(model), engine=EngineConfig(load=LoadConfig(device=request.param)),
                          sessions=SessionConfig(data_dir=tmp_path_factory.mktemp("responses-spill")))
    with live_app(model, config) as served:
        yield served


def output_ids(base_url: str, rid: str) -> list[int]:
    session_id, index = locate(rid)
    turns = httpx.get(f"{base_url}/v1/sessions/{session_id}/turns", params={"include_tokens": "true"}).json()
    turn = turns["turns"][index]
    return list(turn["token_ids"][len(turn["token_ids"]) - turn["num_output_tokens"]:])


def offload(base_url: str, rid: str, tier: str) -> None:
    url = f"{base_url}/v1/sessions/{locate(rid)[0]}"
    assert httpx.post(f"{url}/offload", json={"tier": tier}).status_code == 202
    deadline = time.monotonic() + 30
    while httpx.get(url).json()["status"] != tier:
        assert time.monotonic() < deadline, f"the offload to {tier} did not finish"
        time.sleep(0.05)


def test_a_spilled_conversation_resumes_from_its_segments(app: LiveApp) -> None:
    oai = openai.OpenAI(base_url=f"{app.base_url}/v1", api_key="unused", max_retries=0)
    opening = f"Plan a trip ({uuid.uuid4().hex})"
    turns = [dict(input=opening, instructions="Be brief."), dict(input="Where first?"), dict(input="And then?")]
    greedy: Any = dict(model=MODEL, max_output_tokens=6, temperature=0)

    twin, twin_ids = [], [None]
    for turn in turns:
        response = oai.responses.create(**greedy, **turn, previous_response_id=twin_ids[-1])
        twin.append(output_ids(app.base_url, response.id))
        twin_ids.append(response.id)
    for rid in twin_ids[1:]:
        oai.responses.delete(rid)  # the twin's session goes with its last response: nothing stays pinned
    assert httpx.get(f"{app.base_url}/v1/sessions").json()["sessions"] == []

    first = oai.responses.create(**greedy, **turns[0])
    assert output_ids(app.base_url, first.id) == twin[0]
    previous, spilled_total = first.id, first.usage.total_tokens
    for tier, turn, expected in (("host", turns[1], twin[1]), ("disk", turns[2], twin[2])):
        offload(app.base_url, previous, tier)
        asyncio.run(app.engine.reset_prefix_cache())
        before = app.manager.stats().resumes[tier].count
        response = oai.responses.create(**greedy, **turn, previous_response_id=previous)
        assert output_ids(app.base_url, response.id) == expected, f"resumed from {tier}"
        assert response.usage.input_tokens_details.cached_tokens == spilled_total, tier
        assert app.manager.stats().resumes[tier].count == before + 1
        previous, spilled_total = response.id, response.usage.total_tokens

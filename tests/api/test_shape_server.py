"""``phloem serve --shape NAME``: dummy weights of a benchmark shape behind the real server."""

from __future__ import annotations

from pathlib import Path

import httpx
from live_servers import ServerProcess
import pytest

from phloem.runtime.model_shapes import SHAPES

pytestmark = pytest.mark.slow  # phloem serve processes of its own


def test_a_shape_server_says_its_weights_are_dummy_and_serves_token_prompts(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, ["--shape", "tiny"]).start()
    try:
        models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["tiny"] and "DUMMY" in models[0]["owned_by"]
        assert models[0]["max_model_len"] == SHAPES["tiny"]["max_position_embeddings"]
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 5, "ignore_eos": True, "return_token_ids": True}
        first = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60).json()
        ids = first["choices"][0]["token_ids"]
        assert len(ids) == 5 and all(0 <= t < SHAPES["tiny"]["vocab_size"] for t in ids)
        # The first prompt plus a token of our own: its prompt-end checkpoint, one token before
        # that prompt's end (so a resent prompt hits too), serves 3 of its 4 tokens.
        again = httpx.post(f"{server.base_url}/v1/completions", json=body | {"prompt": [5, 6, 7, 8, 9]}, timeout=60).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3
        # Text goes through the demo tokenizer, whose ids fit in the shape's vocabulary.
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
                "max_tokens": 4, "ignore_eos": True}
        response = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()

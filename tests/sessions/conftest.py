"""Fixtures for the sessions tests: the built-in tiny model (random weights, real BPE tokenizer and
ChatML template), its tokenizer, one engine client for the whole run, fresh managers, and
``index_config``: the SessionConfig fields of each index backend (embedded SQLite; a real Redis
under a unique key prefix, deleted afterwards)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from redis_support import clear_prefix, random_prefix, require_redis

from phloem.runtime import EngineClient, ensure_default_model
from phloem.sessions import SessionConfig, SessionManager, Tokenizer, model_fingerprint


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("phloem-data"))


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="session")
def engine(model_dir: Path) -> Iterator[EngineClient]:
    """One started engine for every test (its prefix cache is shared, like a server's)."""
    client = EngineClient.from_pretrained(model_dir)
    client.start()
    yield client
    asyncio.run(client.shutdown())


@pytest.fixture
def make_manager(engine: EngineClient, tokenizer: Tokenizer, model_dir: Path,
                 tmp_path: Path) -> Callable[..., AbstractAsyncContextManager[SessionManager]]:
    """``async with make_manager(**config) as manager``: started on ``tmp_path``, closed after."""

    @asynccontextmanager
    async def make(data_dir: Path | None = None, **config: Any) -> AsyncIterator[SessionManager]:
        cfg = SessionConfig(data_dir=data_dir or tmp_path, **config)
        manager = SessionManager(engine, tokenizer, cfg, model_fingerprint=model_fingerprint(model_dir))
        await manager.start()
        try:
            yield manager
        finally:
            await manager.close()

    return make


@pytest.fixture(params=["sqlite", "redis"])
def index_config(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """``SessionConfig`` fields selecting each index backend (Redis: a fresh key prefix)."""
    if request.param == "sqlite":
        yield {}
        return
    url, prefix = require_redis(), random_prefix()
    try:
        yield {"redis_url": url, "redis_prefix": prefix}
    finally:
        clear_prefix(url, prefix)

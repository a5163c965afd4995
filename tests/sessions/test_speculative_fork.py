"""A session forked under MTP speculation: each child's next turn reuses the parent's history and
gives the tokens the same session gets without speculation (the trained built-in model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from phloem.engine.config import EngineConfig, SpeculativeConfig
from phloem.runtime import EngineClient
from phloem.runtime.builtin_model import trained_model_path
from phloem.sessions import GenerateOptions, SessionConfig, SessionInput, SessionManager, Tokenizer, model_fingerprint

pytestmark = pytest.mark.slow  # two engines and managers

OWNER = "key-1"


async def _forked_turns(k: int, data_dir: Path) -> list[tuple[tuple[int, ...], int, int]]:
    """(output ids, cached tokens, parent tokens) of a root's second turn and of three forks'."""
    model = trained_model_path()
    spec = SpeculativeConfig("mtp", k) if k else SpeculativeConfig()
    engine = EngineClient.from_pretrained(model, EngineConfig(speculative=spec))
    engine.start()
    manager = SessionManager(engine, Tokenizer.from_pretrained(model), SessionConfig(data_dir=data_dir),
                             model_fingerprint=model_fingerprint(model))
    await manager.start()
    results = []
    try:
        greedy = GenerateOptions(max_tokens=24, temperature=0.0)
        seeded = GenerateOptions(max_tokens=24, temperature=0.8, seed=5)
        root = await manager.create(OWNER, content=SessionInput(text="You are a coding assistant."))
        ask = SessionInput(messages=({"role": "user", "content": "Write a function that returns the mean."},))
        first = await (await manager.append(OWNER, root.session_id, ask, greedy)).result()
        results.append((tuple(first.output_ids), first.usage.cached_tokens, 0))
        children = await manager.fork(OWNER, root.session_id, 3)
        parent = manager.get(OWNER, root.session_id)
        for i, child in enumerate(children):
            branch = SessionInput(messages=({"role": "user", "content": f"Now branch {i}: handle empty lists."},))
            out = await (await manager.append(OWNER, child.session_id, branch, seeded if i == 1 else greedy)).result()
            results.append((tuple(out.output_ids), out.usage.cached_tokens, parent.num_tokens))
    finally:
        await manager.close()
        await engine.shutdown()
    return results


def test_forked_sessions_equal_plain(tmp_path: Path) -> None:
    plain = asyncio.run(_forked_turns(0, tmp_path / "plain"))
    speculative = asyncio.run(_forked_turns(2, tmp_path / "mtp"))
    assert speculative == plain  # tokens and cached counts
    for _, cached, parent_tokens in speculative[1:]:
        # The whole history, and a later branch also the turn header an earlier one published.
        assert cached >= parent_tokens, "the fork reused the parent's history"

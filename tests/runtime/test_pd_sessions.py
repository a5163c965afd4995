"""Sessions over a decode instance: turns, a fork and generations equal a colocated server's.

The built-in demo model (real tokenizer and chat template, random weights) runs in a prefill
process and in this one; ``SessionManager`` drives a ``PDEngineClient`` and, for reference, a
plain ``EngineClient``, with the same calls. The first generation is prefilled by the prefill
process; later turns and the fork's branches extend what the decode side holds, so they compute
only their new tokens there (``local_prefill_tokens``, default 512). The root is then spilled to
host twice: once its next turn finds the prefix still cached (nothing to load), once after the
cache is emptied (the host copy is loaded): both servers count the same tokens by source.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest

from phloem.engine import Engine
from phloem.runtime import EngineClient, ensure_default_model
from phloem.engine import EngineConfig
from phloem.runtime.pd.decode import PDEngineClient
from phloem.runtime.pd.prefill import run_prefill_worker
from phloem.runtime.pd.roles import PDConfig
from phloem.sessions import GenerateOptions, SessionConfig, SessionInput, SessionManager, Tokenizer, model_fingerprint

pytestmark = pytest.mark.slow  # a prefill process

OWNER = "key-1"


def user(text: str) -> SessionInput:
    return SessionInput(messages=({"role": "user", "content": text},))


async def conversation(engine: EngineClient, model: Path,
                       data_dir: Path) -> tuple[list[tuple[int, ...]], list[int], dict[str, int]]:
    """Three turns, a fork into two branches, one more turn in each, then two turns of the root
    after spills to host; output ids, cached counts, and already-sent tokens by source."""
    config = SessionConfig(data_dir=data_dir)
    manager = SessionManager(engine, Tokenizer.from_pretrained(model), config,
                             model_fingerprint=model_fingerprint(model))
    await manager.start()
    options = GenerateOptions(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs, cached = [], []
    try:
        system = SessionInput(messages=({"role": "system", "content": "You are terse."},))
        root = await manager.create(OWNER, content=system)
        for text in ("hi", "and then?", "why?"):
            result = await (await manager.append(OWNER, root.session_id, user(text), options)).result()
            outputs.append(result.output_ids)
            cached.append(result.usage.cached_tokens)
        children = await manager.fork(OWNER, root.session_id, 2)
        for child, text in zip(children, ("left", "right")):
            result = await (await manager.append(OWNER, child.session_id, user(text), options)).result()
            outputs.append(result.output_ids)
            cached.append(result.usage.cached_tokens)
        for text, evict in (("still cached?", False), ("from host?", True)):
            assert (await manager.offload(OWNER, root.session_id, "host", wait=True)).status == "host"
            if evict:
                await engine.reset_prefix_cache()
            result = await (await manager.append(OWNER, root.session_id, user(text), options)).result()
            outputs.append(result.output_ids)
            cached.append(result.usage.cached_tokens)
        served = dict(manager.stats().served.served_tokens)
    finally:
        await manager.close()
    return outputs, cached, served


def test_sessions_on_a_decode_instance_equal_a_colocated_server(tmp_path: Path) -> None:
    model = ensure_default_model(tmp_path / "data")
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=run_prefill_worker, daemon=True, args=(
        str(model), EngineConfig(), PDConfig(role="prefill", peer="127.0.0.1:0"), theirs))
    proc.start()
    theirs.close()
    try:
        assert ours.poll(120), "the prefill process did not start"
        kind, port = ours.recv()
        assert kind == "ready", port

        async def main() -> None:
            async with EngineClient(Engine.from_pretrained(model)) as ref:
                expected, ref_cached, ref_served = await conversation(ref, model, tmp_path / "ref")
            config = PDConfig(role="decode", peer=f"127.0.0.1:{port}", retry_local=False)
            async with PDEngineClient(Engine.from_pretrained(model), config) as client:
                got, cached, served = await conversation(client, model, tmp_path / "pd")
                assert (client.num_remote, client.num_local, client.num_failed) == (1, 6, 0)
            assert got == expected
            # The same tokens by source; the spill after the eviction was loaded back from host.
            assert served == ref_served and served["host"] > 0 and served["recomputed"] == 0
            # Turns 2+ and the branches reused the whole history held on the decode side.
            assert cached[1:] == ref_cached[1:] and all(c > 0 for c in cached[1:])

        asyncio.run(main())
    finally:
        proc.kill()
        proc.join(10)

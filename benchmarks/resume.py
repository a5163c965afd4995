"""Resume time of a long session from host and from disk, against recomputing its prefill.

One session of ``prompt_len`` tokens (plus one short generated turn) is spilled; each repetition
forks it (the child shares the spilled segment), empties the engine's prefix cache, and times
the child's next turn (``append_len`` new tokens, one generated token), and separately the load
alone (``prefetch``: read + import). The recompute path forks a never-spilled twin of the same
tokens; the hot path is the same turn with the prefix still cached. The host and disk paths must
give the cached path's tokens (greedy; the same state resumed); whether the recompute does is
reported (in bf16 on a GPU a recomputed prefill sums in another order and may pick another
token; in fp32 on the CPU it agrees). Medians over ``reps`` repetitions.

NOTE: on the CPU machine "disk" reads come from the page cache (the file was just written), so
the disk figure is the cost of the safetensors read and validation, not of the device.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from phloem.runtime import EngineClient, EngineConfig
from phloem.sessions import (
    GenerateOptions, SessionConfig, SessionInput, SessionManager, Tokenizer, model_fingerprint,
)

__all__ = ["ResumeReport", "ResumeRow", "run_resume_bench"]

_OWNER = "bench"


@dataclass(frozen=True, slots=True)
class ResumeRow:
    path: str
    load_s: float | None
    turn_s: float
    cached_tokens: int
    prompt_tokens: int
    same_as_cached: bool = True  # every repetition gave the cached path's tokens


@dataclass(frozen=True, slots=True)
class ResumeReport:
    rows: list[ResumeRow]
    segment_bytes: int

    def table(self) -> str:
        lines = ["| path | load (prefetch) s | next turn s | cached / prompt tokens | tokens as cached |",
                 "|---|---|---|---|---|"]
        for r in self.rows:
            load = "—" if r.load_s is None else f"{r.load_s:.4f}"
            same = "yes" if r.same_as_cached else "no"
            lines.append(f"| {r.path} | {load} | {r.turn_s:.4f} | {r.cached_tokens} / {r.prompt_tokens} | {same} |")
        return "\n".join(lines) + f"\n\nsegment: {self.segment_bytes / 2**20:.2f} MiB"


def run_resume_bench(model_dir: Path, data_dir: Path, prompt_len: int = 4096, append_len: int = 16,
                     reps: int = 5, options: EngineConfig | None = None) -> ResumeReport:
    """Measure the resume paths (see the module docstring) and return their medians."""
    return asyncio.run(_bench(model_dir, data_dir, prompt_len, append_len, reps, options))


async def _bench(model_dir: Path, data_dir: Path, prompt_len: int, append_len: int, reps: int,
                 options: EngineConfig | None) -> ResumeReport:
    engine = EngineClient.from_pretrained(model_dir, options)
    engine.start()
    config = SessionConfig(data_dir=data_dir,
                           idle_to_host_s=86_400.0)
    m = SessionManager(engine, Tokenizer.from_pretrained(model_dir), config,
                      model_fingerprint=model_fingerprint(model_dir))
    await m.start()
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompt = tuple(rng.randrange(3, vocab) for _ in range(prompt_len))
    follow = tuple(rng.randrange(3, vocab) for _ in range(append_len))
    one = GenerateOptions(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        spilled, twin = [await _session(m, prompt, one) for _ in range(2)]
        rows: list[ResumeRow] = []
        outputs: dict[str, set[tuple[int, ...]]] = {}
        for path in ("cached", "host", "disk", "recompute"):
            if path in ("host", "disk"):
                await m.offload(_OWNER, spilled, path, wait=True)  # type: ignore[arg-type]
                assert m.get(_OWNER, spilled).status == path
            loads, turns = [], []
            for _ in range(reps):
                parent = spilled if path in ("host", "disk") else twin
                child = (await m.fork(_OWNER, parent))[0].session_id
                if path != "cached":
                    await engine.reset_prefix_cache()
                if path in ("host", "disk"):
                    start = time.perf_counter()
                    await m.prefetch(_OWNER, child, wait=True)
                    loads.append(time.perf_counter() - start)
                start = time.perf_counter()
                generation = await m.append(_OWNER, child, SessionInput(input_ids=follow), one)
                result = await generation.result()
                turns.append(time.perf_counter() - start)
                outputs.setdefault(path, set()).add(tuple(result.output_ids))
                await m.delete(_OWNER, child)
            rows.append(ResumeRow(path, statistics.median(loads) if loads else None,
                                  statistics.median(turns), result.usage.cached_tokens,
                                  result.usage.prompt_tokens, outputs[path] == outputs["cached"]))
        for path in ("host", "disk"):
            assert outputs[path] == outputs["cached"], f"{path} resumed other tokens: {outputs}"
        segment = m._sessions[spilled].segment  # noqa: SLF001 (a benchmark reads the size)
        return ResumeReport(rows, segment.nbytes if segment is not None else 0)
    finally:
        await m.close()
        await engine.shutdown()


async def _session(m: SessionManager, prompt: tuple[int, ...], options: GenerateOptions) -> str:
    session = await m.create(_OWNER, content=SessionInput(input_ids=prompt), ttl=0)
    generation = await m.append(_OWNER, session.session_id, SessionInput(input_ids=(5,)), options)
    await generation.result()
    return session.session_id

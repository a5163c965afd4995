"""Offline multi-turn agent workload against the engine, with and without the prefix cache.

One conversation: a long first turn, then ``turns - 1`` turns that append ``append_len`` new tokens
(a tool result) to the previous prompt + output. Reports, per turn and in total, the prompt tokens,
the tokens served from the cache, the tokens actually computed, and wall time. Greedy, with
``ignore_eos`` so every turn generates exactly ``output_len`` tokens; outputs with and without the
cache are checked to be identical. With ``namespace``, the conversation runs as one tenant of a
partitioned cache (``engine.cache.radix``, "Namespaces"), for the cost of the partition.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

from phloem.engine import Engine, EngineConfig, SamplingParams
from phloem.engine.config import ModelConfig
from phloem.runtime.progress import progress

__all__ = ["PrefixCacheReport", "TurnStats", "run_prefix_cache_bench"]


@dataclass(frozen=True, slots=True)
class TurnStats:
    turn: int
    prompt_tokens: int
    cached_tokens: int
    seconds: float

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True, slots=True)
class PrefixCacheReport:
    cached: list[TurnStats]
    uncached: list[TurnStats]

    def totals(self, turns: list[TurnStats]) -> tuple[int, int, float]:
        return (
            sum(t.prompt_tokens for t in turns),
            sum(t.cached_tokens for t in turns),
            sum(t.seconds for t in turns),
        )

    def table(self) -> str:
        lines = ["| turn | prompt tokens | cached (cache on) | computed (cache on) | s (on) | s (off) |", "|---|---|---|---|---|---|"]
        for on, off in zip(self.cached, self.uncached):
            lines.append(
                f"| {on.turn} | {on.prompt_tokens} | {on.cached_tokens} | {on.computed_tokens} "
                f"| {on.seconds:.3f} | {off.seconds:.3f} |"
            )
        p, c, s_on = self.totals(self.cached)
        _, _, s_off = self.totals(self.uncached)
        lines.append(f"| **all** | {p} | {c} ({c / p:.1%}) | {p - c} | {s_on:.2f} | {s_off:.2f} |")
        return "\n".join(lines)


def _run(engine: Engine, first: list[int], turns: int, append_len: int, output_len: int, seed: int,
         bar: tuple[str, bool | None], namespace: str | None) -> tuple[list[TurnStats], list[list[int]]]:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    history, stats, outputs = list(first), [], []
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    label, show = bar
    for turn in progress(range(1, turns + 1), turns, label, "turn", show):
        t0 = time.perf_counter()
        out = engine.generate([history], params, namespace)[0]
        stats.append(TurnStats(turn, len(history), out.num_cached_tokens, time.perf_counter() - t0))
        outputs.append(out.token_ids)
        history = history + out.token_ids + [rng.randrange(vocab) for _ in range(append_len)]
    return stats, outputs


def run_prefix_cache_bench(
    model_path: Path,
    turns: int = 12,
    first_turn_len: int = 2000,
    append_len: int = 80,
    output_len: int = 16,
    seed: int = 0,
    namespace: str | None = None,
    config: EngineConfig | None = None,
) -> PrefixCacheReport:
    """Run the workload twice (cache on, cache off) on fresh engines and compare; with
    ``namespace``, every request of it runs in that prefix-cache namespace (a tenant).

    The engines are built from ``config`` (None: ``EngineConfig()``) with the prefix cache on, then
    off; its ``load.show_progress`` (False: never) also governs the per-turn progress bars.
    """
    rng = random.Random(seed)
    vocab = ModelConfig.from_pretrained(model_path).vocab_size
    first = [rng.randrange(vocab) for _ in range(first_turn_len)]
    config = config if config is not None else EngineConfig()
    show = config.load.show_progress
    results = []
    for caching in (True, False):
        engine = Engine.from_pretrained(model_path, config, cache=replace(config.cache, enable_prefix_caching=caching))
        label = f"prefix cache {'on' if caching else 'off'}"
        results.append(_run(engine, first, turns, append_len, output_len, seed,
                            (label, show if isinstance(show, bool) else None), namespace))
    (on, out_on), (off, out_off) = results
    if out_on != out_off:
        raise AssertionError("outputs with and without the prefix cache differ")
    return PrefixCacheReport(on, off)

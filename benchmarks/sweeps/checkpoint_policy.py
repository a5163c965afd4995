"""Which GDN checkpoints to keep under slot pressure: Phloem's eviction order against TokenSpeed's
"two newest snapshots per request", on an agentic workload, CPU only.

    python3 benchmarks/sweeps/checkpoint_policy.py                  # the table in docs/benchmarks.md
    python3 benchmarks/sweeps/checkpoint_policy.py --agents 4 --slots 24

The engine is the real one (scheduler, radix cache, pools) over the toy model of the tests
(``tests/support/toy_model.py``: its KV and state are a running sum, so a wrong resume shows up
as a wrong token). Each agent holds a pinned session: a long first turn (periodic checkpoints
every ``--interval`` tokens inside it), then turns that append ``--append`` tokens and generate
``--output``; with ``--fork-at K``, each agent also retries turn ``K`` once after its last turn
(a branch from an earlier turn boundary, as tree search and retries do). The state-slot pool is
small (``--slots``), so checkpoints must be evicted:

- ``phloem``: the engine's order (``engine.cache.radix``): periodic checkpoints first, then turn
  boundaries cheapest first; a pinned head never;
- ``two-newest``: after every step, each session keeps only the two deepest checkpoints on its
  path (TokenSpeed's rule), and the rest of the tree is evicted as before.

The table gives the prompt tokens served from the cache (turns 2+, the retries apart) and the
tokens recomputed.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))

from toy_model import ToyModel, toy_config  # noqa: E402

from phloem.engine import Engine, SamplingParams  # noqa: E402
from phloem.engine.cache.radix import RadixCache, RadixNode  # noqa: E402
from phloem.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402


@dataclass
class Tally:
    prompt: int = 0
    cached: int = 0
    retry_prompt: int = 0
    retry_cached: int = 0


def make_engine(args: argparse.Namespace) -> Engine:
    config = dataclasses.replace(toy_config(), max_position_embeddings=1 << 20)
    cache = CacheConfig(page_size=16, num_pages=1 << 16, num_state_slots=args.slots, checkpoint_interval=args.interval)
    sched = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=args.agents + 1)
    import torch

    return Engine(config, ToyModel(), EngineConfig(cache=cache, scheduler=sched), torch.device("cpu"), torch.float32)


def keep_two_newest(tree: RadixCache, heads: list[RadixNode]) -> None:
    """Drop every checkpoint on each head's path but the two deepest (locked ones stay)."""
    for head in heads:
        n: RadixNode | None = head
        kept = 0
        while n is not None and n is not tree.root:
            if n.checkpoint is not None:
                kept += 1
                if kept > 2 and n.direct_ref == 0:
                    tree._free_victim(n, True)  # noqa: SLF001
            n = n.parent


def run(args: argparse.Namespace, policy: str) -> Tally:
    engine = make_engine(args)
    tree = engine.cache.tree
    assert tree is not None
    rng = random.Random(0)
    histories = [[rng.randrange(1, 90) for _ in range(args.first_turn)] for _ in range(args.agents)]
    boundaries: list[list[int]] = [[] for _ in range(args.agents)]
    pins: list[RadixNode | None] = [None] * args.agents
    tally = Tally()
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    for turn in range(1, args.turns + 1):
        if turn > 1:
            histories = [h + [rng.randrange(1, 90) for _ in range(args.append)] for h in histories]
        outs = engine.generate(histories, params)
        if policy == "two-newest":
            keep_two_newest(tree, [p for p in pins if p is not None])
        for i, out in enumerate(outs):
            if turn > 1:
                tally.prompt += len(histories[i])
                tally.cached += out.num_cached_tokens
            histories[i] = histories[i] + out.token_ids
            boundaries[i].append(len(histories[i]))
            if pins[i] is not None:
                engine.unpin_prefix(pins[i])  # type: ignore[arg-type]
            pins[i] = engine.pin_prefix(histories[i])
    if args.fork_at:
        retries = [h[: boundaries[i][args.fork_at - 1]] + [rng.randrange(1, 90) for _ in range(args.append)]
                   for i, h in enumerate(histories)]
        for i, out in enumerate(engine.generate(retries, params)):
            tally.retry_prompt += len(retries[i])
            tally.retry_cached += out.num_cached_tokens
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--first-turn", type=int, default=8192)
    parser.add_argument("--append", type=int, default=128)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--interval", type=int, default=1024, help="periodic checkpoint interval (tokens)")
    parser.add_argument("--slots", type=int, default=64, help="state slots in the pool")
    parser.add_argument("--fork-at", type=int, default=3, help="retry this turn once at the end (0: none)")
    args = parser.parse_args()
    print(f"{args.agents} agents, first turn {args.first_turn}, {args.turns} turns of +{args.append}/{args.output}, "
          f"periodic every {args.interval}, {args.slots} slots, retry of turn {args.fork_at}")
    print(f"{'policy':<12}{'turns 2+ cached':>18}{'recomputed':>12}{'retry cached':>16}{'retry recomputed':>18}")
    for policy in ("phloem", "two-newest"):
        t = run(args, policy)
        print(f"{policy:<12}{t.cached / t.prompt:>18.1%}{t.prompt - t.cached:>12}"
              f"{(t.retry_cached / t.retry_prompt if t.retry_prompt else 0):>16.1%}{t.retry_prompt - t.retry_cached:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

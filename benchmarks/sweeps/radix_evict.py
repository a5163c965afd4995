"""Radix-cache eviction cost on a tree of agent sessions (CPU; ``docs/benchmarks.md``).

Builds ``sessions`` conversations that share a 64-token system prompt, each with ``turns`` turns
of 40 new tokens and a checkpoint (with a tail page) at every turn end, then times one ``evict``
call that frees 10% of the tree's pages and one that frees everything.

    python3 benchmarks/sweeps/radix_evict.py
"""

from __future__ import annotations

import itertools
import random
import time

from phloem.engine.cache.radix import Checkpoint, RadixCache


def build(sessions: int, turns: int, seed: int = 0) -> tuple[RadixCache, list[int]]:
    rng = random.Random(seed)
    freed: list[int] = []
    tree = RadixCache(16, freed.extend, lambda _slot: None, 100, 3000)
    ids = itertools.count()
    system = [rng.randrange(1000) for _ in range(64)]
    for _ in range(sessions):
        history = list(system)
        for _ in range(turns):
            history += [rng.randrange(1000) for _ in range(40)]
            n = len(history)
            tail = next(ids) if n % 16 else None
            tree.insert(history, [next(ids) for _ in range(n // 16)], Checkpoint(next(ids), tail))
    return tree, freed


def main() -> None:
    print("| sessions × turns | nodes | evict 10% of pages | evict everything |")
    print("|---|---|---|---|")
    for sessions, turns in ((64, 12), (256, 12)):
        tree, freed = build(sessions, turns)
        nodes = len(tree._nodes())
        target, base = tree.num_pages // 10, len(freed)
        t0 = time.perf_counter()
        tree.evict(target, 0, lambda: len(freed) - base, lambda: 1 << 62)
        some = time.perf_counter() - t0
        tree, freed = build(sessions, turns)
        t0 = time.perf_counter()
        tree.clear()
        everything = time.perf_counter() - t0
        print(f"| {sessions} × {turns} | {nodes} | {target} pages: {1000 * some:.1f} ms | {1000 * everything:.1f} ms |")


if __name__ == "__main__":
    main()

"""The cost of partitioning the radix cache by tenant (CPU; ``docs/benchmarks.md``).

Builds the tree of ``radix_evict.py`` (``sessions`` conversations below one 64-token system
prompt, ``turns`` turns of 40 tokens, a checkpoint at each turn end) twice: unpartitioned (every
insert in the shared namespace, as a server without keys) and partitioned (the system prompt
shared, each session in one of ``tenants`` namespaces), then times every session's lookups of
its next turn (``match``, what admission does) and the inserts that built the tree. Best of
``repeats``.

    python3 benchmarks/sweeps/radix_namespaces.py
"""

from __future__ import annotations

import itertools
import random
import time

from phloem.engine.cache.radix import Checkpoint, RadixCache


def build(sessions: int, turns: int, tenants: int, seed: int = 0) -> tuple[RadixCache, list[tuple[list[int], str | None]], float]:
    """The tree, each session's (history, namespace), and the seconds its inserts took."""
    rng = random.Random(seed)
    tree = RadixCache(16, lambda _pages: None, lambda _slot: None, 100, 3000)
    ids = itertools.count()
    system = [rng.randrange(1000) for _ in range(64)]
    tree.insert(system, [next(ids) for _ in range(4)], Checkpoint(next(ids), None))
    histories, seconds = [], 0.0
    for session in range(sessions):
        namespace = f"tenant-{session % tenants}" if tenants else None
        history = list(system)
        for _ in range(turns):
            history += [rng.randrange(1000) for _ in range(40)]
            n = len(history)
            tail = next(ids) if n % 16 else None
            pages, checkpoint = [next(ids) for _ in range(n // 16)], Checkpoint(next(ids), tail)
            t0 = time.perf_counter()
            tree.insert(history, pages, checkpoint, namespace)
            seconds += time.perf_counter() - t0
        histories.append((history, namespace))
    return tree, histories, seconds


def lookups(tree: RadixCache, histories: list[tuple[list[int], str | None]], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for history, namespace in histories:
            assert tree.match(history + [1], len(history), namespace) is not None
        best = min(best, time.perf_counter() - t0)
    return best / len(histories)


def main(sessions: int = 256, turns: int = 12, tenants: int = 16, repeats: int = 20) -> None:
    print("| tree | nodes | match (next turn) | insert (one turn) |")
    print("|---|---|---|---|")
    for label, num_tenants in (("one namespace", 0), (f"{tenants} tenants + shared prompt", tenants)):
        tree, histories, insert_s = build(sessions, turns, num_tenants)
        match_s = lookups(tree, histories, repeats)
        print(f"| {label} | {len(tree._nodes())} | {1e6 * match_s:.1f} µs | "
              f"{1e6 * insert_s / (sessions * turns):.1f} µs |")


if __name__ == "__main__":
    main()

"""A spill's host copy with and without the pinned arena (``storage.pinned_arena``), on one GPU.

    python3 benchmarks/sweeps/pinned_arena_bench.py [--state-mb 250] [--arena-gib 8]

Prints, for a state of ``--state-mb`` (250 MB: one 8.9K-token session at the 35B-A3B shape):
the engine-thread time of today's export destination (a fresh block from torch's caching host
allocator, as while the host tier fills) against an arena range (copy included, both waited for);
whether an arena tensor reads as pinned and its host-to-device copy is queued, not waited for;
and what pinning on another thread costs a loop of short device steps on the main thread (each a
matmul and a synchronize): p50 / p99 / max step against the same loop alone. That stall is why
the server pins the arena at start-up, before its engine thread runs.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from phloem.storage.pinned_arena import PinnedArena

MB = 1 << 20


def _ms(f, n: int = 5) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


def _steps(seconds: float, stop: threading.Event | None = None) -> list[float]:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end and not (stop is not None and stop.is_set()):
        t = time.perf_counter()
        (a @ a).sum()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def _quantiles(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.2f} / {xs[int(0.99 * (len(xs) - 1))]:.2f} / {xs[-1]:.2f} ms ({len(xs)} steps)"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state-mb", type=int, default=250)
    p.add_argument("--arena-gib", type=int, default=8)
    args = p.parse_args()
    n = args.state_mb * MB
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")

    kept = []

    def fresh() -> None:  # today's export: a new pinned block, the copy, the wait
        out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        out.copy_(src, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        kept.append(out)  # the host tier keeps it: the next export cannot reuse its block

    fresh_ms = _ms(fresh, 8)
    kept.clear()

    base = _quantiles(_steps(2.0))
    built: list[PinnedArena] = []
    done = threading.Event()

    def build() -> None:
        built.append(PinnedArena(args.arena_gib << 30))
        done.set()

    t0 = time.perf_counter()
    threading.Thread(target=build).start()
    during = _steps(60.0, stop=done)
    done.wait()
    pin_s = time.perf_counter() - t0
    arena = built[0]

    def ranged() -> None:
        out = arena.alloc((n,), torch.uint8)
        assert out is not None, "the arena should serve this range"
        out.copy_(src, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        kept.append(out)

    arena_ms = _ms(ranged, 8)
    out = kept[-1]
    pinned = out.is_pinned()
    assert torch.equal(out[:4096].cuda(), src[:4096]), "arena copy differs"
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(out, non_blocking=True)
    queued_ms = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    total_ms = (time.perf_counter() - t) * 1e3
    used = arena.used_bytes
    kept.clear()
    del out
    arena.collect()
    print("| state | fresh pinned block + copy | arena range + copy | arena tensor pinned | H2D call / copy |")
    print("|---|---|---|---|---|")
    print(f"| {args.state_mb} MB | {fresh_ms:.1f} ms | {arena_ms:.1f} ms | {pinned} | {queued_ms:.2f} / {total_ms:.1f} ms |")
    print()
    print(f"arena: {args.arena_gib} GiB pinned in {pin_s:.1f} s on another thread ({args.arena_gib / pin_s:.2f} GiB/s); "
          f"{used >> 20} MiB used, {arena.used_bytes} bytes after the tensors went; {arena.fallbacks} fallbacks")
    print(f"main-thread steps alone: {base}; while another thread pins: {_quantiles(during) if during else 'none'}")


if __name__ == "__main__":
    main()

"""What resuming a spilled session costs the agents that keep decoding beside it.

    python3 benchmarks/sweeps/import_overlap.py --shape qwen3.5-35b-a3b --context 50000 --batch 16
    python3 benchmarks/sweeps/import_overlap.py --shape tiny --device cpu --dtype float32 --context 512 --batch 4 --steps 12

A ``--context``-token prefix is computed, exported to pinned host memory (what the host tier
holds) and dropped from the device. Then ``--batch`` requests decode, and every ``--every`` steps
the prefix is imported again, through one of two paths:

- ``sync``: the former order: drain the async pipeline, copy on the engine's stream, insert;
- ``async``: ``Engine.import_prefix`` (TP=1): insert, copy on a side stream, fence
  (``engine.cache.import_fences``); the pipeline stays queued.

Prints, per path: the decode step time (wall time between ``step`` returns) in steps with no
import, in the steps around an import (the import call's step and the next), the host time of
the import call, and the copy's bytes over the copy time measured alone (the host-to-device
bandwidth the copy reached). The imported prefix is evicted again after each import (once its
copy has ended), so every import copies the whole state.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from phloem.engine import Engine, SamplingParams
from phloem.engine.config import EngineConfig, SchedulerConfig
from phloem.engine.transfer.prefix_export import PrefixState, import_prefix
from phloem.runtime.model_shapes import write_shape


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _import(engine: Engine, state: PrefixState, path: str) -> bool:
    if path == "async":
        return engine.import_prefix(state)
    engine.drain()
    return import_prefix(engine.cache, state, engine.runner.state_shapes, engine.runner.write_state)


def _evict(engine: Engine) -> None:
    """Drop the imported prefix once its copy has ended (the decoding requests hold their own)."""
    while len(engine.cache.imports):
        _sync(engine)
        engine.cache.imports.settle()
    assert engine.cache.tree is not None
    engine.cache.tree.clear()


def run(engine: Engine, state: PrefixState, path: str, batch: int, steps: int, every: int) -> dict[str, float]:
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(31 * i + j) % (vocab - 3) + 3 for j in range(64)], params)
    for _ in range(8):  # admission and the first decode steps
        engine.step()
    plain: list[float] = []
    around: list[float] = []
    host: list[float] = []
    last = time.perf_counter()
    for step in range(steps):
        imported = step % every == every // 2
        if imported:
            t = time.perf_counter()
            assert _import(engine, state, path), "no room for the import"
            host.append(time.perf_counter() - t)
        engine.step()
        now = time.perf_counter()
        (around if imported or (step % every == every // 2 + 1) else plain).append(now - last)
        if step % every == every // 2 + 1:
            _evict(engine)
            now = time.perf_counter()
        last = now
    while engine.scheduler.has_unfinished():
        engine.step()
    return {
        "plain_ms": 1e3 * statistics.median(plain),
        "around_ms": 1e3 * statistics.mean(around),
        "import_host_ms": 1e3 * statistics.median(host),
    }


def copy_bandwidth(engine: Engine, state: PrefixState) -> float:
    """GB/s of the import's copy alone (nothing else queued)."""
    times = []
    for _ in range(3):
        _sync(engine)
        t = time.perf_counter()
        assert engine.import_prefix(state)
        _sync(engine)
        times.append(time.perf_counter() - t)
        _evict(engine)
    return state.nbytes / min(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3.5-35b-a3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=6, help="steps between imports")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp())
    write_shape(args.shape, folder)
    engine = Engine.from_pretrained(folder, EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max(16, args.batch))),
                                    load_format="dummy", device=args.device, dtype=args.dtype)
    vocab = engine.model_config.vocab_size
    prompt = [(7 * i + 5) % (vocab - 3) + 3 for i in range(args.context)]
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    state = engine.export_prefix(prompt)
    assert state is not None
    engine.cache.tree.clear()
    gbs = copy_bandwidth(engine, state)
    print(f"state: {state.num_tokens} tokens, {state.nbytes / 2**20:.1f} MiB, pinned {state.kv.is_pinned()}; "
          f"copy alone {gbs:.1f} GB/s")
    print("| path | decode step ms (no import) | steps around an import, mean ms | import call, host ms |")
    print("|---|---|---|---|")
    for path in ("sync", "async"):
        r = run(engine, state, path, args.batch, args.steps, args.every)
        print(f"| {path} | {r['plain_ms']:.2f} | {r['around_ms']:.2f} | {r['import_host_ms']:.2f} |")


if __name__ == "__main__":
    main()

"""Greedy decoding of several prompts at once, async against sync scheduling, on a dummy shape.

    python3 tools/gpu/concurrency_table.py --shape qwen3.5-35b-a3b            # the H200 check
    python3 tools/gpu/concurrency_table.py --shape tiny --device cpu --dtype float32   # a dry run

For each case (prompts x length, plus a mixed batch whose prompts have different lengths and
``max_tokens``, so requests finish and pages change between steps) the same engine runs the
batch with synchronous and with async scheduling (the prefix cache cleared before each run),
``ignore_eos``; the table gives the sampled ids outside the vocabulary and whether async gave
the synchronous tokens bit for bit. ``--pool-ids`` first re-captures the CUDA graphs with their
greedy ids allocated inside the graphs' shared memory pool (how the graphs were built before the
ids got a buffer of their own), to show what that did.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phloem.engine import Engine, SamplingParams, SchedulerConfig
from phloem.runtime.model_shapes import SHAPES, write_shape

CASES = [(1, 2000), (4, 2000), (4, 200), (16, 200)]


def build_engine(args: argparse.Namespace, folder: Path) -> Engine:
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    write_shape(args.shape, folder)
    (folder / "config.json").write_text(json.dumps(config))
    return Engine.from_pretrained(folder, load_format="dummy", device=args.device, dtype=args.dtype,
                                  scheduler=SchedulerConfig(max_num_seqs=16))


def use_pool_ids(engine: Engine) -> None:
    """Re-capture the graphs with ids allocated in the graph pool (the graph runner before its fix)."""
    from phloem.engine.cuda_graph import CudaGraphRunner

    def step(self: Any, batch: Any, copy_to: Any, ids_out: Any) -> Any:
        hidden = self.model.forward(batch, self.caches)
        logits = self.model.compute_logits(hidden, upcast=False)
        return hidden, logits, self.model.greedy_ids(logits, copy_to=copy_to)

    CudaGraphRunner._step = step  # type: ignore[method-assign]
    graphs = engine.runner.graphs
    assert graphs is not None, "--pool-ids needs CUDA graphs"
    engine.runner.enable_cuda_graphs(graphs.max_batch_size(), graphs.pad_page, graphs.pad_slot)


def batches(vocab: int) -> list[tuple[str, list[list[int]], list[SamplingParams]]]:
    rng = random.Random(0)
    out = []
    for num, length in CASES:
        prompts = [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(num)]
        out.append((f"{num} x {length}", prompts, [SamplingParams(max_tokens=32, ignore_eos=True)] * num))
    lengths = [rng.choice([17, 200, 555, 1000, 2049]) for _ in range(16)]
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]
    params = [SamplingParams(max_tokens=rng.randrange(4, 40), ignore_eos=True) for _ in lengths]
    out.append(("16 mixed", prompts, params))
    return out


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], pipelined: bool) -> list[list[int]]:
    engine.async_scheduling = pipelined
    tree = engine.cache.tree
    if tree is not None:
        tree.clear()
    return [o.token_ids for o in engine.generate(prompts, params)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3.5-35b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the shape's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pool-ids", action="store_true", help="emulate the graphs before their ids buffer")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args, Path(tmp))
        if args.pool_ids:
            use_pool_ids(engine)
        vocab = engine.model_config.vocab_size
        rows = []
        for name, prompts, params in batches(vocab):
            t0 = time.perf_counter()
            sync = run(engine, prompts, params, pipelined=False)
            pipelined = run(engine, prompts, params, pipelined=True)
            bad = [sum(not 0 <= t < vocab for t in toks) for toks in (sync, pipelined) for toks in [sum(toks, [])]]
            rows.append({"case": name, "tokens": sum(map(len, sync)), "oov_sync": bad[0], "oov_async": bad[1],
                         "async_equals_sync": pipelined == sync, "seconds": round(time.perf_counter() - t0, 1)})
    label = "pool ids (before the fix)" if args.pool_ids else "ids buffer (the fix)"
    print(f"\n{args.shape} layers={args.layers or 'all'} {args.device} {args.dtype}: {label}")
    print(f"{'case':<12}{'tokens':>8}{'OOV sync':>10}{'OOV async':>11}{'async == sync':>15}{'s':>7}")
    for r in rows:
        print(f"{r['case']:<12}{r['tokens']:>8}{r['oov_sync']:>10}{r['oov_async']:>11}{r['async_equals_sync']!s:>15}{r['seconds']:>7}")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "pool_ids": args.pool_ids, "rows": rows}, indent=1))
    return 0 if all(r["oov_async"] == r["oov_sync"] == 0 and r["async_equals_sync"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

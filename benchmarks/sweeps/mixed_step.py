"""What a served step costs when agents append tool results while others decode: the agentic
workload's steady state, through the engine's own request path (admission, prefix match,
checkpoint restore, chunked prefill, finishing), not injected requests.

    python3 benchmarks/sweeps/mixed_step.py --shape qwen3.5-35b-a3b --agents 16 --context 32768 --append 800
    python3 benchmarks/sweeps/mixed_step.py --attention one-call --attention split   # one engine each
    python3 benchmarks/sweeps/mixed_step.py --prefill-graph-tokens 0   # mixed steps without graphs
    python3 benchmarks/sweeps/mixed_step.py --shape tiny --device cpu --dtype float32 --agents 4 --context 256 --append 32

Turn 1 prefills ``agents`` prompts of ``context`` tokens (one token out each; the prefix cache
keeps them). Turn 2 re-sends each prompt plus its output plus ``append`` new tokens, one agent
every ``--stagger`` steps while the others decode ``--output`` tokens, so most turn-2 prefills
run as mixed steps beside a full decode batch. Prints the wall time of each step kind (decode,
mixed, prefill), the same append prefilled alone, and the device kernels and host ops of a few
mixed steps (torch profiler): the numbers that say why a mixed step costs what it does.
``--attention one-call`` runs a mixed step's decode rows inside the prefill call instead of through
the decode kernel (``kernels.attention.flashinfer.MixedPlan``, the default ``split``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from phloem.engine import Engine, SamplingParams
from phloem.engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from phloem.runtime.model_shapes import SHAPES, write_shape


def build_engine(args: argparse.Namespace, folder: Path, attention: str) -> Engine:
    write_shape(args.shape, folder)
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
        (folder / "config.json").write_text(json.dumps(config))
    scheduler = SchedulerConfig(max_num_seqs=max(16, args.agents))
    runner = RunnerConfig(prefill_graph_tokens=args.prefill_graph_tokens)
    engine = Engine.from_pretrained(folder, EngineConfig(scheduler=scheduler, runner=runner), load_format="dummy",
                                    device=args.device, dtype=args.dtype)
    if engine.runner.attn is not None:
        engine.runner.attn.split_mixed = attention == "split"
    return engine


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


class StepLog:
    """Wraps ``engine.runner.launch`` to record each launched step's composition, and times
    ``engine.step()`` calls; a call's time is charged to the kind of the step it collected."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rows: list[dict[str, Any]] = []
        self._launched: list[tuple[str, int, int]] = []
        launch = engine.runner.launch

        def logged(sched: Any, *rest: Any, **kw: Any) -> Any:
            counts = sched.num_new_tokens
            self._launched.append((sched.kind, sum(n for n in counts if n > 1), sum(1 for n in counts if n == 1)))
            return launch(sched, *rest, **kw)

        engine.runner.launch = logged  # type: ignore[method-assign]

    def step(self) -> list[Any]:
        before = len(self._launched)
        t0 = time.perf_counter()
        outputs = self.engine.step()
        ms = 1000 * (time.perf_counter() - t0)
        new = self._launched[before:]
        # The collected step is the first launched in this call when nothing was queued, else the
        # queued one (a decode step); a mixed/prefill step is never queued behind another.
        kinds = [k for k, _, _ in new]
        kind = "mixed" if "mixed" in kinds else "prefill" if "prefill" in kinds else "decode"
        prefill = sum(p for _, p, _ in new)
        decodes = max((d for _, _, d in new), default=0)
        self.rows.append({"kind": kind, "ms": ms, "prefill_tokens": prefill, "decodes": decodes})
        return outputs


def turn1(engine: Engine, args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.context)] for _ in range(args.agents)]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))
    sync(engine)
    seconds = time.perf_counter() - t0
    print(f"turn 1: {args.agents} x {args.context} tokens in {seconds:.1f} s "
          f"({args.agents * args.context / seconds:,.0f} tok/s)", flush=True)
    return [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]


def turn2(engine: Engine, log: StepLog, histories: list[list[int]], args: argparse.Namespace,
          rng: random.Random, profile_last: bool) -> Any:
    """Staggered appends while the others decode; profiles the steps around the last arrival."""
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.output, ignore_eos=True)
    prof = None
    for i, history in enumerate(histories):
        prompt = history + [rng.randrange(10, vocab) for _ in range(args.append)]
        if profile_last and i == len(histories) - 1:
            sync(engine)
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        engine.add_request(prompt, params, request_id=f"t2-{i}-{rng.random()}")
        for _ in range(args.stagger):
            log.step()
        if prof is not None:
            sync(engine)
            prof.__exit__(None, None, None)
    while engine.has_unfinished_requests():
        log.step()
    return prof


def append_alone(engine: Engine, histories: list[list[int]], args: argparse.Namespace, rng: random.Random) -> float:
    """Wall ms of one agent's append prefilled with nothing else running (prefix-cache hit)."""
    vocab = engine.model_config.vocab_size
    prompt = histories[0] + [rng.randrange(10, vocab) for _ in range(args.append)]
    sync(engine)
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    sync(engine)
    return 1000 * (time.perf_counter() - t0)


def summarize(rows: list[dict[str, Any]]) -> None:
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[r["kind"]].append(r)
    print(f"\n{'kind':<9}{'steps':>7}{'ms mean':>10}{'ms p50':>9}{'ms max':>9}{'prefill tok':>13}{'decodes':>9}")
    for kind in ("decode", "mixed", "prefill"):
        rs = by.get(kind, [])
        if not rs:
            continue
        ms = [r["ms"] for r in rs]
        print(f"{kind:<9}{len(rs):>7}{statistics.mean(ms):>10.2f}{statistics.median(ms):>9.2f}{max(ms):>9.2f}"
              f"{statistics.mean(r['prefill_tokens'] for r in rs):>13.0f}"
              f"{statistics.mean(r['decodes'] for r in rs):>9.1f}")


def print_profile(prof: Any, top: int) -> None:
    if prof is None:
        return
    averages = prof.key_averages()
    device = sorted((e for e in averages if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    total = sum(e.self_device_time_total for e in averages)
    print(f"\nprofiled window: device busy {total / 1e3:.1f} ms (self time of every device op)")
    print(f"{'device kernel':<72}{'ms':>9}{'calls':>7}")
    for e in device[:top]:
        print(f"{e.key[:70]:<72}{e.self_device_time_total / 1e3:>9.2f}{e.count:>7}")
    host = sorted(averages, key=lambda e: -e.self_cpu_time_total)
    print(f"\n{'host op (self time)':<72}{'ms':>9}{'calls':>7}")
    for e in host[:top]:
        print(f"{e.key[:70]:<72}{e.self_cpu_time_total / 1e3:>9.2f}{e.count:>7}")


def print_host_profile(host: cProfile.Profile, top: int) -> None:
    """Functions by own time, then by cumulative time (turn 2: decode and mixed steps together)."""
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(host, stream=out).sort_stats(order).print_stats(top)
        lines = out.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        print(f"\nhost time by {order} (cProfile, a second round of turn 2):")
        print("\n".join(lines[start:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3.5-35b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the shape's)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--append", type=int, default=800)
    parser.add_argument("--output", type=int, default=96, help="tokens each turn 2 decodes")
    parser.add_argument("--stagger", type=int, default=4, help="engine steps between two arrivals")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--cprofile", action="store_true",
                        help="also print where the host's time goes in turn 2 (cProfile, by function)")
    parser.add_argument("--prefill-graph-tokens", type=int, default=RunnerConfig().prefill_graph_tokens,
                        help="RunnerConfig.prefill_graph_tokens (0: mixed steps eagerly)")
    parser.add_argument("--attention", action="append", choices=("split", "one-call"),
                        help="a mixed step's attention (default split); repeat to run one engine after another")
    args = parser.parse_args()
    for choice in args.attention or ["split"]:
        print(f"\n== mixed-step attention: {choice} ==", flush=True)
        run_one(args, choice)
    return 0


def run_one(args: argparse.Namespace, attention: str) -> None:
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args, Path(tmp), attention)
        # Compile / warm every path once: a fresh prefill, then a short chunk over its history.
        warm = [rng.randrange(10, 100) for _ in range(min(args.context, 4096) + args.append + 64)]
        for prompt in (warm, warm + [11] * 32):
            engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
        log = StepLog(engine)
        histories = turn1(engine, args, rng)
        log.rows.clear()
        prof = turn2(engine, log, histories, args, rng, profile_last=not args.no_profile)
        summarize(log.rows)
        alone = [append_alone(engine, histories, args, rng) for _ in range(3)]
        print(f"\none append of {args.append} tokens at {args.context} context, alone: "
              f"{', '.join(f'{ms:.1f}' for ms in alone)} ms")
        print_profile(prof, args.top)
        if args.cprofile:
            # A second round of the same arrivals under cProfile (which slows the host), apart
            # from the timed one.
            host = cProfile.Profile()
            host.enable()
            turn2(engine, log, histories, args, rng, profile_last=False)
            host.disable()
            print_host_profile(host, args.top)
        engine.close()


if __name__ == "__main__":
    sys.exit(main())

"""The ``phloem bench`` subcommands: decode, prefix-cache, long-context, agentic and trie.

``agentic`` drives a server over HTTP with the SDK, and ``trie`` runs the external harness
tokenspeed-trie next to it; both live in ``phloem.api``, so their runners are handed in by
``runtime/cli.py`` (the one module allowed to import ``api``), like ``demo``'s client.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from phloem.runtime.env import read_env

__all__ = ["add_bench_commands", "show_progress"]

_EXAMPLES = """\
examples:
  phloem bench decode --device cuda                       # Qwen3.5-35B-A3B shape, dummy weights, one GPU
  phloem bench decode --shape tiny --device cpu --batches 1,4 --contexts 256 --prefill-tokens 512
  phloem bench decode --device cuda --tp 2 --batches 1,16 --contexts 1024   # two GPUs, NCCL
  phloem bench prefix-cache                               # 12-turn conversation, cache on vs off (CPU ok)
  phloem bench long-context --device cuda                 # decode at 128K / 256K / 1M tokens of context
  phloem bench agentic                                    # scaled-down agents against fresh local servers
  phloem bench agentic --base-url http://gpu-box:8000 --agents 16 --first-turn 50000 --append 800 --output 500
  phloem bench prefix-cache --no-progress > prefix-cache.md   # no progress bars (or PHLOEM_NO_PROGRESS=1)
  phloem bench trie                                       # tokenspeed-trie vs our client, same workload (CPU ok)
"""
_TRIE_EXAMPLES = """\
examples:
  phloem bench trie                                       # scaled-down workload, a fresh local server, 20 s
  phloem bench trie --duration 60 --agents 4 --out bench-trie
  phloem bench trie --base-url http://gpu-box:8000 --tokenizer ~/models/Qwen3.5-35B-A3B \\
      --agents 16 --first-turn 50000 --append 800 --turns 12 --output 500 --duration 600

tokenspeed-trie (pip install tokenspeed-trie) sends TEXT prompts to /v1/completions; the built-in
model's tokenizer is the default, which matches `phloem serve` without --model and with --shape.
"""


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_bench_commands(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    run_agentic: Callable[[argparse.Namespace], int],
    run_trie: Callable[[argparse.Namespace], int],
) -> None:
    bench = commands.add_parser(
        "bench", help="benchmarks: decode, prefix-cache, long-context, agentic, trie",
        description="Benchmarks; every speed is reported against a limit measured in the same run.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)

    decode = kinds.add_parser("decode", help="decode tok/s and roofline fraction over a batch × context grid", epilog=_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _engine_args(decode)
    decode.add_argument("--batches", type=_ints, default=(1, 4, 16, 64), help="comma-separated (default: 1,4,16,64)")
    decode.add_argument("--contexts", type=_ints, default=(1024, 32768, 131072), help="comma-separated tokens of history")
    decode.add_argument("--prefill-tokens", type=int, default=50000, help="one prompt timed against the FLOP roofline (0: skip)")
    decode.add_argument("--no-served", dest="served", action="store_false",
                        help="skip the served-path timing of each point (requests through the engine loop)")
    decode.add_argument("--grammar", action="store_true",
                        help="time each point again with every request under a JSON-schema grammar")
    decode.add_argument("--tokenizer", type=Path,
                        help="with --grammar: the model folder whose tokenizer the grammar is compiled against "
                             "(default: the model's, or the built-in model's for a dummy shape)")
    decode.set_defaults(configure=lambda a: a, run=_decode)

    long = kinds.add_parser("long-context", help="batch-1 decode at long contexts with roofline fractions", epilog=_EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    _engine_args(long)
    long.add_argument("--contexts", type=_ints, default=(131072, 262144, 1048576), help="comma-separated tokens of history")
    long.set_defaults(configure=lambda a: a, run=_long_context)

    prefix = kinds.add_parser("prefix-cache", help="multi-turn conversation with the prefix cache on vs off", epilog=_EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    prefix.add_argument("--model", type=Path, help="model folder (default: the built-in tiny model)")
    prefix.add_argument("--turns", type=int, default=12)
    prefix.add_argument("--first-turn", type=int, default=2000)
    prefix.add_argument("--append", type=int, default=80)
    prefix.add_argument("--output", type=int, default=16)
    prefix.add_argument("--namespace", metavar="NAME", help="run as one tenant of the partitioned cache (its cost)")
    prefix.set_defaults(configure=lambda a: a, run=_prefix_cache)

    agentic = kinds.add_parser("agentic", help="simulated agents over HTTP: sessions vs stateless vs no cache", epilog=_EXAMPLES,
                               formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    agentic.add_argument("--base-url", help="a running server (default: start a fresh local server per mode)")
    agentic.add_argument("--modes", default="sessions,stateless,nocache", help="comma-separated (default: %(default)s)")
    _workload_args(agentic)
    agentic.add_argument("--fork-at", type=int, help="fork after this turn")
    agentic.add_argument("--forks", type=int, default=0, help="branches at --fork-at")
    agentic.add_argument("--vocab-hi", type=int, default=1000, help="token ids are drawn from [10, this)")
    agentic.add_argument("--server-arg", action="append", default=[], help="extra `phloem serve` argument (repeatable)")
    agentic.add_argument("--gpus", type=int, default=1, help="GPUs behind the server, for per-GPU throughput")
    agentic.add_argument("--out", type=Path, default=Path("bench-agentic"), help="JSON + PNG plots go here")
    agentic.set_defaults(configure=lambda a: a, run=run_agentic)

    trie = kinds.add_parser("trie", help="the external harness tokenspeed-trie vs our own client, same workload",
                            epilog=_TRIE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    trie.add_argument("--base-url", help="a running server (default: start a fresh local one)")
    _workload_args(trie)
    trie.add_argument("--duration", type=float, default=20.0, help="seconds trie admits new traces (default: %(default)s)")
    trie.add_argument("--tokenizer", help="the server's tokenizer folder (default: the built-in model's)")
    trie.add_argument("--server-arg", action="append", default=[], help="extra `phloem serve` argument (repeatable)")
    trie.add_argument("--out", type=Path, default=Path("bench-trie"), help="workload file, JSON and report go here")
    trie.set_defaults(configure=lambda a: a, run=run_trie)
    for parser in kinds.choices.values():
        parser.add_argument("--no-progress", action="store_true",
                            help="no progress bars (also $PHLOEM_NO_PROGRESS=1; bars are drawn only "
                                 "when stderr is a terminal)")


def show_progress(args: argparse.Namespace) -> bool | None:
    """False under ``--no-progress`` or ``PHLOEM_NO_PROGRESS=1``; else None (bars when stderr is
    a terminal, ``runtime.progress``)."""
    return False if getattr(args, "no_progress", False) or read_env().no_progress else None


def _workload_args(parser: argparse.ArgumentParser) -> None:
    """The agentic workload's shape, scaled down for CPU by default (the record's in the help)."""
    parser.add_argument("--agents", type=int, default=2, help="concurrent agents (default: %(default)s)")
    parser.add_argument("--first-turn", type=int, default=512, help="first-turn tokens (record: 50000)")
    parser.add_argument("--append", type=int, default=48, help="new tokens per later turn (record: 800)")
    parser.add_argument("--turns", type=int, default=6, help="turns per agent (record: 10-15)")
    parser.add_argument("--output", type=int, default=8, help="output tokens per turn (record: 500)")
    parser.add_argument("--tool-pause", type=float, default=0.0, help="seconds between turns")


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3.5-35b-a3b", help="dummy-weight shape (default: %(default)s; or tiny)")
    parser.add_argument("--model", type=Path, help="a real model folder instead of a dummy shape")
    parser.add_argument("--device", default="cuda", help="default: %(default)s")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per point")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks, one GPU each from --device (default: %(default)s); "
                             "the roofline is one rank's share of the bytes")
    parser.add_argument("--ep", action="store_true", help="with --tp N: split the routed experts whole across the ranks")
    parser.add_argument("--out", type=Path, help="write the raw numbers as JSON here")


def _decode(args: argparse.Namespace) -> int:
    from phloem.runtime.bench_report import bench_decode

    sys.stdout.write(bench_decode(args.shape, args.model, args.device, args.batches, args.contexts,
                                  args.prefill_tokens, args.steps, args.out, grammar=args.grammar, tokenizer=args.tokenizer,
                                  served=args.served,
                                  tensor_parallel_size=args.tp, expert_parallel=args.ep,
                                  show_progress=show_progress(args)) + "\n")  # fmt: skip
    return 0


def _long_context(args: argparse.Namespace) -> int:
    from phloem.runtime.bench_report import bench_decode

    sys.stdout.write(bench_decode(args.shape, args.model, args.device, (1,), args.contexts, 0, args.steps, args.out,
                                  max_num_seqs=1, tensor_parallel_size=args.tp, expert_parallel=args.ep, show_progress=show_progress(args)) + "\n")  # fmt: skip
    return 0


def _prefix_cache(args: argparse.Namespace) -> int:
    from phloem.runtime.bench_prefix_cache import run_prefix_cache_bench
    from phloem.runtime.default_model import ensure_default_model

    show = show_progress(args)
    model = args.model or ensure_default_model(Path(tempfile.mkdtemp(prefix="phloem-bench-")), show)
    report = run_prefix_cache_bench(model, args.turns, args.first_turn, args.append, args.output,
                                    namespace=args.namespace, num_pages=4096, num_state_slots=64,
                                    max_num_batched_tokens=512, show_progress=show)  # fmt: skip
    sys.stdout.write(report.table() + "\n")
    return 0

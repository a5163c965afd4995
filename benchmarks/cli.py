"""The ``phloem bench`` subcommands: decode, prefix-cache, long-context, agentic and trie.

``agentic`` drives a server over HTTP with the SDK, and ``trie`` runs the external harness
tokenspeed-trie next to it. Each benchmark's module is imported inside the function that runs it,
so ``phloem --help`` never imports torch or the SDK.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

from phloem.engine.config import (
    KV_CACHE_DTYPES, QUANTIZATIONS, CacheConfig, EngineConfig, LoadConfig, ParallelConfig, SchedulerConfig,
    SpeculativeConfig,
)
from phloem.benchmarks.progress_lines import phase, progress_lines
from phloem.runtime.env import kernel_config, read_env, use_nccl_defaults
from phloem.runtime.model_shapes import SHAPES
from phloem.runtime.preflight import StartupError, best_device, check_device, check_model_folder

__all__ = ["add_bench_commands", "show_progress"]

_EXAMPLES = """\
examples:
  phloem bench decode                                     # Qwen3.5-35B-A3B shape, dummy weights, the best device here
  phloem bench prefix-cache                               # 12-turn conversation, cache on vs off (CPU ok)
  phloem bench long-context --device cuda                 # decode at 128K / 256K / 1M tokens of context
  phloem bench agentic                                    # scaled-down agents against fresh local servers
  phloem bench trie                                       # tokenspeed-trie vs our client, same workload (CPU ok)
  phloem bench decode --help                              # one benchmark's flags, defaults and examples
"""
# Each benchmark's own examples (its --help shows only these).
_KIND_EXAMPLES = {
    "decode": """\
  phloem bench decode --device cuda                       # Qwen3.5-35B-A3B shape, dummy weights, one GPU
  phloem bench decode --shape tiny --device cpu --batches 1,4 --contexts 256 --prefill-tokens 512
  phloem bench decode --device cuda --tp 2 --batches 1,16 --contexts 1024   # two GPUs, NCCL
  phloem bench decode --model ~/models/Qwen3.5-35B-A3B --out decode.json
  phloem bench decode --shape tiny --device cpu --speculative mtp:3 --batches 1,4 --contexts 256 --prefill-tokens 0
  phloem bench decode --device cuda --quantization fp8 --kv-cache-dtype fp8_e4m3   # FP8 weights and KV pages
  phloem bench decode --model ~/models/Qwen3.5-35B-A3B --speculative mtp:3 --accept-length 3.1
  phloem bench decode --device cuda --shape qwen3.5-397b-a17b --simulate-tp 8 --batches 1,16 --contexts 1024
  phloem bench decode --shape tiny --device cpu --simulate-tp 2 --batches 1 --contexts 64   # one rank of TP=2
""",
    "long-context": """\
  phloem bench long-context --device cuda                 # decode at 128K / 256K / 1M tokens of context
  phloem bench long-context --device cuda --contexts 32768,131072 --steps 50
  phloem bench long-context --shape tiny --device cpu --contexts 2048,8192
""",
    "prefix-cache": """\
  phloem bench prefix-cache                               # 12-turn conversation, cache on vs off (CPU ok)
  phloem bench prefix-cache --turns 20 --first-turn 4000 --append 200
  phloem bench prefix-cache --no-progress > prefix-cache.md   # no progress bars (or PHLOEM_NO_PROGRESS=1)
""",
    "agentic": """\
  phloem bench agentic                                    # scaled-down agents against fresh local servers
  phloem bench agentic --base-url http://gpu-box:8000 --agents 16 --first-turn 50000 --append 800 --output 500
  phloem bench agentic --modes sessions --fork-at 3 --forks 4 --out bench-forks
  phloem bench agentic --modes sessions,tiersoff,stateless --agents 8 --tool-wait lognormal:0.5:1.0:5 \
      --server-arg=--num-pages --server-arg=96 --server-arg=--default-ttl --server-arg=0 \
      --server-arg=--idle-to-host --server-arg=0 --server-arg=--host-budget-bytes --server-arg=2000000
      # an oversubscribed fleet at CPU scale: idle sessions spill to host, then disk, and resume
  phloem bench agentic --shared-prefix 2000 --agents 4 --turns 2 --modes sessions,stateless
  phloem bench agentic --shared-prefix 8000 --agents 16 --turns 3 --append 200 --output 64 \\
      --modes sessions,stateless --server-arg=--device --server-arg=cuda --server-arg=--shape \\
      --server-arg=qwen3.5-35b-a3b   # the dummy shape: the tiny model's tokenizer sizes the prompts

--shared-prefix TOKENS: N agents whose first requests share a system prompt + tool definitions of
about TOKENS tokens and differ after it (their own user message of --append tokens; then
--turns - 1 more turns of --append tokens each, --first-turn unused). stateless sends them
through /v1/chat/completions with the openai client, resending the conversation; sessions sends
the same messages through the session API. Agent k's first request waits for agent k-1's first
token; the report gives hit rate and TTFT by request index (1st, 2nd, 3rd+), later turns', and
what /metrics saw (failed requests and steps, HTTP errors, peak state slots, memory stalls).
""",
    "trie": """\
  phloem bench trie                                       # scaled-down workload, a fresh local server, 20 s
  phloem bench trie --duration 60 --agents 4 --out bench-trie
  phloem bench trie --base-url http://gpu-box:8000 --tokenizer ~/models/Qwen3.5-35B-A3B \\
      --agents 16 --first-turn 50000 --append 800 --turns 12 --output 500 --duration 600

tokenspeed-trie (pip install tokenspeed-trie) sends TEXT prompts to /v1/completions; the built-in
model's tokenizer is the default, which matches `phloem serve` without --model and with --shape.
""",
}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_bench_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``bench`` and its benchmarks to the ``phloem`` command tree ``commands``."""
    bench = commands.add_parser(
        "bench", help="benchmarks: decode, prefix-cache, long-context, agentic, trie",
        description="Benchmarks; every speed is reported against a limit measured in the same run.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    kinds = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)

    decode = _kind(kinds, "decode", "decode tok/s and roofline fraction over a batch × context grid")
    _engine_args(decode)
    decode.add_argument("--batches", metavar="N,N,...", type=_ints, default=(1, 4, 16, 64),
                        help="decode batch sizes, comma-separated (default: 1,4,16,64)")
    decode.add_argument("--contexts", metavar="TOKENS,...", type=_ints,
                        help="tokens of history per request, comma-separated (default: 1024,32768,131072 "
                             "on a GPU, 256,1024 on CPU)")
    decode.add_argument("--prefill-tokens", metavar="TOKENS", type=int,
                        help="one prompt timed against the FLOP roofline; 0 skips it (default: 50000 on a "
                             "GPU, 512 on CPU)")
    decode.add_argument("--no-served", dest="served", action="store_false",
                        help="skip the served-path timing of each point (requests through the engine loop)")
    decode.add_argument("--grammar", action="store_true",
                        help="time each point again with every request under a JSON-schema grammar, then under the "
                             "default tool-call grammar of a chat request declaring three tools")
    decode.add_argument("--tokenizer", metavar="DIR", type=Path,
                        help="with --grammar: the model folder whose tokenizer the grammar is compiled against "
                             "(default: the model's, or the random-weight tiny model's for a dummy shape)")
    decode.add_argument("--speculative", metavar="mtp:K", type=_speculative, default=None,
                        help="time each point plain and with MTP speculation drafting K tokens, and split the "
                             "speculative step: draft, verify, rollback, rest, accepted length (default: off)")
    decode.add_argument("--accept-length", metavar="TOKENS", type=float,
                        help="with --speculative: also print tok/s at this accepted length, labelled a projection "
                             "(dummy weights accept ~nothing; the measured length is always printed; default: none)")
    decode.add_argument("--simulate-tp", metavar="N", type=_at_least_one,
                        help="time rank 0 of a TP=N step alone on --device (its shard of the model, collectives "
                             "replaced by local copies, counted) and print a projection of the TP=N step; with --ep "
                             "the routed experts split whole (default: off)")
    decode.add_argument("--allreduce-us", metavar="US", type=float,
                        help="with --simulate-tp: the latency of one collective in the projection (default: 8, "
                             "SGLang's custom all-reduce at TP=8 on NVLink, benchmarks.simulated_tp cites it)")
    decode.set_defaults(configure=_checked, run=_decode)

    long = _kind(kinds, "long-context", "batch-1 decode at long contexts with roofline fractions")
    _engine_args(long)
    long.add_argument("--contexts", metavar="TOKENS,...", type=_ints,
                      help="tokens of history, comma-separated (default: 131072,262144,1048576 on a GPU, "
                           "2048,8192 on CPU)")
    long.set_defaults(configure=_checked, run=_long_context)

    prefix = _kind(kinds, "prefix-cache", "multi-turn conversation with the prefix cache on vs off")
    prefix.add_argument("--model", metavar="DIR", type=Path, help="model folder (default: the random-weight tiny model)")
    _conversation_args(prefix, {"--turns": 12, "--first-turn": 2000, "--append": 80, "--output": 16}, record=False)
    prefix.add_argument("--namespace", metavar="NAME",
                        help="run as one tenant of the partitioned cache, to measure its cost (default: none, the shared namespace)")
    prefix.set_defaults(configure=_checked, run=_prefix_cache)

    agentic = _kind(kinds, "agentic", "simulated agents over HTTP: sessions vs tiers off vs stateless vs no cache")
    agentic.add_argument("--base-url", metavar="URL", help="a running server (default: start a fresh local server per mode)")
    agentic.add_argument("--modes", default="sessions,stateless,nocache",
                         help="comma-separated, of sessions, tiersoff (sessions on a server with --no-session-tiers), "
                              "stateless, nocache (default: %(default)s)")
    _workload_args(agentic)
    agentic.add_argument("--tool-wait", metavar="SECONDS|lognormal:MEDIAN:SIGMA[:CAP]", type=_tool_wait,
                         help="wait between turns instead of --tool-pause: lognormal draws MEDIAN * exp(SIGMA * z), "
                              "z ~ N(0, 1), capped at CAP s, seeded per agent (e.g. lognormal:2:1.5:120: median 2 s, "
                              "p90 14 s, p99 65 s; default: --tool-pause)")
    agentic.add_argument("--prefetch-ahead", metavar="SECONDS", type=float, default=0.0,
                         help="session modes: ask the server to prefetch a session's spilled state this long "
                              "before its tool wait ends (the SDK's prefetch hint; default: %(default)s, never)")
    agentic.add_argument("--duration", metavar="SECONDS", type=float, default=0.0,
                         help="stop each mode after this long: no turn starts later, running turns finish, the "
                              "report counts the turns not started (default: %(default)s, run every turn)")
    agentic.add_argument("--drain", metavar="SECONDS", type=float, default=0.0,
                         help="with --duration: cancel the turns still running this long after it ends and "
                              "count them with the turns not started (default: %(default)s, wait for them)")
    agentic.add_argument("--client-processes", metavar="N", type=_at_least_one,
                         help="client processes the agents are spread over (default: one per two CPUs, "
                              "at most 8 and at most --agents): one process cannot read 16 fast streams")
    agentic.add_argument("--fork-at", metavar="TURN", type=int, help="fork after this turn (default: no fork)")
    agentic.add_argument("--forks", metavar="N", type=int, default=0, help="branches at --fork-at (default: %(default)s)")
    agentic.add_argument("--vocab-hi", metavar="ID", type=int, default=1000,
                         help="token ids are drawn from [10, this) (default: %(default)s)")
    agentic.add_argument("--server-arg", metavar="ARG", action="append", default=[],
                         help="extra `phloem serve` argument, repeatable (default: none)")
    agentic.add_argument("--shared-prefix", metavar="TOKENS", type=_at_least_one,
                         help="the shared-system-prompt workload instead: agents share a system prompt + tools "
                              "of about this many tokens, over /v1/chat/completions (stateless) and the "
                              "session API (default: off)")
    agentic.add_argument("--tokenizer", metavar="DIR", type=Path,
                         help="with --shared-prefix: the server's tokenizer folder, to size the prompts "
                              "(default: the model's the local server serves, else the built-in model's)")
    agentic.add_argument("--gpus", metavar="N", type=int, default=1,
                         help="GPUs behind the server, for per-GPU throughput (default: %(default)s)")
    agentic.add_argument("--out", metavar="DIR", type=Path, default=Path("bench-agentic"),
                         help="JSON + PNG plots go here (default: %(default)s)")
    agentic.set_defaults(configure=_checked, run=_agentic)

    trie = _kind(kinds, "trie", "the external harness tokenspeed-trie vs our own client, same workload")
    trie.add_argument("--base-url", metavar="URL", help="a running server (default: start a fresh local one)")
    _workload_args(trie)
    trie.add_argument("--trie-only", action="store_true",
                      help="run tokenspeed-trie alone, not our client after it (at the record's sizes each "
                           "takes minutes on a GPU; `bench agentic` on the same server gives ours)")
    trie.add_argument("--duration", metavar="SECONDS", type=float, default=20.0,
                      help="seconds trie admits new traces (default: %(default)s)")
    trie.add_argument("--tokenizer", metavar="DIR", help="the server's tokenizer folder (default: that of the model the server "
                                                                "started here serves, else the built-in model's)")
    trie.add_argument("--server-arg", metavar="ARG", action="append", default=[],
                      help="extra `phloem serve` argument, repeatable (default: none)")
    trie.add_argument("--out", metavar="DIR", type=Path, default=Path("bench-trie"),
                      help="workload file, JSON and report go here (default: %(default)s)")
    trie.set_defaults(configure=_checked, run=_trie)
    for parser in kinds.choices.values():
        parser.add_argument("--no-progress", action="store_true",
                            help="no progress bars (also $PHLOEM_NO_PROGRESS=1; bars are drawn only "
                                 "when stderr is a terminal; decode and long-context print a plain "
                                 "progress line every ~2 s to a stderr that is not one)")


def _kind(kinds: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """One benchmark's subcommand, its help showing its own examples."""
    return kinds.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".",
                            epilog="examples:\n" + _KIND_EXAMPLES[name],
                            formatter_class=argparse.RawDescriptionHelpFormatter)


def show_progress(args: argparse.Namespace) -> bool | None:
    """False under ``--no-progress`` or ``PHLOEM_NO_PROGRESS=1``; else None (bars when stderr is
    a terminal, ``runtime.progress``)."""
    return False if getattr(args, "no_progress", False) or read_env().no_progress else None


# A conversation's shape: flag, metavar, meaning, the value in TokenSpeed's agentic record.
_CONVERSATION = (("--turns", "N", "turns of each conversation", "10-15"),
                 ("--first-turn", "TOKENS", "tokens of the first turn's prompt", "50000"),
                 ("--append", "TOKENS", "new prompt tokens of each later turn", "800"),
                 ("--output", "TOKENS", "tokens generated per turn", "500"))


def _conversation_args(parser: argparse.ArgumentParser, defaults: dict[str, int], record: bool) -> None:
    """``--turns``, ``--first-turn``, ``--append``, ``--output`` with these defaults; ``record``
    names the record's value beside each (the agentic workloads, scaled down for CPU)."""
    for flag, metavar, meaning, value in _CONVERSATION:
        extra = f"; the record's: {value}" if record else ""
        parser.add_argument(flag, metavar=metavar, type=int, default=defaults[flag],
                            help=f"{meaning} (default: %(default)s{extra})")


def _workload_args(parser: argparse.ArgumentParser) -> None:
    """The agentic workload's shape, scaled down for CPU by default (the record's in the help)."""
    parser.add_argument("--agents", metavar="N", type=int, default=2, help="concurrent agents (default: %(default)s)")
    _conversation_args(parser, {"--turns": 6, "--first-turn": 512, "--append": 48, "--output": 8}, record=True)
    parser.add_argument("--tool-pause", metavar="SECONDS", type=float, default=0.0,
                        help="seconds between turns (default: %(default)s)")


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES),
                        help="dummy-weight shape (default: qwen3.5-35b-a3b on a GPU, tiny on CPU)")
    parser.add_argument("--model", metavar="DIR", type=Path, help="a real model folder instead of a dummy shape (default: none, --shape's dummy weights)")
    parser.add_argument("--device", help="torch device: cpu, cuda, cuda:N (default: cuda when a GPU is usable, else cpu)")
    parser.add_argument("--steps", metavar="N", type=int, default=20, help="timed decode steps per point (default: %(default)s)")
    parser.add_argument("--tp", metavar="N", type=int, default=1,
                        help="tensor-parallel ranks, one GPU each from --device (default: %(default)s); "
                             "the roofline is one rank's share of the bytes")
    parser.add_argument("--ep", action="store_true", help="with --tp N: split the routed experts whole across the ranks")
    parser.add_argument("--quantization", choices=QUANTIZATIONS,
                        help="as for phloem serve: fp8 quantizes the (dummy) projection weights at load "
                             "(default: none)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="as for phloem serve: fp8_e4m3 stores the KV pages in fp8 (default: %(default)s)")
    parser.add_argument("--out", metavar="FILE", type=Path, help="write the raw numbers as JSON here (default: none)")


def _tool_wait(text: str) -> object:
    from phloem.benchmarks.tool_wait import ToolWait

    try:
        return ToolWait.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return value


def _require_bench_extra(module: str, what: str) -> None:
    """One line, before any server starts, when ``what`` needs a package of the ``bench`` extra
    (``pip install phloem`` serves, and leaves the benchmarks' plotting and harness out)."""
    if importlib.util.find_spec(module) is None:
        raise StartupError(f"{what} needs {module}, which `pip install phloem` leaves out: "
                           "pip install 'phloem[bench]'")


def _checked(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments, once a ``--model`` folder is known to hold a model (a usage error if not)."""
    check_model_folder(getattr(args, "model", None))
    return args


def _device(args: argparse.Namespace, gpu: dict[str, object], cpu: dict[str, object]) -> str:
    """``--device``, checked (one line if this machine has no such device), else the best here;
    fills the flags left unset with that device's defaults (``gpu`` or ``cpu``): the benchmark
    shape does not fit a CPU's memory, nor its long contexts its time."""
    device = str(args.device or best_device())
    check_device(device)
    for name, value in (gpu if device.startswith("cuda") else cpu).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return device


def _speculative(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _decode(args: argparse.Namespace) -> int:
    if args.accept_length is not None and (args.speculative is None or args.accept_length < 1):
        raise StartupError("--accept-length: needs --speculative mtp:K and a length of at least 1")
    device = _device(args, dict(shape="qwen3.5-35b-a3b", contexts=(1024, 32768, 131072), prefill_tokens=50000),
                     dict(shape="tiny", contexts=(256, 1024), prefill_tokens=512))
    if args.simulate_tp is not None:
        return _simulated_decode(args, device)
    if args.allreduce_us is not None:
        raise StartupError("--allreduce-us: needs --simulate-tp N")
    with progress_lines("bench decode", show_progress(args)):
        phase("importing torch and the engine")
        from phloem.benchmarks.report import bench_decode

        use_nccl_defaults()  # before --tp spawns its ranks
        report = bench_decode(args.shape, args.model, device, args.batches, args.contexts,
                              args.prefill_tokens, args.steps, args.out, grammar=args.grammar, tokenizer=args.tokenizer,
                              served=args.served, parallel=ParallelConfig(args.tp, args.ep),
                              speculative=args.speculative or SpeculativeConfig(), accept_length=args.accept_length,
                              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                              kernels=kernel_config(), show_progress=show_progress(args))  # fmt: skip
        phase("done")
    sys.stdout.write(report + "\n")
    return 0


def _simulated_decode(args: argparse.Namespace, device: str) -> int:
    if args.tp != 1 or args.speculative is not None or args.grammar:
        raise StartupError("--simulate-tp: runs one rank alone; leave out --tp, --speculative and --grammar")
    if not 2 <= args.simulate_tp <= 8:
        raise StartupError(f"--simulate-tp: expected 2 to 8 ranks, got {args.simulate_tp}")
    with progress_lines("bench decode", show_progress(args)):
        phase("importing torch and the engine")
        from phloem.benchmarks.simulated_tp import ALLREDUCE_US, bench_simulated_tp

        us = ALLREDUCE_US if args.allreduce_us is None else args.allreduce_us
        report = bench_simulated_tp(args.shape, args.model, device, args.batches, args.contexts, args.steps,
                                    args.simulate_tp, args.ep, us, args.out, kernel_config(), show_progress(args))
        phase("done")
    sys.stdout.write(report + "\n")
    return 0


def _long_context(args: argparse.Namespace) -> int:
    device = _device(args, dict(shape="qwen3.5-35b-a3b", contexts=(131072, 262144, 1048576)),
                     dict(shape="tiny", contexts=(2048, 8192)))
    with progress_lines("bench long-context", show_progress(args)):
        phase("importing torch and the engine")
        from phloem.benchmarks.report import bench_decode

        use_nccl_defaults()  # before --tp spawns its ranks
        report = bench_decode(args.shape, args.model, device, (1,), args.contexts, 0, args.steps, args.out,
                              max_num_seqs=1, parallel=ParallelConfig(args.tp, args.ep), kernels=kernel_config(),
                              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                              show_progress=show_progress(args))  # fmt: skip
        phase("done")
    sys.stdout.write(report + "\n")
    return 0


def _prefix_cache(args: argparse.Namespace) -> int:
    from phloem.benchmarks.prefix_cache import run_prefix_cache_bench
    from phloem.runtime.default_model import ensure_default_model

    show = show_progress(args)
    model = args.model or ensure_default_model(Path(tempfile.mkdtemp(prefix="phloem-bench-")), show)
    report = run_prefix_cache_bench(model, args.turns, args.first_turn, args.append, args.output,
                                    namespace=args.namespace, config=EngineConfig(
                                        load=LoadConfig(show_progress=show), cache=CacheConfig(num_pages=4096, num_state_slots=64),
                                        scheduler=SchedulerConfig(max_num_batched_tokens=512)))  # fmt: skip
    sys.stdout.write(report.table() + "\n")
    return 0


def _agentic(args: argparse.Namespace) -> int:
    _require_bench_extra("matplotlib", "the plots of `phloem bench agentic`")
    from phloem.benchmarks.agentic import AgenticWorkload, default_client_processes, run_agentic

    if args.shared_prefix is not None:
        return _shared_prefix(args)

    workload = AgenticWorkload(
        agents=args.agents, first_turn=args.first_turn, append=args.append, turns=args.turns, output=args.output,
        tool_pause_s=args.tool_pause, tool_wait=args.tool_wait, prefetch_ahead_s=args.prefetch_ahead, fork_at=args.fork_at, forks=args.forks, vocab_hi=args.vocab_hi,
        client_processes=args.client_processes or default_client_processes(args.agents), duration_s=args.duration,
        drain_s=args.drain,
    )  # fmt: skip
    table, data = run_agentic(
        workload, tuple(args.modes.split(",")), args.base_url, tuple(args.server_arg), str(args.out), args.gpus,
        show_progress=show_progress(args),
    )
    sys.stdout.write(table + "\n" + f"raw numbers and plots: {args.out}/\n")
    return 0


def _shared_prefix(args: argparse.Namespace) -> int:
    from phloem.benchmarks.agentic import AgenticWorkload
    from phloem.benchmarks.shared_prefix import run_shared_prefix

    workload = AgenticWorkload(agents=args.agents, first_turn=0, append=args.append, turns=args.turns,
                               output=args.output)  # fmt: skip
    table, _ = run_shared_prefix(workload, args.shared_prefix, tuple(args.modes.split(",")), args.base_url,
                                 tuple(args.server_arg), args.tokenizer, str(args.out), show_progress(args))  # fmt: skip
    sys.stdout.write(table + "\n" + f"raw numbers: {args.out}/shared_prefix.json\n")
    return 0


def _trie(args: argparse.Namespace) -> int:
    _require_bench_extra("trie", "`phloem bench trie` (the tokenspeed-trie harness)")
    from phloem.benchmarks.agentic import AgenticWorkload
    from phloem.benchmarks.trie import run_trie_bench

    workload = AgenticWorkload(
        agents=args.agents, first_turn=args.first_turn, append=args.append, turns=args.turns, output=args.output,
        tool_pause_s=args.tool_pause,
    )  # fmt: skip
    report, _ = run_trie_bench(workload, args.duration, args.base_url, tuple(args.server_arg), args.tokenizer,
                               str(args.out), ours=not args.trie_only)  # fmt: skip
    sys.stdout.write(report + "\n" + f"workload file, raw numbers and report: {args.out}/\n")
    return 0

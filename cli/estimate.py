"""``phloem estimate``: the GPU memory a model takes per GPU, by dtype and tensor-parallel size,
without loading weights or needing a GPU.

The arithmetic is the engine's (``engine.cache.sizing.estimate_memory``: the weights each rank
holds as the engine shards them, then the KV page and GDN state-slot pools that
``--gpu-memory-utilization`` of the memory left buys, split as ``plan_pools`` splits it); this
module parses the command line and prints one row per dtype and TP size. The model comes from a
``--shape`` (runtime.model_shapes) or a ``--model`` folder's ``config.json``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TextIO

from phloem.cli.options import field_default
from phloem.engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, CacheConfig, ModelConfig
from phloem.runtime.model_shapes import SHAPES

__all__ = ["DEFAULT_GPU_GIB", "EstimateOptions", "add_estimate_command", "run_estimate"]

DEFAULT_GPU_GIB = 140.0
"""An H200 as CUDA reports it (143,771 MiB)."""
_GIB = 1 << 30

_EXAMPLES = """\
examples:
  phloem estimate --shape qwen3.5-35b-a3b                    # bf16 and fp8, TP 1, 2, 4, 8
  phloem estimate --shape qwen3.5-397b-a17b --tp 8 --dtype fp8
  phloem estimate --shape qwen3.5-397b-a17b --quantization fp8 --kv-cache-dtype fp8_e4m3 --tp 4 8
  phloem estimate --model ~/models/Qwen3.5-35B-A3B --gpu-memory 80 --gpu-memory-utilization 0.9
"""


@dataclass(frozen=True, slots=True)
class EstimateOptions:
    """What ``phloem estimate`` was asked: the model's config, its name, and the rows."""

    model: ModelConfig
    name: str
    cache: CacheConfig
    tps: tuple[int, ...]
    dtypes: tuple[str, ...]
    gpu_bytes: int
    reserve_bytes: int
    expert_parallel: bool


def add_estimate_command(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``phloem estimate`` to the ``phloem`` command tree."""
    from phloem.engine import WEIGHT_FORMATS

    estimate = commands.add_parser(
        "estimate", help="GPU memory per GPU of a model, by dtype and TP size (no GPU, no weights)",
        description="Print the memory one GPU takes for weights, KV pages and GDN state slots, as the engine "
                    "would size them, without loading weights or needing a GPU. FP8 is the published layout "
                    "(1 byte per projection weight plus 128x128 block scales, the rest bf16); the engine holds "
                    "somewhat more: GDN in_proj in bf16 and a scale per row and 128 columns (docs/models.md).",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = estimate.add_mutually_exclusive_group()
    source.add_argument("--shape", choices=sorted(SHAPES), help="a named model shape (default: qwen3.5-35b-a3b)")
    source.add_argument("--model", metavar="DIR",
                        help="a model folder (its config.json; no weights are read), or a Hub id already downloaded")
    estimate.add_argument("--tp", metavar="N", type=int, nargs="+", default=[1, 2, 4, 8],
                          help="tensor-parallel sizes (default: 1 2 4 8)")
    estimate.add_argument("--ep", action="store_true", help="expert parallelism: whole experts per GPU (with --tp N)")
    estimate.add_argument("--dtype", nargs="+", choices=sorted(WEIGHT_FORMATS),
                          help="weight formats (default: bf16 fp8)")
    estimate.add_argument("--quantization", choices=QUANTIZATIONS,
                          help="as for phloem serve: fp8 weights only (the same as --dtype fp8)")
    estimate.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                          default=field_default("engine.cache.kv_cache_dtype"),
                          help="as for phloem serve: fp8_e4m3 KV pages take 1 byte per element (default: %(default)s)")
    estimate.add_argument("--gpu-memory", metavar="GIB", type=float, default=DEFAULT_GPU_GIB,
                          help="memory of one GPU (default: %(default)s GiB, an H200)")
    estimate.add_argument("--reserve", metavar="GIB", type=float, default=1.0,
                          help="memory taken besides the weights before the pools are sized: CUDA context, "
                               "buffers (default: %(default)s GiB)")
    estimate.add_argument("--gpu-memory-utilization", metavar="FRACTION", type=float,
                          default=field_default("engine.cache.memory_fraction"),
                          help="as for phloem serve: share of the memory left after the weights the pools take "
                               "(default: %(default)s)")
    estimate.add_argument("--num-pages", metavar="N", type=int, help="as for phloem serve (default: from memory)")
    estimate.add_argument("--num-state-slots", metavar="N", type=int,
                          help="as for phloem serve (default: from memory)")
    estimate.set_defaults(configure=_options, run=_run)


def _options(args: argparse.Namespace) -> EstimateOptions:
    from phloem.runtime.preflight import resolve_model_folder

    if args.model is not None:
        folder = resolve_model_folder(args.model)
        assert folder is not None
        model, name = ModelConfig.from_pretrained(folder), args.model
    else:
        name = args.shape or "qwen3.5-35b-a3b"
        model = ModelConfig.from_dict(SHAPES[name])
    if any(tp < 1 for tp in args.tp):
        raise ValueError(f"--tp: expected sizes >= 1, got {args.tp}")
    if not args.gpu_memory > 0 or not args.reserve >= 0:
        raise ValueError(f"--gpu-memory / --reserve: expected GiB > 0 / >= 0, got {args.gpu_memory} / {args.reserve}")
    cache = CacheConfig(memory_fraction=args.gpu_memory_utilization, num_pages=args.num_pages,
                        num_state_slots=args.num_state_slots, kv_cache_dtype=args.kv_cache_dtype)
    dtypes = args.dtype or (["fp8"] if args.quantization else ["bf16", "fp8"])
    if args.quantization and dtypes != ["fp8"]:
        raise ValueError(f"--quantization fp8: the weights are fp8, got --dtype {' '.join(args.dtype)}")
    return EstimateOptions(model, name, cache, tuple(args.tp), tuple(dict.fromkeys(dtypes)),
                           int(args.gpu_memory * _GIB), int(args.reserve * _GIB), args.ep)


def _run(options: EstimateOptions) -> int:
    import sys

    return run_estimate(options, sys.stdout)


def _gib(value: int) -> str:
    return f"{value / _GIB:.2f}"


def run_estimate(options: EstimateOptions, out: TextIO) -> int:
    """Print the table; returns 0 (a row that does not fit says so)."""
    from phloem.engine import estimate_memory

    mc, cc = options.model, options.cache
    params = estimate_memory(mc, cc, gpu_bytes=0).weights.total // 2  # bf16 at TP 1: 2 bytes each
    out.write(f"{options.name}: {mc.architecture}, {params / 1e9:.2f} B parameters served (no MTP), "
              f"{len(mc.linear_attention_layers)} GDN + {len(mc.full_attention_layers)} attention layers\n")
    out.write(f"per GPU of {options.gpu_bytes / _GIB:g} GiB, {options.reserve_bytes / _GIB:g} GiB reserved, "
              f"--gpu-memory-utilization {cc.memory_fraction:g}{' --ep' if options.expert_parallel else ''}; "
              f"GiB per GPU (KV {'fp8 e4m3' if cc.kv_cache_dtype == 'fp8_e4m3' else 'bf16'}, conv state bf16, "
              "recurrent state fp32)\n")
    header = (f"{'dtype':<5} {'TP':>2} {'weights':>8} {'KV pages':>9} {'pages':>9} {'KV tokens':>10} "
              f"{'states':>7} {'slots':>6} {'total':>7}  note")
    out.write(header + "\n")
    for dtype in options.dtypes:
        for tp in options.tps:
            row = f"{dtype:<5} {tp:>2} "
            try:
                e = estimate_memory(mc, cc, gpu_bytes=options.gpu_bytes, tp_size=tp, weight_format=dtype,
                                    expert_parallel=options.expert_parallel, reserve_bytes=options.reserve_bytes)
            except ValueError as exc:
                out.write(row + f"{'-':>8}  {exc}\n")
                continue
            total = e.weights.total + e.kv_bytes + e.state_bytes
            note = "" if e.fits else "does not fit"
            if dtype == "fp8":
                note = (note + "; " if note else "") + "FP8 as published; served on the reference path (docs/models.md)"
            out.write(row + f"{_gib(e.weights.total):>8} {_gib(e.kv_bytes):>9} {e.num_pages:>9} "
                            f"{e.kv_tokens:>10} {_gib(e.state_bytes):>7} {e.num_slots:>6} {_gib(total):>7}  {note}".rstrip() + "\n")
    one = estimate_memory(mc, cc, gpu_bytes=0)
    out.write(f"at TP 1 one KV page ({cc.page_size} tokens) is {one.page_bytes / 1024:g} KiB, one state slot "
              f"{one.slot_bytes / (1 << 20):.1f} MiB; both shrink with TP (KV heads down to one per GPU)\n")
    return 0

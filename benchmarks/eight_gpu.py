"""The eight-GPU run (issue 54) in one process: the flagship at TP8 and the TP scaling curve.

    python3 -m phloem.benchmarks.eight_gpu --out DIR            # 8 GPUs (tools/gpu/eight_gpu.sh)
    python3 -m phloem.benchmarks.eight_gpu --dry --out DIR      # CPU, gloo, a tiny shape (CI)

Sections, each engine loaded once and every point of it run on that load:

- ``flagship``: ``qwen3.5-397b-a17b`` (dummy weights) at TP8 in bf16, and with ``--ep``: batch 1
  at each context that fits (1K, 128K; 1M is past the shape's 256K positions) and batch 16 at 1K.
- ``fp8``: the same with FP8 weights (``LoadConfig.quantization``) and MTP drafting k tokens
  (each k its own load): the plain FP8 step and the speculative one, with tok/s at the accepted
  length measured (dummy drafts: ~1) and at ``ACCEPT_LENGTH`` (a projection, labelled).
- ``simulate``: rank 0 of each flagship variant alone on the first device
  (``benchmarks.simulated_tp``): its step without the wire, so ``1 - rank / measured`` is the
  share of the measured step the collectives and the waits on the other ranks cost.
- ``scaling``: ``qwen3.5-35b-a3b`` at TP = 1, 2, 4, 8, batch 1 and 16 at 1K, the all-reduce
  through NCCL and through the one-shot NVLink kernel (``KernelConfig.one_shot_allreduce``).

Every row carries its target where issue 52 sets one. Not measured here (their own commands):
prefill/decode disaggregation and the agentic workload at 16 agents (``phloem bench agentic``
against ``phloem serve --shape qwen3.5-397b-a17b --tp 8``).

``--dry`` runs every section end to end on CPU over gloo with a tiny shape whose heads divide by 8
(``DRY_SHAPE``) at small TP sizes and contexts, so the GPU run cannot fail on its plumbing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from phloem.benchmarks.decode import decode_tokens, measure_bandwidth, run_decode
from phloem.benchmarks.simulated_tp import simulated_engine
from phloem.benchmarks.speculative_decode import run_speculative_decode
from phloem.engine import Engine, EngineConfig, LoadConfig, SchedulerConfig
from phloem.engine.config import ParallelConfig, SpeculativeConfig
from phloem.kernels.config import KernelConfig
from phloem.runtime.env import use_nccl_defaults
from phloem.runtime.model_shapes import SHAPES

__all__ = ["ACCEPT_LENGTH", "DRY_SHAPE", "Plan", "Variant", "run_eight_gpu"]

ACCEPT_LENGTH = 3.1  # the trained 35B-A3B's MTP acceptance at k = 3 (issue 54)
DRY_SHAPE = {**SHAPES["tiny"], "num_attention_heads": 8, "num_key_value_heads": 4, "linear_num_key_heads": 8,
             "linear_num_value_heads": 16}
# tok/s per user at batch 1, 1K context, by (section, variant label) (issue 52).
TARGETS = {"bf16": 350, "fp8": 500, "fp8+mtp": 700}


@dataclass(frozen=True, slots=True)
class Variant:
    label: str
    tp: int
    expert_parallel: bool = False
    quantization: str | None = None
    mtp: int = 0  # draft tokens; 0: plain decoding
    one_shot: bool = False


@dataclass(frozen=True, slots=True)
class Plan:
    device: str
    flagship: dict[str, Any]  # config.json of the flagship shape
    scaling: dict[str, Any]
    flagship_tp: int
    scaling_tps: tuple[int, ...]
    contexts: tuple[int, ...]  # batch 1 at each
    batch16_context: int
    steps: int
    mtp_ks: tuple[int, ...]
    sections: tuple[str, ...] = ("flagship", "fp8", "simulate", "scaling")

    @classmethod
    def full(cls, steps: int = 20) -> Plan:
        return cls("cuda", SHAPES["qwen3.5-397b-a17b"], SHAPES["qwen3.5-35b-a3b"], 8, (1, 2, 4, 8),
                   (1024, 131072, 1048576), 1024, steps, (1, 2, 3))

    @classmethod
    def dry(cls) -> Plan:
        return cls("cpu", DRY_SHAPE, DRY_SHAPE, 2, (1, 2), (64,), 64, 2, (1,))


@dataclass(slots=True)
class Row:
    section: str
    variant: str
    tp: int
    batch: int
    context: int
    ms_per_step: float | None = None  # None: not run (does not fit)
    tok_per_s: float | None = None
    roofline_fraction: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


def _load(shape: dict[str, Any], folder: Path, plan: Plan, v: Variant, simulated: bool = False) -> Engine:
    """The engine of ``v`` (``simulated``: its rank 0 alone, ``benchmarks.simulated_tp``)."""
    (folder / "config.json").write_text(json.dumps(shape))
    cuda = plan.device.startswith("cuda")
    load = LoadConfig(load_format="dummy", device=plan.device, dtype="bfloat16" if cuda else "auto",
                      quantization=v.quantization, show_progress=False)
    config = EngineConfig(load=load, scheduler=SchedulerConfig(max_num_batched_tokens=8192 if cuda else None,
                                                               max_num_seqs=16),
                          kernels=KernelConfig(one_shot_allreduce=v.one_shot),
                          speculative=SpeculativeConfig.parse(f"mtp:{v.mtp}") if v.mtp else SpeculativeConfig())
    if simulated:
        return simulated_engine(folder, config, v.tp, v.expert_parallel)
    return Engine.from_pretrained(folder, replace(config, parallel=ParallelConfig(v.tp, v.expert_parallel)))


def _on_engine(shape: dict[str, Any], folder: Path, plan: Plan, v: Variant, measure: Callable[[Engine], list[Row]],
               simulated: bool = False) -> list[Row]:
    """``measure`` on a fresh engine of ``v``, whose memory is freed before this returns (the
    next load must not meet it on the GPU: the flagship's rank 0 holds ~100 GB)."""
    engine = _load(shape, folder, plan, v, simulated)
    try:
        return measure(engine)
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _fits(engine: Engine, batch: int, context: int, steps: int, per_step: int) -> bool:
    if context + decode_tokens(steps, 3) * per_step >= engine.max_model_len:
        return False
    pages = engine.page_pool.pages_for(context + per_step * (decode_tokens(steps, 3) + 1))
    return batch * pages <= engine.page_pool.num_free_pages and batch <= engine.slot_pool.num_free_slots


def _points(plan: Plan) -> Iterator[tuple[int, int]]:
    yield from ((1, c) for c in plan.contexts)
    yield 16, plan.batch16_context


def _measure(engine: Engine, section: str, v: Variant, plan: Plan, bandwidth: float,
             points: list[tuple[int, int]]) -> list[Row]:
    rows = []
    for batch, context in points:
        row = Row(section, v.label, v.tp, batch, context)
        if not _fits(engine, batch, context, plan.steps, v.mtp + 1):
            rows.append(row)
            continue
        if v.mtp:
            s = run_speculative_decode(engine, batch, context, bandwidth, steps=plan.steps)
            rows.append(replace(row, variant=v.label.split("+")[0], ms_per_step=s.plain_ms_per_step,
                                tok_per_s=1000.0 / s.plain_ms_per_step))
            rows.append(replace(row, ms_per_step=s.ms_per_step, tok_per_s=s.tok_per_s_per_user(),
                                extra={"accepted_length": s.accepted_length,
                                       "projection_tok_per_s": s.tok_per_s_per_user(ACCEPT_LENGTH)}))
            continue
        r = run_decode(engine, batch, context, bandwidth, steps=plan.steps, compare_sync=False)
        rows.append(replace(row, ms_per_step=r.ms_per_step, tok_per_s=r.tok_per_s_per_user,
                            roofline_fraction=r.roofline_fraction))
    return rows


def _simulate(engine: Engine, v: Variant, plan: Plan, bandwidth: float, points: list[tuple[int, int]],
              measured: list[Row]) -> list[Row]:
    """Rank 0 of ``v`` alone (``engine``); each row's ``allreduce_share`` against the measured row."""
    by_point = {(r.batch, r.context): r for r in measured if r.variant == v.label and r.ms_per_step}
    rows = []
    for batch, context in points:
        real = by_point.get((batch, context))
        if real is None or not _fits(engine, batch, context, plan.steps, 1):
            continue
        r = run_decode(engine, batch, context, bandwidth, steps=plan.steps, compare_sync=False)
        assert real.ms_per_step is not None
        share = max(0.0, 1.0 - r.ms_per_step / real.ms_per_step)
        rows.append(Row("simulate", v.label, v.tp, batch, context, r.ms_per_step, 1000.0 / r.ms_per_step,
                        r.roofline_fraction, {"allreduce_share": share}))
    return rows


def run_eight_gpu(plan: Plan, out_dir: Path) -> str:
    """Run ``plan``'s sections; write ``eight_gpu.json`` and ``eight_gpu.md`` into ``out_dir``;
    returns the Markdown table."""
    use_nccl_defaults()
    out_dir.mkdir(parents=True, exist_ok=True)
    bandwidth = measure_bandwidth(torch.device(plan.device), nbytes=(2 << 30) if plan.device == "cuda" else (64 << 20))
    tp = plan.flagship_tp
    flagship = [Variant("bf16", tp), Variant("bf16+ep", tp, True)]
    flagship += [Variant(f"fp8+mtp:{k}", tp, quantization="fp8", mtp=k) for k in plan.mtp_ks]
    scaling = [Variant(f"tp{n}" + ("+one-shot" if one_shot else ""), n, one_shot=one_shot)
               for n in plan.scaling_tps for one_shot in ((False, True) if n > 1 else (False,))]
    points = list(_points(plan))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for v in flagship:
            section = "fp8" if v.quantization else "flagship"
            if section in plan.sections:
                at = points if not v.mtp else points[:1]
                rows += _on_engine(plan.flagship, folder, plan, v,
                                   lambda e, v=v, s=section, at=at: _measure(e, s, v, plan, bandwidth, at))
        if "simulate" in plan.sections:
            for v in flagship[:2]:
                measured = list(rows)
                rows += _on_engine(plan.flagship, folder, plan, v,
                                   lambda e, v=v, m=measured: _simulate(e, v, plan, bandwidth, points, m), True)
        if "scaling" in plan.sections:
            at = [(1, plan.batch16_context), (16, plan.batch16_context)]
            for v in scaling:
                rows += _on_engine(plan.scaling, folder, plan, v,
                                   lambda e, v=v: _measure(e, "scaling", v, plan, bandwidth, at))
    _speedups(rows)
    table = _table(plan, bandwidth, rows)
    (out_dir / "eight_gpu.md").write_text(table + "\n")
    (out_dir / "eight_gpu.json").write_text(json.dumps({"device": plan.device, "bandwidth": bandwidth,
                                                        "rows": [asdict(r) for r in rows]}, indent=2))
    return table


def _speedups(rows: list[Row]) -> None:
    """Each scaling row's tok/s per user over TP=1's at the same point (``extra["vs_tp1"]``)."""
    tp1 = {(r.batch, r.context): r.tok_per_s for r in rows if r.section == "scaling" and r.tp == 1}
    for r in rows:
        base = tp1.get((r.batch, r.context))
        if r.section == "scaling" and r.tok_per_s and base:
            r.extra["vs_tp1"] = r.tok_per_s / base


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _table(plan: Plan, bandwidth: float, rows: list[Row]) -> str:
    lines = [f"eight-GPU run on {plan.device} ({'dry: tiny shape over gloo' if plan.device == 'cpu' else 'NCCL'}), "
             f"copy bandwidth {bandwidth / 1e12:.2f} TB/s",
             "", "| section | variant | TP | batch | context | ms/step | tok/s per user | roofline | target tok/s "
             "| all-reduce share | accepted length | tok/s at 3.1 (projection) | × TP=1 (target 1.4 at TP=2) |",
             "|" + "---|" * 13]
    for r in rows:
        base = r.variant.split(":")[0].replace("+ep", "") if r.section in ("flagship", "fp8") else ""
        target = TARGETS.get(base) if r.batch == 1 and r.context == 1024 else None
        lines.append(
            f"| {r.section} | {r.variant} | {r.tp} | {r.batch} | {r.context} | "
            + (f"{r.ms_per_step:.3f} | {r.tok_per_s:.0f} | " if r.ms_per_step else "not run (does not fit) | - | ")
            + f"{_fmt(r.roofline_fraction, '.0%')} | {_fmt(target, 'd')} | {_fmt(r.extra.get('allreduce_share'), '.0%')} "
            f"| {_fmt(r.extra.get('accepted_length'), '.2f')} | {_fmt(r.extra.get('projection_tok_per_s'), '.0f')} "
            f"| {_fmt(r.extra.get('vs_tp1'), '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, gloo, a tiny shape: the plumbing only")
    parser.add_argument("--out", type=Path, default=Path("eight-gpu"), help="report directory (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per point (default: %(default)s)")
    parser.add_argument("--sections", default="flagship,fp8,simulate,scaling",
                        help="comma-separated subset of flagship,fp8,simulate,scaling (default: all)")
    args = parser.parse_args(argv)
    plan = Plan.dry() if args.dry else Plan.full(args.steps)
    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = set(sections) - {"flagship", "fp8", "simulate", "scaling"}
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}")
    sys.stdout.write(run_eight_gpu(replace(plan, sections=sections), args.out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

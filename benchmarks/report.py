"""Orchestrates ``phloem bench decode``: builds the engine, runs the grid, prints and saves the report."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from phloem.engine import CacheConfig, Engine, EngineConfig, LoadConfig, SchedulerConfig
from phloem.engine.config import SpeculativeConfig
from phloem.engine.sampling.grammar import GrammarBackend
from phloem.benchmarks.decode import (
    BENCH_SCHEMA,
    DecodeResult,
    PrefillResult,
    StepProfile,
    kernel_breakdown,
    measure_bandwidth,
    measure_matmul_rate,
    decode_tokens,
    run_decode,
    run_prefill,
    tool_call_grammar,
)
from phloem.benchmarks.progress_lines import phase
from phloem.benchmarks.served import OWN_TOKENS, run_served_decode
from phloem.benchmarks.speculative_decode import SpeculativeSplit, run_speculative_decode, speculative_table
from phloem.runtime.model_shapes import write_shape
from phloem.runtime.progress import progress as bar

__all__ = ["bench_decode", "engine_switches"]


def engine_switches(engine: Engine) -> dict[str, object]:
    """The kernel and scheduling choices a run's numbers depend on (the opt-in switches of
    ``docs/configuration.md`` as the engine took them), printed and saved with the numbers."""
    ops = engine.runner.model.ops  # the op table the engine's model was built with
    group = engine.workers.group if engine.workers is not None else None
    return {
        "kernels": ops.backend,
        "async_scheduling": engine.async_scheduling,
        "triton_gemv": ops.linear.__module__.endswith(".gemv"),
        "fused_decode": ops.fused_decode,
        "pdl": ops.pdl,
        "attention_prologue": bool(engine.runner.attn is not None and engine.runner.attn.prologue),
        "tensor_parallel_size": group.size if group is not None else 1,
        "one_shot_allreduce": group is not None and group.one_shot is not None,
        "fp8_weights": any(p.dtype == torch.float8_e4m3fn
                           for p in engine.runner.model.parameters()),  # type: ignore[attr-defined]
        "kv_cache_dtype": str(engine.runner.caches.kv.dtype).removeprefix("torch."),
        "triton_decode_attention": bool(engine.runner.attn is not None and engine.runner.attn.triton_decode),
    }


def _fits(engine: Engine, batch: int, context: int, steps: int) -> bool:
    per_step = engine.speculator.k + 1 if engine.speculator is not None else 1
    pages = engine.page_pool.pages_for(context + per_step * decode_tokens(steps, 3) + per_step)
    return batch * pages <= engine.page_pool.num_free_pages and batch <= engine.slot_pool.num_free_slots


def _served(engine: Engine, batch: int, context: int, steps: int) -> float | None:
    """``run_served_decode``'s ms per step, or None when its requests do not fit the pools (they
    share a prefix, but each holds pages of its own tokens and a checkpoint slot or two)."""
    pages = engine.page_pool.pages_for(context) + batch * engine.page_pool.pages_for(OWN_TOKENS + steps + 8)
    if pages > engine.page_pool.num_free_pages or 2 * batch + 2 > engine.slot_pool.num_free_slots:
        return None
    return run_served_decode(engine, batch, context, steps)


def _randomize(kv: torch.Tensor) -> None:
    """Fill the KV pool with N(0, 1) values in place; fp8 pages (no ``normal_``) in chunks."""
    if kv.element_size() > 1:
        kv.normal_()
        return
    for chunk in kv.view(-1).split(1 << 28):
        chunk.copy_(torch.randn(chunk.shape, dtype=torch.bfloat16, device=kv.device))


def bench_decode(
    shape: str = "qwen3.5-35b-a3b",
    model: Path | None = None,
    device: str = "cuda",
    batches: tuple[int, ...] = (1, 4, 16, 64),
    contexts: tuple[int, ...] = (1024, 32768, 131072),
    prefill_tokens: int = 50000,
    steps: int = 20,
    out_json: Path | None = None,
    progress: Callable[[str], None] | None = None,
    grammar: bool = False,
    tokenizer: Path | None = None,
    served: bool = True,
    max_num_seqs: int | None = None,
    show_progress: bool | None = None,
    speculative: SpeculativeConfig = SpeculativeConfig(),
    accept_length: float | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    **sections: object,
) -> str:
    """Run the decode grid (and one long prefill); returns the report as Markdown.

    ``progress`` gets one line per grid point; ``show_progress`` (False: never) governs the
    progress bars of loading and of the grid (``runtime.progress``). The engine runs up to
    ``max_num_seqs`` (None: the largest batch) requests; ``sections`` are whole ``EngineConfig``
    sections (``parallel=``, ``kernels=``). With
    ``grammar`` each point is timed again under ``BENCH_SCHEMA``; its grammar is compiled
    against ``tokenizer`` (a model folder), else the model's own, else the random-weight tiny model's.
    With ``served`` each point is also timed on the served path (``benchmarks.served``).
    With ``speculative`` on, each point is timed plain and speculating instead, and the report
    splits the speculative step (``benchmarks.speculative_decode``; ``accept_length``: its
    labelled projection). ``quantization`` and ``kv_cache_dtype`` are ``LoadConfig``'s and
    ``CacheConfig``'s (FP8 weights, FP8 KV pages).
    """
    dev = torch.device(device)
    phase(f"building the engine ({shape if model is None else model}, {device})")
    with tempfile.TemporaryDirectory() as tmp:
        path = model or write_shape(shape, Path(tmp))
        fmt = "safetensors" if model else "dummy"
        cuda = dev.type == "cuda"
        load = LoadConfig(load_format=fmt, device=device, dtype="bfloat16" if cuda else "auto",
                          show_progress=show_progress, quantization=quantization)
        scheduler = SchedulerConfig(max_num_batched_tokens=8192 if cuda else None, max_num_seqs=max_num_seqs or max(batches))
        config = EngineConfig(load=load, scheduler=scheduler, speculative=speculative,
                              cache=CacheConfig(kv_cache_dtype=kv_cache_dtype))
        engine = Engine.from_pretrained(path, config, **sections)
    if dev.type == "cuda":
        _randomize(engine.runner.caches.kv)  # never time on zeros
    tools_grammar = None
    if grammar:
        folder = tokenizer or model or _default_tokenizer()
        if tokenizer is not None or model is None:
            mc = engine.model_config
            engine.grammar = GrammarBackend(folder, mc.vocab_size, mc.eos_token_ids)
        tools_grammar = tool_call_grammar(_tool_format(folder))
    copy_bytes = (2 << 30) if dev.type == "cuda" else (64 << 20)
    # The roofline's denominator: the copy timed by device events (measure_bandwidth says why),
    # with the host-timed figure and a second measurement after the grid reported beside it.
    phase("measuring copy bandwidth and matmul rate")
    bandwidth = measure_bandwidth(dev, nbytes=copy_bytes)
    bandwidth_host = measure_bandwidth(dev, nbytes=copy_bytes, timer="host")
    matmul = measure_matmul_rate(dev)
    results: list[DecodeResult] = []
    splits: list[SpeculativeSplit] = []
    skipped: list[tuple[int, int]] = []
    grid = [(context, batch) for context in contexts for batch in batches]
    for i, (context, batch) in enumerate(bar(grid, len(grid), "decode grid", "point", show_progress)):
        if context + decode_tokens(steps, 3) >= engine.max_model_len or not _fits(engine, batch, context, steps):
            skipped.append((batch, context))
            continue
        point = f"point {i + 1}/{len(grid)} (batch {batch}, context {context})"
        phase(point)
        if engine.speculator is not None:
            splits.append(run_speculative_decode(engine, batch, context, bandwidth, steps=steps))
            continue
        result = run_decode(engine, batch, context, bandwidth, steps=steps, grammar=BENCH_SCHEMA if grammar else None,
                            tool_grammar=tools_grammar)
        if served:
            phase(f"{point}: served path")
            result = replace(result, served_ms_per_step=_served(engine, batch, context, steps))
        results.append(result)
        if progress is not None:
            r = results[-1]
            progress(f"batch {batch} context {context}: {r.ms_per_step:.2f} ms/step, {r.roofline_fraction:.0%} of roofline, "
                     f"graph {r.gpu_ms_per_step}, served {r.served_ms_per_step}")
    bandwidth_after = measure_bandwidth(dev, nbytes=copy_bytes)
    prefill: PrefillResult | None = None
    if prefill_tokens and prefill_tokens < engine.max_model_len:
        phase(f"prefill of {prefill_tokens} tokens")
        prefill = run_prefill(engine, prefill_tokens, matmul)
    # Profiled on rank 0 alone, eagerly: under TP its workers would replay graphs meanwhile.
    kernels = kernel_breakdown(engine) if dev.type == "cuda" and engine.workers is None else None
    switches = engine_switches(engine)
    copy = (bandwidth, bandwidth_host, bandwidth_after)
    report = _markdown(shape if model is None else str(model), device, copy, matmul, results, skipped, prefill, kernels)
    report = ", ".join(f"{k} {v}" for k, v in switches.items()) + "\n" + report
    if splits:
        report += "\n\n" + "\n".join(speculative_table(splits, accept_length))
    if out_json is not None:
        out_json.write_text(
            json.dumps(
                {
                    "shape": shape,
                    "switches": switches,
                    "bandwidth": bandwidth,
                    "bandwidth_host_timed": bandwidth_host,
                    "bandwidth_after_grid": bandwidth_after,
                    "matmul_rate": matmul,
                    "decode": [asdict(r) | {"roofline_fraction": r.roofline_fraction} for r in results],
                    "speculative": [asdict(r) | {"rest_ms": r.rest_ms} for r in splits],
                    "skipped": skipped,
                    "prefill": asdict(prefill) | {"roofline_fraction": prefill.roofline_fraction} if prefill else None,
                    "kernels": asdict(kernels) if kernels is not None else None,
                },
                indent=2,
            )
        )
    return report


def _default_tokenizer() -> Path:
    """The random-weight tiny model's folder: the grammars' tokenizer for a dummy shape, which has
    none (its small vocabulary makes the host's mask work cheaper than a real tokenizer's)."""
    from phloem.runtime.default_model import ensure_default_model

    return ensure_default_model(Path(tempfile.mkdtemp(prefix="phloem-bench-")), False)


def _tool_format(folder: Path) -> str:
    """The tool-call format of ``folder``'s chat template (``hermes`` where it renders none)."""
    from phloem.sessions.text.tokenizer import Tokenizer
    from phloem.sessions.text.tool_parsers import detect_tool_format

    return detect_tool_format(Tokenizer.from_pretrained(folder).chat_template) or "hermes"


def _markdown(
    name: str,
    device: str,
    copy: tuple[float, float, float],
    matmul: float,
    results: list[DecodeResult],
    skipped: list[tuple[int, int]],
    prefill: PrefillResult | None,
    kernels: StepProfile | None,
) -> str:
    bandwidth, host, after = (b / 1e12 for b in copy)
    lines = [
        f"model {name} on {device}: copy bandwidth {bandwidth:.2f} TB/s (device-timed; host-timed {host:.2f}, "
        f"after the grid {after:.2f}), bf16 GEMM {matmul / 1e12:.0f} TFLOP/s",
    ]
    if results:
        lines += [
            "",
            "| batch | context | ms/step | tok/s per user | tok/s total | bytes/step (GB) | roofline ms | fraction of roofline | served ms/step | served / step | sync ms/step | GPU ms (graph replay) | GPU fraction | JSON-schema ms/step | grammar cost | tool-call ms/step | tool-call cost |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in results:
        lines.append(
            f"| {r.batch} | {r.context} | {r.ms_per_step:.2f} | {r.tok_per_s_per_user:.0f} | {r.batch * r.tok_per_s_per_user:.0f} "
            f"| {r.bytes.total / 1e9:.2f} | {1000 * r.bytes.total / r.bandwidth:.2f} | {r.roofline_fraction:.0%} "
            + (f"| {r.served_ms_per_step:.2f} | {r.served_ms_per_step / r.ms_per_step - 1:+.1%} " if r.served_ms_per_step else "| - | - ")
            + (f"| {r.sync_ms_per_step:.2f} " if r.sync_ms_per_step else "| - ")
            + (f"| {r.gpu_ms_per_step:.2f} | {1000 * r.bytes.total / r.bandwidth / r.gpu_ms_per_step:.0%} " if r.gpu_ms_per_step else "| - | - ")
            + "".join(f"| {ms:.2f} | {ms / r.ms_per_step - 1:+.1%} " if ms else "| - | - "
                      for ms in (r.grammar_ms_per_step, r.tool_grammar_ms_per_step)) + "|"
        )
    if skipped:
        lines.append("")
        lines.append("not run (KV does not fit the pool): " + ", ".join(f"batch {b} × {c}" for b, c in skipped))
    if prefill:
        lines += [
            "",
            f"prefill {prefill.tokens} tokens: {prefill.seconds:.2f} s ({prefill.tokens / prefill.seconds:.0f} tok/s), "
            f"{prefill.flops / 1e12:.0f} TFLOP -> {prefill.roofline_fraction:.0%} of the GEMM roofline",
        ]
    if kernels is not None:
        lines += [
            "",
            f"one decode step, batch 1, 1K context ({kernels.source}): {kernels.launches:.0f} launches, "
            f"{kernels.busy_us:.0f} µs busy in a {kernels.span_us:.0f} µs span "
            f"({kernels.span_us - kernels.busy_us:.0f} µs between kernels)",
            "",
            "| kernel | µs per step | launches per step |",
            "|---|---|---|",
        ]
        lines += [f"| `{k}` | {us:.1f} | {n:g} |" for k, us, n in kernels.kernels]
    return "\n".join(lines)

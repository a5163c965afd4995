"""The fleet figures of ``phloem bench agentic``: where the history came from, what resumes cost,
TTFT by turn, per-agent decode, and the tiers' bytes over time, read from the server's
``/metrics`` around and during one mode's run.

- ``TierSampler`` scrapes ``/metrics`` before the run, every ``interval_s`` during it (GPU
  prefix-cache bytes, host and disk tier bytes, sessions by status) and after it.
- ``fleet_summary`` turns the before/after deltas and the turn records into plain numbers:
  shares of already-sent tokens served by ``gpu`` / ``host`` / ``disk`` / ``recomputed``
  (``phloem_session_served_tokens_total``; a stateless mode, which those counters do not see,
  from its records: cached tokens of what it had sent before are ``gpu``, the rest
  recomputed); per tier the resumes, their mean tokens and seconds, and the recompute they
  replaced, estimated at the run's fastest turn-1 prefill rate (the least queued one:
  ``min(ttft / prompt_tokens)`` over turn 1, so the estimate leans low and the speedup is
  conservative); TTFT p50/p99 per turn; per-agent decode tok/s (output tokens after the first
  over the time spent producing them); lost turns; the engine's queue (mean running and waiting
  requests, the share of samples with waiting requests blocked on memory, the share of the run
  spent in engine steps, the KV pages and GDN state slots of its pools), which says whether a
  long TTFT was a wait for memory (and for which pool), for the device, or neither; the
  server's host memory at its peak (resident set, pinned bytes the caching host allocator
  holds, the host tier's payload: ``runtime.host_memory``), which says whether the host tier
  costs more than its payload; the disk writes (count, GB/s, where each one's seconds went)
  and the host segments dropped with the disk a backlog behind.
- ``plot_tiers`` draws the bytes over time per mode, the resident set and the pinned bytes
  dashed beside them (matplotlib, when present).
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from phloem.runtime.histogram import STEP_KINDS

if TYPE_CHECKING:
    from phloem.benchmarks.agentic import TurnRecord

__all__ = ["TierSampler", "fleet_markdown", "fleet_summary", "plot_tiers", "scrape"]

SOURCES = ("gpu", "host", "disk", "recomputed")
TIERS = ("host", "disk")
# (series key, sample name): the bytes sampled during a run.
_BYTES = (("gpu", "phloem_prefix_cache_bytes"), ("host", 'phloem_session_tier_bytes{tier="host"}'),
          ("backlog", "phloem_host_backlog_bytes"), ("disk", 'phloem_session_tier_bytes{tier="disk"}'))
_WRITE_PARTS = ("queued", "writing", "resumed")
# (series key, sample name): the engine's queue, sampled beside the bytes. Where a turn's TTFT
# went: requests running, requests not yet admitted, and whether those wait for memory (pools
# full after eviction) rather than for their turn.
_QUEUE = (("running", 'phloem_engine_requests{state="running"}'),
          ("waiting", 'phloem_engine_requests{state="waiting"}'), ("blocked", "phloem_engine_memory_blocked"))
# (series key, sample name): the server process's host memory, beside the host tier's payload.
_PROCESS = (("resident", "phloem_process_resident_bytes"), ("pinned", "phloem_process_pinned_bytes"))
# The series keys whose peaks the report gives: the server's host memory and the host tier's payload.
_MEMORY_PEAKS = ("resident", "pinned", "host")


def scrape(base_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """``/metrics`` as ``{'name{label="value",...}': value}``; empty when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(base_url + "/metrics", timeout=timeout_s)
        resp.raise_for_status()
    except httpx.HTTPError:
        return {}
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


class TierSampler:
    """``with TierSampler(url) as sampler:`` scrapes before, every ``interval_s``, and after
    (the first and last points of ``series`` are the before and after scrapes)."""

    def __init__(self, base_url: str, interval_s: float = 0.5) -> None:
        self._url, self._interval_s = base_url, interval_s
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}
        self.series: list[dict[str, float]] = []  # {"t": seconds since start, "gpu": bytes, ...}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> TierSampler:
        self._t0 = time.monotonic()
        self.before = self._sample(scrape(self._url))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self._sample(scrape(self._url))

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample(scrape(self._url, timeout_s=self._interval_s * 5))

    def _sample(self, m: dict[str, float]) -> dict[str, float]:
        if m:
            point = {"t": time.monotonic() - self._t0}
            point.update((key, m.get(name, 0.0)) for key, name in (*_BYTES, *_QUEUE))
            # Process memory only where the server reports it (no pinned memory without CUDA).
            point.update((key, m[name]) for key, name in _PROCESS if name in m)
            self.series.append(point)
        return m


def _delta(s: TierSampler, name: str) -> float:
    return s.after.get(name, 0.0) - s.before.get(name, 0.0)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


def fleet_summary(records: list[TurnRecord], sampler: TierSampler, expected_turns: int) -> dict[str, object]:
    """The fleet figures of one mode (module docstring); plain numbers for JSON."""
    served = {src: _delta(sampler, f'phloem_session_served_tokens_total{{source="{src}"}}') for src in SOURCES}
    if not any(served.values()):
        served = _served_from_records(records)
    total = sum(served.values())
    firsts = [r.ttft_s / r.prompt_tokens for r in records if r.turn == 1 and r.prompt_tokens and r.ttft_s > 0]
    s_per_token = min(firsts) if firsts else 0.0
    resumes: dict[str, dict[str, float]] = {}
    for tier in TIERS:
        count = _delta(sampler, f'phloem_session_resume_seconds_count{{tier="{tier}"}}')
        seconds = _delta(sampler, f'phloem_session_resume_seconds_sum{{tier="{tier}"}}')
        tokens = _delta(sampler, f'phloem_session_resume_tokens_total{{tier="{tier}"}}')
        mean_s, mean_tokens = (seconds / count, tokens / count) if count else (0.0, 0.0)
        recompute_s = mean_tokens * s_per_token
        resumes[tier] = {"count": count, "mean_tokens": mean_tokens, "mean_s": mean_s,
                         "recompute_s_est": recompute_s, "speedup": recompute_s / mean_s if mean_s else 0.0}
    ttft: dict[int, list[float]] = defaultdict(list)
    decode: dict[tuple[int, int], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in records:
        ttft[r.turn].append(r.ttft_s)
        if r.completion_tokens > 1 and r.tpot_s > 0:
            d = decode[(r.agent, r.branch)]
            d[0] += r.completion_tokens - 1
            d[1] += r.tpot_s * (r.completion_tokens - 1)
    per_agent = [tokens / seconds for tokens, seconds in decode.values() if seconds]
    return {
        "served_tokens": served,
        "served_shares": {src: n / total if total else 0.0 for src, n in served.items()},
        "served_from_cache_or_tier": (total - served["recomputed"]) / total if total else 0.0,
        "resumes": resumes,
        "ttft_by_turn": {t: {"p50": _quantile(v, 0.5), "p99": _quantile(v, 0.99)} for t, v in sorted(ttft.items())},
        "per_agent_decode_tok_s": {"p50": _quantile(per_agent, 0.5), "min": min(per_agent, default=0.0)},
        "lost_turns": expected_turns - len(records),
        "engine": _engine_summary(sampler),
        "disk_writes": _disk_writes(sampler),
        "host_memory_peak": {key: max((p[key] for p in sampler.series if key in p), default=None)
                             for key in _MEMORY_PEAKS},
        "tier_bytes": sampler.series,
    }


def _engine_summary(sampler: TierSampler) -> dict[str, float]:
    """The engine's queue over the samples taken during the run (the first and last points are
    the before and after scrapes): mean running and waiting requests, the share of samples with
    waiting requests blocked on memory, the share of the run's wall time the engine spent in
    steps (``phloem_engine_step_kind_seconds``; near 1: the device was the bottleneck) and in
    spills' exports (``phloem_engine_command_seconds{command="ExportPrefix"}``: copying sessions'
    state to host memory while every running request waits), the spill copies and disk reads that
    found no free range in the pinned arena (``phloem_host_arena_fallbacks``: each copied into
    pageable memory instead, its resume's copy then synchronous), the running requests preempted
    for pages (each recomputes what the cache lost of it), the steps and how many of them were
    queued behind the step before (``phloem_engine_pipelined_steps``: the rest ran after a
    synchronous one), the mixed steps among them (a tool result or a prompt beside the decode
    batch) and how many of those were queued (``phloem_engine_pipelined_mixed_steps``), and the
    pools it had (KV pages and GDN state slots: a run blocked on memory says which was short)."""
    during = sampler.series[1:-1] or sampler.series
    n = len(during)
    wall = sampler.series[-1]["t"] - sampler.series[0]["t"] if len(sampler.series) > 1 else 0.0
    stepping = sum(_delta(sampler, f'phloem_engine_step_kind_seconds_sum{{kind="{k}"}}') for k in STEP_KINDS)
    return {
        "running_mean": sum(p.get("running", 0.0) for p in during) / n if n else 0.0,
        "waiting_mean": sum(p.get("waiting", 0.0) for p in during) / n if n else 0.0,
        "memory_blocked_share": sum(p.get("blocked", 0.0) > 0 for p in during) / n if n else 0.0,
        "stepping_share": stepping / wall if wall else 0.0,
        "exporting_share": (_delta(sampler, 'phloem_engine_command_seconds_total{command="ExportPrefix"}') / wall
                            if wall else 0.0),
        "arena_fallbacks": _delta(sampler, "phloem_host_arena_fallbacks_total"),
        "preemptions": _delta(sampler, "phloem_engine_preemptions_total"),
        "steps": _delta(sampler, "phloem_engine_steps_total"),
        "steps_queued": _delta(sampler, "phloem_engine_pipelined_steps_total"),
        "mixed_steps": _delta(sampler, 'phloem_engine_step_kind_seconds_count{kind="mixed"}'),
        "mixed_steps_queued": _delta(sampler, "phloem_engine_pipelined_mixed_steps_total"),
        "kv_pages": sampler.before.get("phloem_kv_pages_total", 0.0),
        "state_slots": sampler.before.get("phloem_state_slots_total", 0.0),
    }


def _disk_writes(sampler: TierSampler) -> dict[str, float]:
    """The session state files the run wrote to disk: how many, their GB/s while writing (payload
    over the seconds spent in the writes), the mean seconds of each part of one write (waiting for
    a segment worker, writing with its fsyncs, waiting for the event loop after), and the host
    segments dropped unwritten because the disk was a backlog behind. A demotion far below the
    disk's own speed shows here which part its seconds went to."""
    count = _delta(sampler, "phloem_segment_writes_total")
    nbytes = _delta(sampler, "phloem_segment_write_bytes_total")
    parts = {p: _delta(sampler, f'phloem_segment_write_seconds_total{{part="{p}"}}') for p in _WRITE_PARTS}
    return {"count": count, "gb": nbytes / 1e9,
            "gb_per_s_writing": nbytes / 1e9 / parts["writing"] if parts["writing"] else 0.0,
            **{f"mean_{p}_s": v / count if count else 0.0 for p, v in parts.items()},
            "dropped": _delta(sampler, "phloem_segments_dropped_total")}


def _served_from_records(records: list[TurnRecord]) -> dict[str, float]:
    """Stateless modes (no session counters): each request's hits on what it had sent before are
    the GPU prefix cache's, the rest of that was recomputed."""
    seen = sum(r.prompt_tokens - r.new_tokens for r in records)
    hit = sum(min(r.cached_tokens, r.prompt_tokens - r.new_tokens) for r in records)
    return {"gpu": float(hit), "host": 0.0, "disk": 0.0, "recomputed": float(seen - hit)}


def fleet_markdown(summary: dict[str, dict[str, object]]) -> str:
    """Two tables: served shares and resumes per mode, and TTFT p50 / p99 per turn per mode."""
    lines = ["| mode | served gpu / host / disk / recomputed | from cache or tier | resume host: n, s (recompute s) "
             "| resume disk: n, s (recompute s) | per-agent decode tok/s p50 (min) | lost turns "
             "| engine: running / waiting mean, memory-blocked, stepping, exporting, preempted; steps queued "
             "/ all, mixed steps queued / all; pages / state slots "
             "| server host memory peak GiB: resident / pinned / host tier |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        f = s.get("fleet")
        if not isinstance(f, dict):
            continue
        shares = " / ".join(f"{f['served_shares'][src]:.1%}" for src in SOURCES)
        res = [f"{r['count']:.0f}, {r['mean_s']:.3f} ({r['recompute_s_est']:.3f})" for r in
               (f["resumes"][t] for t in TIERS)]
        dec = f["per_agent_decode_tok_s"]
        e = f["engine"]
        queue = (f"{e['running_mean']:.1f} / {e['waiting_mean']:.1f}, {e['memory_blocked_share']:.0%}, "
                 f"{e['stepping_share']:.0%}, {e['exporting_share']:.0%}, {e['preemptions']:.0f}; "
                 f"{e['steps_queued']:.0f} / {e['steps']:.0f}, {e['mixed_steps_queued']:.0f} / {e['mixed_steps']:.0f}; "
                 f"{e['kv_pages']:.0f} / {e['state_slots']:.0f}")
        mem = " / ".join("n/a" if v is None else f"{v / 2**30:.2f}"
                         for v in (f["host_memory_peak"][k] for k in _MEMORY_PEAKS))
        lines.append(f"| {mode} | {shares} | {f['served_from_cache_or_tier']:.1%} | {res[0]} | {res[1]} "
                     f"| {dec['p50']:.1f} ({dec['min']:.1f}) | {f['lost_turns']} | {queue} | {mem} |")
    fleets = {m: s["fleet"] for m, s in summary.items() if isinstance(s.get("fleet"), dict)}
    if not fleets:
        return "(no fleet figures: the server's /metrics could not be read)"
    lines += ["", "| mode | disk writes | GB | GB/s writing | mean s: queued / writing / event loop | dropped |",
              "|---|---|---|---|---|---|"]
    for mode, f in fleets.items():
        w = f.get("disk_writes")
        if isinstance(w, dict):
            lines.append(f"| {mode} | {w['count']:.0f} | {w['gb']:.1f} | {w['gb_per_s_writing']:.2f} | "
                         f"{w['mean_queued_s']:.3f} / {w['mean_writing_s']:.3f} / {w['mean_resumed_s']:.3f} "
                         f"| {w['dropped']:.0f} |")
    turns = sorted({t for f in fleets.values() for t in f["ttft_by_turn"]})  # type: ignore[index]
    lines += ["", "| turn | " + " | ".join(f"{m} TTFT p50 / p99 s" for m in fleets) + " |",
              "|---|" + "---|" * len(fleets)]
    for t in turns:
        cells = [f"{f['ttft_by_turn'][t]['p50']:.3f} / {f['ttft_by_turn'][t]['p99']:.3f}"  # type: ignore[index]
                 if t in f["ttft_by_turn"] else "" for f in fleets.values()]  # type: ignore[operator]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_tiers(series: dict[str, list[dict[str, float]]], out_dir: Path) -> list[Path]:
    """``tier_bytes_<mode>.png``: GPU prefix-cache, host and disk bytes over the run, and the
    server's resident set and pinned bytes dashed (where the scrapes had them); none without
    matplotlib or samples."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for mode, points in series.items():
        if not points:
            continue
        process = [key for key, _ in _PROCESS if any(key in p for p in points)]
        peak = max(p.get(key, 0.0) for p in points for key in (*(k for k, _ in _BYTES), *process))
        scale, unit = (2**30, "GiB") if peak >= 2**30 else (2**20, "MiB")
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, _ in _BYTES:
            ax.plot([p["t"] for p in points], [p.get(key, 0.0) / scale for p in points], marker=".", label=key)
        for key in process:
            ax.plot([p["t"] for p in points], [p.get(key, 0.0) / scale for p in points], linestyle="--",
                    label=f"server {key}")
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel(f"{unit} held")
        ax.set_title(f"session state by tier: {mode}")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"tier_bytes_{mode}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths

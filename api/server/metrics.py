"""``GET /metrics``: the server's counters in the Prometheus text format (prometheus-client).

Each app has its own ``CollectorRegistry`` (never the process-wide default), so several apps in
one process (tests) keep separate numbers. Two kinds of metrics live in it:

- HTTP metrics this layer observes itself (``RequestObserver`` calls ``observe_request``):
  ``phloem_http_requests_total{method,route,status}`` and
  ``phloem_http_request_duration_seconds{method,route}``. ``route`` is the route's template
  (``/v1/sessions/{session_id}/append``), never the raw path, so hostile or random paths cannot
  grow the label set; a path that matches no route is ``route="unmatched"``.
- Everything else is read at scrape time from the lower layers' result objects — plain numbers,
  no tensors: ``SessionManager.stats()`` (sessions by status, tokens, spills, resumes, and the
  tier accounting: ``phloem_session_served_tokens_total{source=gpu|host|disk|recomputed}``,
  ``phloem_session_resume_tokens_total{tier}``, ``phloem_session_resume_seconds{tier}``,
  ``phloem_session_tier_bytes{tier}``; ``sessions._served``) and
  ``EngineClient.stats()`` (pages, state slots, queue depth, step-time histogram) and
  ``EngineClient.grammar_stats()`` (the compiled-grammar cache's bytes and entries, compiles,
  rejections, timeouts; ``phloem_grammar_*``) and ``process_memory()`` (the process's resident
  set and pinned host bytes beside the host tier's payload, ``phloem_process_*``), rendered by ``_SnapshotCollector``. When the engine does not answer within ``_ENGINE_TIMEOUT_S`` (stopped,
  or stuck in a step) the engine metrics are left out and ``phloem_engine_up`` is 0.

Decision: the prefix-cache hit rate is exported as ``phloem_prefix_cache_hit_ratio``, the
lifetime ratio ``cached_tokens / prompt_tokens``; for a windowed rate, divide the counters'
rates (``rate(phloem_cached_tokens_total[5m]) / rate(phloem_prompt_tokens_total[5m])``).
Decision: without API keys ``/metrics`` is public like ``/health`` (one tenant; aggregate counts
only, no session id, owner, key or text). With keys it needs an admin key (``app.create_app``):
its counters sum every tenant's traffic (cached tokens, requests by route), and a tenant polling
them around another's request would learn that request's cache hits (docs/architecture.md,
"Invariants": what a tenant sees comes from its namespace alone). Prometheus sends the key as a bearer credential.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from phloem.engine import GrammarStats, SpeculationStats
from phloem.runtime import EngineClient, EngineStats, ProcessMemory, process_memory
from phloem.runtime.histogram import HistogramSnapshot
from phloem.sessions import SessionManager, SessionStats

__all__ = ["METRICS_CONTENT_TYPE", "ApiMetrics"]

# Litestar appends the charset to text/* media types itself.
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST.replace("; charset=utf-8", "")
_ENGINE_TIMEOUT_S = 5.0
_HTTP_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class ApiMetrics:
    """The app's metrics registry.

    Args:
        engine: Answers the engine's stats at scrape time.
        manager: Answers the sessions layer's stats at scrape time.
    """

    def __init__(self, engine: EngineClient, manager: SessionManager) -> None:
        self._engine = engine
        self._manager = manager
        self.registry = CollectorRegistry()
        self._requests = Counter("phloem_http_requests", "HTTP requests answered (WebSocket "
                                 "connections count once, when they end)",
                                 ["method", "route", "status"], registry=self.registry)
        self._seconds = Histogram("phloem_http_request_duration_seconds", "Time from a request's "
                                  "arrival to its last byte (a stream's whole length)",
                                  ["method", "route"], buckets=_HTTP_SECONDS, registry=self.registry)
        self._snapshot = _SnapshotCollector()
        self.registry.register(self._snapshot)

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one answered request."""
        self._requests.labels(method, route, str(status)).inc()
        self._seconds.labels(method, route).observe(seconds)

    async def render(self) -> bytes:
        """The whole registry in the Prometheus text format, with fresh engine/session stats."""
        engine = await self._engine.stats_or_none(_ENGINE_TIMEOUT_S)
        # No await between taking the snapshot and rendering it: one scrape, one snapshot.
        self._snapshot.engine, self._snapshot.sessions = engine, self._manager.stats()
        self._snapshot.grammar = self._engine.grammar_stats()
        self._snapshot.process = process_memory()
        return generate_latest(self.registry)


class _SnapshotCollector:
    """Renders the stats taken for the scrape in progress (``ApiMetrics.render``)."""

    def __init__(self) -> None:
        self.engine: EngineStats | None = None
        self.sessions: SessionStats | None = None
        self.grammar: GrammarStats | None = None
        self.process: ProcessMemory | None = None

    def describe(self) -> Iterable[Metric]:
        return [*_session_families(None), *_engine_families(None), *_grammar_families(None),
                *_process_families(None)]

    def collect(self) -> Iterator[Metric]:
        yield from _session_families(self.sessions)
        yield from _engine_families(self.engine)
        yield from _grammar_families(self.grammar)
        yield from _process_families(self.process)


def _counter(name: str, doc: str, value: float | None) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


_SessionValue = Callable[[SessionStats], float]
# (name, help, is a counter, value): the unlabelled metrics of ``SessionStats``.
_SESSION_METRICS: tuple[tuple[str, str, bool, _SessionValue], ...] = (
    ("phloem_prompt_tokens", "Prompt tokens of finished generations (their whole context, cached "
     "part included)", True, lambda s: s.prompt_tokens),
    ("phloem_cached_tokens", "Prompt tokens of finished generations taken from the prefix cache",
     True, lambda s: s.cached_tokens),
    ("phloem_completion_tokens", "Tokens generated by finished generations", True,
     lambda s: s.completion_tokens),
    ("phloem_prefix_cache_hit_ratio", "cached_tokens / prompt_tokens since the server started (0 "
     "before the first generation)", False,
     lambda s: s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0),
    ("phloem_generations_in_flight", "Generations started and not yet settled", False,
     lambda s: s.num_generations_in_flight),
    ("phloem_sessions_created", "Sessions created (forks not included)", True,
     lambda s: s.sessions_created),
    ("phloem_sessions_forked", "Sessions created by forking", True, lambda s: s.sessions_forked),
    ("phloem_sessions_deleted", "Sessions deleted", True, lambda s: s.sessions_deleted),
    ("phloem_session_resume_failures", "Resumes that fell back to recomputing the history", True,
     lambda s: s.resume_failures),
    ("phloem_host_pool_bytes", "Spilled session state held in host memory", False,
     lambda s: s.host_pool_bytes),
    ("phloem_host_pool_budget_bytes", "Cap on spilled state held in host memory", False,
     lambda s: s.host_pool_budget_bytes),
    ("phloem_host_backlog_bytes", "Spilled session state in host memory waiting for the disk writes "
     "that make its room in the host pool", False, lambda s: s.host_backlog_bytes),
    ("phloem_host_arena_bytes", "Host memory pinned once at start for spilled state's copies (0 "
     "without CUDA or session tiers)", False, lambda s: s.host_arena_bytes),
    ("phloem_host_arena_fallbacks", "Spill copies and disk reads that found no free range in the "
     "pinned arena and went to pageable memory (their resumes copy synchronously)", True,
     lambda s: s.host_arena_fallbacks),
    ("phloem_segment_writes", "Session state files written to disk", True, lambda s: s.disk_writes.count),
    ("phloem_segment_write_bytes", "Payload bytes of the session state files written to disk", True,
     lambda s: s.disk_writes.nbytes),
    ("phloem_segments_dropped", "Host segments dropped, not written, with the disk a whole backlog "
     "behind (their sessions recompute them)", True, lambda s: s.segments_dropped.count),
)


def _session_families(s: SessionStats | None) -> list[Metric]:
    """The sessions layer's metrics; without ``s`` (``describe``) the families have no samples."""
    families: list[Metric] = [
        (_counter if is_counter else _gauge)(name, doc, None if s is None else value(s))
        for name, doc, is_counter, value in _SESSION_METRICS
    ]
    generations = CounterMetricFamily("phloem_generations", "Finished generations",
                                      labels=["finish_reason"])
    sessions = GaugeMetricFamily("phloem_sessions", "Live sessions by status", labels=["status"])
    moves = [CounterMetricFamily(name, doc, labels=["tier"]) for name, doc in (
        ("phloem_session_spills", "Sessions moved off the GPU's pins, by tier"),
        ("phloem_session_spill_bytes", "Bytes of session state written to a tier"),
        ("phloem_session_resumes", "Spilled session states loaded back, by the tier read"),
        ("phloem_session_resume_bytes", "Bytes of session state loaded back, by the tier read"))]
    families += _served_families(s)
    families += _first_token_families(s)
    if s is not None:
        for reason in sorted({"stop", "length", "cancelled", *s.generations}):
            generations.add_metric([reason], s.generations.get(reason, 0))
        for status, num in s.sessions_by_status.items():
            sessions.add_metric([status], num)
        for tier in ("host", "disk"):
            spill, resume = s.spills[tier], s.resumes[tier]
            for family, value in zip(moves, (spill.count, spill.nbytes, resume.count, resume.nbytes)):
                family.add_metric([tier], value)
    return [*families, generations, sessions, *moves]


def _first_token_families(s: SessionStats | None) -> list[Metric]:
    """Seconds from a generation's start to its first token, and of those reading its spilled
    state back, by kind (``sessions._events``)."""
    first = HistogramMetricFamily("phloem_generation_first_token_seconds", "Seconds from a "
                                  "generation's start (its input resolved) to its first token, by "
                                  "kind: session (an append) or stateless", labels=["kind"])
    prepare = HistogramMetricFamily("phloem_generation_prepare_seconds", "Of the first-token "
                                    "seconds, those spent reading the session's spilled state back "
                                    "before the engine request, by kind", labels=["kind"])
    if s is not None:
        for family, by_kind in ((first, s.first_token_seconds), (prepare, s.prepare_seconds)):
            for kind, h in by_kind.items():
                family.add_metric([kind], _buckets(h), sum_value=h.total)
    return [first, prepare]


def _served_families(s: SessionStats | None) -> list[Metric]:
    """Where session turns' already-sent tokens came from, and resumes by tier
    (``sessions._served``)."""
    served = CounterMetricFamily("phloem_session_served_tokens", "Already-sent tokens of session "
                                 "turns by where they were served from: gpu (prefix cache), host, "
                                 "disk (a resumed spill) or recomputed", labels=["source"])
    tokens = CounterMetricFamily("phloem_session_resume_tokens", "Tokens imported by resumes, by "
                                 "the tier read", labels=["tier"])
    seconds = HistogramMetricFamily("phloem_session_resume_seconds", "Wall time of one resume "
                                    "(segment load + import), by the tier read", labels=["tier"])
    held = GaugeMetricFamily("phloem_session_tier_bytes", "Spilled session state held, by tier",
                             labels=["tier"])
    writes = CounterMetricFamily("phloem_segment_write_seconds", "Seconds of the session state file "
                                 "writes by part: queued (waiting for a segment worker), writing (the "
                                 "write and its fsyncs), resumed (waiting for the event loop after)",
                                 labels=["part"])
    if s is not None:
        for source, num in s.served.served_tokens.items():
            served.add_metric([source], num)
        for tier, num in s.served.resume_tokens.items():
            tokens.add_metric([tier], num)
        for tier, h in s.served.resume_seconds.items():
            seconds.add_metric([tier], _buckets(h), sum_value=h.total)
        held.add_metric(["host"], s.host_pool_bytes)
        held.add_metric(["disk"], s.disk_bytes)
        w = s.disk_writes
        for part, value in (("queued", w.queued_s), ("writing", w.writing_s), ("resumed", w.resumed_s)):
            writes.add_metric([part], value)
    return [served, tokens, seconds, held, writes]


def _engine_families(e: EngineStats | None) -> list[Metric]:
    describe = e is None
    up = GaugeMetricFamily("phloem_engine_up", "1 when the engine answered this scrape")
    if not describe:
        up.add_metric([], 1.0)
    requests = GaugeMetricFamily("phloem_engine_requests", "Engine requests by state (queue depth:"
                                 " waiting = not yet admitted)", labels=["state"])
    families: list[Metric] = [up, requests]
    if e is None:
        return families
    requests.add_metric(["waiting"], e.num_waiting)
    requests.add_metric(["running"], e.num_running)
    families += [
        _gauge("phloem_kv_pages_used", "KV pages in use (running requests and the prefix cache)",
               e.num_pages - e.num_free_pages),
        _gauge("phloem_kv_pages_total", "KV pages in the pool", e.num_pages),
        _gauge("phloem_kv_pages_cached", "KV pages held by the prefix cache", e.cache.pages_in_tree),
        _gauge("phloem_state_slots_used", "GDN state slots in use (running requests and "
               "checkpoints)", e.num_slots - e.num_free_slots),
        _gauge("phloem_state_slots_total", "GDN state slots in the pool", e.num_slots),
        _gauge("phloem_prefix_checkpoints", "GDN checkpoints held by the prefix cache",
               e.cache.checkpoints),
        _gauge("phloem_prefix_cache_bytes", "Device bytes the prefix cache holds (its KV pages and "
               "checkpoint state slots; the GPU tier of session state)", e.cache.bytes_in_tree),
        _counter("phloem_prefix_checkpoints_evicted", "GDN checkpoints the prefix cache evicted "
                 "for room (periodic ones first)", e.cache.checkpoints_evicted),
        _gauge("phloem_engine_memory_blocked", "1 while waiting requests wait for memory (pools "
               "full after eviction), not for their turn", float(e.memory_blocked)),
        _counter("phloem_engine_steps", "Engine steps run", e.num_steps),
        _counter("phloem_engine_failed_steps", "Engine steps that raised", e.num_failed_steps),
        _histogram("phloem_engine_step_seconds", "Wall time of one engine step", e.step_seconds),
        _counter("phloem_engine_pipelined_steps", "Steps queued on the device behind the step "
                 "being collected (async scheduling)", e.num_pipelined_steps),
        _counter("phloem_engine_pipelined_mixed_steps", "Queued steps that admitted waiting requests "
                 "beside the decode rows (a tool result, a new prompt)", e.num_pipelined_mixed_steps),
        _counter("phloem_engine_preemptions", "Running requests preempted for pages (they wait "
                 "again, and recompute what the prefix cache lost of them)", e.num_preemptions),
        _counter("phloem_engine_between_steps_seconds", "Host time the engine thread spent between "
                 "steps while requests were in flight (commands, delivering outputs)",
                 e.between_steps_seconds),
    ]
    by_command = CounterMetricFamily("phloem_engine_command_seconds", "Engine-thread seconds answering "
                                     "commands between steps, by command (ExportPrefix: copying a spilled "
                                     "session's state to host memory)", labels=["command"])
    for name, seconds in sorted(e.command_seconds.items()):
        by_command.add_metric([name], seconds)
    families.append(by_command)
    by_kind = HistogramMetricFamily("phloem_engine_step_kind_seconds", "Wall time of one engine step by "
                                    "what it computed: decode (one token per request), prefill, mixed",
                                    labels=["kind"])
    for kind, h in e.step_kind_seconds.items():
        by_kind.add_metric([kind], _buckets(h), sum_value=h.total)
    families.append(by_kind)
    if e.speculation is not None:
        families += _speculation_families(e.speculation)
    return families


def _process_families(p: ProcessMemory | None) -> list[Metric]:
    """The server process's host memory (``runtime.host_memory``); a value that cannot be read
    here (no CUDA: no pinned memory; not Linux: no resident set) has no sample."""
    return [
        _gauge("phloem_process_resident_bytes", "Resident set of the server process (pinned "
               "memory included)", None if p is None else p.resident_bytes),
        _gauge("phloem_process_pinned_bytes", "Page-locked host memory torch's caching host allocator "
               "holds, in use or cached for reuse, at sizes rounded up to powers of two (the host "
               "tier's segments and staging buffers)", None if p is None else p.pinned_bytes),
        _gauge("phloem_process_pinned_active_bytes", "Of phloem_process_pinned_bytes, the blocks in use",
               None if p is None else p.pinned_active_bytes),
    ]


def _speculation_families(s: SpeculationStats) -> list[Metric]:
    """Speculative decoding's metrics (present only while it is configured)."""
    # Per request per speculative step: accepted drafts + the target's token, 1 .. k + 1.
    lengths = HistogramSnapshot(tuple(float(n) for n in range(1, len(s.emitted_lengths))),
                                (*s.emitted_lengths[1:], 0), float(s.emitted_tokens))
    return [
        _counter("phloem_speculative_steps", "Decode steps that drafted and verified (speculative)", s.steps),
        _counter("phloem_speculative_plain_steps", "Steps of a speculating engine that ran plain (prefill, "
                 "mixed, requests that do not speculate, a batch over the limit)", s.plain_steps),
        _counter("phloem_speculative_over_batch_steps", "Decode steps that ran plain because the batch was "
                 "over SpeculativeConfig.max_batch_size", s.over_batch_steps),
        _counter("phloem_speculative_drafted_tokens", "Tokens the MTP layer drafted", s.drafted_tokens),
        _counter("phloem_speculative_accepted_tokens", "Drafted tokens the target accepted (and emitted)",
                 s.accepted_tokens),
        _counter("phloem_speculative_emitted_tokens", "Tokens speculative steps emitted (accepted drafts + "
                 "the target's own)", s.emitted_tokens),
        _histogram("phloem_speculative_accepted_length", "Tokens one request got from one speculative step "
                   "(accepted drafts + the target's token)", lengths),
    ]


# (name, help, is a counter, value): the metrics of ``GrammarStats`` (the compiled-grammar cache
# and the compile pool; read without the engine thread, so present even when it is busy).
_GRAMMAR_METRICS: list[tuple[str, str, bool, Callable[[GrammarStats], float]]] = [
    ("phloem_grammar_cache_bytes", "Measured bytes of the compiled grammars kept (bounded: "
     "phloem_grammar_cache_capacity_bytes, and a quota per API key)", False, lambda g: g.cache_bytes),
    ("phloem_grammar_cache_capacity_bytes", "The compiled-grammar cache's bound in bytes", False,
     lambda g: g.cache_capacity_bytes),
    ("phloem_grammar_cache_entries", "Compiled grammars kept", False, lambda g: g.cache_entries),
    ("phloem_grammar_cache_evictions", "Compiled grammars evicted for room (a key's quota or the "
     "whole cache)", True, lambda g: g.cache_evictions),
    ("phloem_grammar_compiles", "Grammars compiled (cache misses)", True, lambda g: g.compiles),
    ("phloem_grammar_rejections", "Grammars refused: past a size or complexity limit, or not "
     "compilable", True, lambda g: g.rejections),
    ("phloem_grammar_compile_timeouts", "Requests refused because their grammar was not compiled "
     "within the budget", True, lambda g: g.timeouts),
    ("phloem_grammar_compiles_abandoned", "Queued compiles dropped before they started: every "
     "request waiting for them went away", True, lambda g: g.abandoned),
]


def _grammar_families(g: GrammarStats | None) -> list[Metric]:
    return [
        (_counter if is_counter else _gauge)(name, doc, None if g is None else value(g))
        for name, doc, is_counter, value in _GRAMMAR_METRICS
    ]


def _histogram(name: str, doc: str, h: HistogramSnapshot) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=_buckets(h), sum_value=h.total)


def _buckets(h: HistogramSnapshot) -> list[tuple[str, float]]:
    cumulative, buckets = 0, []
    for bound, count in zip([*h.bounds, math.inf], h.counts):
        cumulative += count
        buckets.append(("+Inf" if bound == math.inf else repr(bound), cumulative))
    return buckets

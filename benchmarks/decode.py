"""``phloem bench decode``: decode speed against the memory-bandwidth roofline, measured in one run.

For each (batch, context) the engine decodes ``steps`` tokens for ``batch`` requests whose KV
history of ``context`` tokens is synthetic (pages filled with random values, no prefill): decode
cost depends on how many bytes are read, not on what they hold. The roofline of a step is the
bytes it must read at least — the weights it touches (dense weights, lm_head, the embedding rows,
the experts the batch routes to) + the KV of every request + each request's GDN state read and
written — over the device-to-device copy bandwidth measured in the same run.

Prefill of one long prompt is reported against the FLOP roofline: ``2 × active params × tokens``
plus causal attention ``2 × Hq × D × T²`` per attention layer, over a measured bf16 GEMM rate.

With a grammar (``--grammar``) every request of a point decodes again under ``BENCH_SCHEMA``, a
JSON Schema whose ``minItems`` keeps the document open for the whole run: the cost of
constrained decoding (the bitmask filled on the host each step while the next forward runs, and
the masked sampling launched after it) against the same point without it. Then again under the
grammar every chat request with tools gets by default (``tool_choice: auto``,
``tool_call_constraint: strict`` over ``BENCH_TOOLS``, ``tool_call_grammar``): free text the
matcher watches for ``<tool_call>``, then a call constrained to a declared name and its schema.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from phloem.benchmarks.progress_lines import tick
from phloem.engine import Engine, GrammarSpec, SamplingParams
from phloem.engine.request import Request, RequestStatus

__all__ = [
    "BENCH_SCHEMA",
    "BENCH_TOOLS",
    "DecodeResult",
    "PrefillResult",
    "StepBytes",
    "StepProfile",
    "decode_tokens",
    "graph_us",
    "kernel_breakdown",
    "measure_bandwidth",
    "measure_matmul_rate",
    "replay_ms",
    "run_decode",
    "run_prefill",
    "step_bytes",
    "tool_call_grammar",
]


# An array of records that cannot close within a benchmark: objects, strings, integers, enums.
BENCH_SCHEMA = GrammarSpec("json_schema", (
    '{"type": "array", "minItems": 100000, "items": {"type": "object", "required": ["id", "name", "ok", "tags"], '
    '"properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12}, '
    '"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}}}}'
))

# Three tools an agent typically declares; their schemas hold strings, integers, an enum, an array.
BENCH_TOOLS: tuple[dict[str, Any], ...] = tuple(
    {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}
    for name, description, properties in (
        ("read_file", "Read a file of the workspace.",
         {"path": {"type": "string"}, "offset": {"type": "integer"}, "limit": {"type": "integer"}}),
        ("run_command", "Run a shell command.",
         {"command": {"type": "string"}, "timeout_s": {"type": "integer"}}),
        ("search", "Search the code base.",
         {"query": {"type": "string"}, "kind": {"enum": ["text", "symbol", "file"]},
          "paths": {"type": "array", "items": {"type": "string"}}}),
    )
)


def tool_call_grammar(tool_format: str) -> GrammarSpec:
    """The grammar a chat request declaring ``BENCH_TOOLS`` gets with the defaults (``auto``,
    ``strict``), in ``tool_format`` (``hermes`` or ``qwen_xml``): the served rule itself."""
    from phloem.sessions.text.output_parser import OutputFormat
    from phloem.sessions.text.structured import ToolChoice, build_grammar

    grammar = build_grammar(OutputFormat(tool_format=tool_format, tools=BENCH_TOOLS), None,  # type: ignore[arg-type]
                            ToolChoice("auto"))
    assert grammar is not None
    return grammar


@dataclass(frozen=True, slots=True)
class StepBytes:
    weights: int
    kv: int
    state: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state


@dataclass(frozen=True, slots=True)
class DecodeResult:
    batch: int
    context: int
    ms_per_step: float  # wall time per engine step, as the engine steps (async scheduling on or off)
    bytes: StepBytes
    bandwidth: float  # bytes/s
    gpu_ms_per_step: float | None = None  # CUDA-graph replay alone, timed with device events
    sync_ms_per_step: float | None = None  # the same steps with async scheduling off
    grammar_ms_per_step: float | None = None  # the same steps, every request under BENCH_SCHEMA
    tool_grammar_ms_per_step: float | None = None  # the same steps under ``tool_call_grammar``
    # Requests of the same batch and context through the engine loop (``benchmarks.served``):
    # the time per token a user gets.
    served_ms_per_step: float | None = None

    @property
    def tok_per_s_per_user(self) -> float:
        return 1000.0 / self.ms_per_step

    @property
    def roofline_fraction(self) -> float:
        return (self.bytes.total / self.bandwidth) / (self.ms_per_step / 1000.0)


@dataclass(frozen=True, slots=True)
class PrefillResult:
    tokens: int
    seconds: float
    flops: float
    matmul_rate: float  # FLOP/s

    @property
    def roofline_fraction(self) -> float:
        return (self.flops / self.matmul_rate) / self.seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 10, timer: str = "device") -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written: the
    median of ``repeats`` copies of ``nbytes / 2`` bytes (after two untimed ones).

    ``timer="device"`` times each copy with CUDA events recorded around it on the copy's stream, so
    the figure is the copy kernel's own time; ``timer="host"`` times it on the host between two
    synchronisations, which adds the launch and the wake-up of the host (~1% of a 1 ms copy), so
    the figure is a little lower and the roofline built on it a little easier to reach. The bench
    divides by the device-timed figure and reports the host-timed one beside it (the ninth
    session's runs, host-timed, spread over 4.07-4.21 TB/s on one machine). On a CPU both are host-timed.
    """
    if timer not in ("device", "host"):
        raise ValueError(f"timer must be 'device' or 'host', got {timer!r}")
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    events = timer == "device" and device.type == "cuda"
    times = []
    for i in range(repeats + 2):
        _sync(device)
        if events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            _sync(device)
            seconds = time.perf_counter() - t0
        if i >= 2:
            times.append(seconds)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def measure_matmul_rate(device: torch.device, n: int = 8192, repeats: int = 10) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(repeats + 3):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def _param_bytes(engine: Engine) -> tuple[int, int, int]:
    """(dense bytes, bytes of one expert's three matrices summed over MoE layers, embedding row bytes).

    The shared expert is stored as the last expert of each MoE layer, so it counts as an expert
    that every token reads (see ``step_bytes``), not as a dense weight.
    """
    dense = expert = 0
    embed_row = 0
    model = engine.runner.model
    for name, p in model.named_parameters():  # type: ignore[attr-defined]
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert += nbytes // p.shape[0]
        elif "embed_tokens" in name:
            embed_row = p.shape[1] * p.element_size()
        else:
            dense += nbytes
    return dense, expert, embed_row


def step_bytes(engine: Engine, batch: int, context: int) -> StepBytes:
    mc = engine.model_config
    dense, expert_per_layerset, embed_row = _param_bytes(engine)
    e, k = max(mc.num_experts, 1), mc.num_experts_per_tok
    # Distinct routed experts a batch of independent tokens reaches per layer (uniform routing),
    # plus the shared expert, which every token reads. Under expert parallelism rank 0 (the
    # busiest: it also holds the shared expert) reads the distinct ones of its E/N.
    held = e // engine.runner.tp.size if engine.runner.tp.expert_parallel else e
    distinct = held * (1 - (1 - k / e) ** batch) + 1 if mc.num_experts else 0
    weights = int(dense + batch * embed_row + distinct * expert_per_layerset)
    elem = engine.dtype.itemsize
    # Rank 0's share under tensor parallelism (its parameters, KV heads and state): every rank
    # reads its own share at the same time, so the step's roofline is one rank's bytes.
    kv_heads = engine.runner.caches.kv.shape[-2]
    kv_per_token = len(mc.full_attention_layers) * 2 * kv_heads * mc.head_dim * engine.runner.caches.kv.element_size()
    slot_bytes = engine.runner.caches.ssm[:, 0].numel() * 4 + engine.runner.caches.conv[:, 0].numel() * elem
    return StepBytes(weights, batch * context * kv_per_token, batch * 2 * slot_bytes)


def decode_tokens(steps: int, warmup: int) -> int:
    """Tokens of KV ``run_decode`` adds to each request's context (both timed passes)."""
    return 2 * (steps + warmup) + 2


def run_decode(
    engine: Engine, batch: int, context: int, bandwidth: float, steps: int = 20, warmup: int = 3, seed: int = 0,
    compare_sync: bool = True, grammar: GrammarSpec | None = None, tokens_per_step: int = 1,
    before_timing: Callable[[], None] | None = None, tool_grammar: GrammarSpec | None = None,
) -> DecodeResult:
    """Decode ``steps`` tokens for ``batch`` synthetic requests of ``context`` tokens of history.

    The requests join the scheduler as running (admitted, pages allocated, history marked
    computed) and the engine steps them as it would serve them: ``engine.step()`` with its own
    async scheduling, timed over ``steps`` consecutive calls after ``warmup`` (no sync between
    them: with a step queued, each call's host work overlaps the device's step). With
    ``compare_sync`` and async scheduling on, the same requests are then timed with it off
    (``DecodeResult.sync_ms_per_step``). With ``grammar``, fresh requests of the same point are
    then timed with every one constrained by it (``DecodeResult.grammar_ms_per_step``), and
    likewise with ``tool_grammar`` (``DecodeResult.tool_grammar_ms_per_step``).
    ``tokens_per_step``: the most tokens a step may add to a request (speculative decoding: k + 1),
    so the requests' budgets and pages last the whole run; ``before_timing`` is called between the
    warm-up and the timed steps.
    """
    result = _run_decode(engine, batch, context, bandwidth, steps, warmup, seed, compare_sync, None, tokens_per_step,
                         before_timing)
    timed = {}
    for name, spec in (("grammar_ms_per_step", grammar), ("tool_grammar_ms_per_step", tool_grammar)):
        if spec is not None:
            timed[name] = _run_decode(engine, batch, context, bandwidth, steps, warmup, seed, False, spec).ms_per_step
    return replace(result, **timed)


def _run_decode(
    engine: Engine, batch: int, context: int, bandwidth: float, steps: int, warmup: int, seed: int,
    compare_sync: bool, grammar: GrammarSpec | None, tokens_per_step: int = 1,
    before_timing: Callable[[], None] | None = None,
) -> DecodeResult:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    extra = decode_tokens(steps, warmup) * tokens_per_step
    if context + extra >= engine.max_model_len:
        raise ValueError(f"context {context} + {extra} decoded tokens reaches the limit {engine.max_model_len}")
    reqs = []
    for i in range(batch):
        params = SamplingParams(max_tokens=extra + 8, ignore_eos=True, grammar=grammar)
        # The history is the prompt, as a served request's is (so each step's outputs cost what
        # they cost there); its prompt-end checkpoint lands in the first warm-up step.
        req = Request(f"bench-{i}", [rng.randrange(vocab) for _ in range(context)], params, arrival_idx=i)
        assert engine.cache.admit(req) and engine.cache.allocate_pages(req, context + extra), (
            f"batch {batch} x context {context} does not fit the KV pool"
        )
        req.num_computed_tokens = context - 1
        req.has_state, req.read_slot = True, req.write_slot
        if grammar is not None:
            assert engine.grammar is not None, "a grammar needs the engine's GrammarBackend"
            req.grammar = engine.grammar.matcher(grammar)
        req.status = RequestStatus.RUNNING
        reqs.append(req)
    running = engine.scheduler.running
    running.extend(reqs)
    pipelined = engine.async_scheduling
    try:
        ms = _time_steps(engine, steps, warmup, before_timing)
        sync_ms = None
        if pipelined and compare_sync:
            engine.async_scheduling = False
            sync_ms = _time_steps(engine, steps, warmup)
        gpu_ms = _graph_replay_ms(engine, batch)
    finally:
        engine.async_scheduling = pipelined
        engine.drain()
        for r in reqs:
            if r in running:
                running.remove(r)
            engine.cache.release(r, publish=False)
        if engine.cache.tree is not None:
            engine.cache.tree.clear()  # the prompt-end checkpoints: the next point starts empty
    return DecodeResult(batch, context, ms, step_bytes(engine, batch, context), bandwidth, gpu_ms, sync_ms)


def _time_steps(engine: Engine, steps: int, warmup: int, before_timing: Callable[[], None] | None = None) -> float:
    """Milliseconds per ``engine.step()`` over ``steps`` calls after ``warmup`` calls."""
    for i in range(warmup):
        engine.step()
        tick(f"warm-up {i + 1}/{warmup}")
    if before_timing is not None:
        before_timing()
    t0 = time.perf_counter()
    for i in range(steps):
        outputs = engine.step()
        assert len(outputs) == len(engine.scheduler.running), "every request decodes each step"
        tick(f"{i + 1}/{steps} steps")
    elapsed = time.perf_counter() - t0
    engine.drain()
    return 1000 * elapsed / steps


def _graph_replay_ms(engine: Engine, batch: int, repeats: int = 20) -> float | None:
    """Device time of the last-planned graph of this batch's bucket, replayed back to back (None under
    tensor parallelism: replaying rank 0's graph alone would wait forever in its first all-reduce)."""
    graphs = engine.runner.graphs
    if graphs is None or batch > graphs.max_batch_size() or engine.workers is not None:
        return None
    return replay_ms(graphs.graphs[graphs.bucket(batch)][0], repeats)


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int) -> float:
    """Device ms of one replay of ``graph``, from ``repeats`` replays back to back (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def graph_us(fn: Any, calls: int, repeats: int = 30) -> float:
    """Device µs per call of ``fn`` (which makes ``calls`` launches), from a CUDA graph of one
    ``fn()`` captured after a warm-up call (compilation stays out) and replayed (kernel sweeps)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return 1000 * replay_ms(graph, repeats) / calls


def run_prefill(engine: Engine, tokens: int, matmul_rate: float, seed: int = 0) -> PrefillResult:
    """Time one prompt of ``tokens`` tokens to its first generated token (chunked by the engine's budget)."""
    rng = random.Random(seed)
    mc = engine.model_config
    prompt = [rng.randrange(mc.vocab_size) for _ in range(tokens)]
    # Warm-up: the first prefill JIT-compiles kernels (fla, FlashInfer, Triton); keep that out.
    engine.generate([prompt[: min(tokens, 4096)][::-1]], SamplingParams(max_tokens=1, ignore_eos=True))
    _sync(engine.device)
    t0 = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))
    _sync(engine.device)
    seconds = time.perf_counter() - t0
    dense, expert, _ = _param_bytes(engine)
    active_params = (dense + (mc.num_experts_per_tok + 1) * expert) / engine.dtype.itemsize
    attn = len(mc.full_attention_layers) * 2 * mc.num_attention_heads * mc.head_dim * tokens**2
    return PrefillResult(tokens, seconds, 2 * active_params * tokens + attn, matmul_rate)


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Where one decode step's device time goes: per kernel, and the launches' total span.

    ``busy_us`` is the union of the kernels' intervals per step and ``span_us`` first start to last
    end, so ``span_us - busy_us`` is the time the GPU sat between dependent launches."""

    source: str  # "graph": the step's CUDA graph replayed; "eager": one step launched op by op
    kernels: list[tuple[str, float, float]]  # (kernel, µs per step, launches per step), largest first
    launches: float  # per step
    busy_us: float
    span_us: float
    # The first step's launches in order: (kernel, start µs from the step's first launch, µs). Under
    # programmatic dependent launch a kernel's interval includes the time it sat in its wait for the
    # kernel before; with PHLOEM_PDL=0 each interval is the kernel alone.
    timeline: list[tuple[str, float, float]] = field(default_factory=list)


def kernel_breakdown(engine: Engine, batch: int = 1, context: int = 1024, top: int = 20, replays: int = 10) -> StepProfile:
    """Profile one decode step of ``batch`` requests at ``context``: its CUDA graph replayed
    ``replays`` times when the engine has one, else one eager step."""
    from torch.profiler import ProfilerActivity, profile

    run_decode(engine, batch, context, 1.0, steps=1, warmup=2, compare_sync=False)
    graphs = engine.runner.graphs
    if graphs is not None and batch <= graphs.max_batch_size():
        graph = graphs.graphs[graphs.bucket(batch)][0]
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        result = _step_profile(prof, "graph", replays, top)
        if result.launches:
            return result
    engine.runner.graphs = None
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_decode(engine, batch, context, 1.0, steps=1, warmup=0, compare_sync=False)
    finally:
        engine.runner.graphs = graphs
    return _step_profile(prof, "eager", 1, top)


def _step_profile(prof: Any, source: str, steps: int, top: int) -> StepProfile:
    """Kernel rows and busy/span times per step from a profiler's device events."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    totals: dict[str, list[float]] = {}
    intervals = sorted((e.time_range.start, e.time_range.end) for e in events)
    for e in events:
        row = totals.setdefault(e.name, [0.0, 0])
        row[0] += e.time_range.end - e.time_range.start
        row[1] += 1
    busy, reach = 0.0, float("-inf")
    for start, end in intervals:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    span = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    rows = sorted(((name[:70], us / steps, n / steps) for name, (us, n) in totals.items()), key=lambda r: -r[1])
    first = sorted(events, key=lambda e: e.time_range.start)[: len(events) // max(steps, 1)]
    t0 = first[0].time_range.start if first else 0.0
    timeline = [(e.name[:48], e.time_range.start - t0, e.time_range.end - e.time_range.start) for e in first]
    return StepProfile(source, rows[:top], len(events) / steps, busy / steps, span / steps, timeline)

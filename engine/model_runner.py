"""Turns a scheduled step into tensors, runs the model, and samples.

``prepare_inputs`` gathers the step on the host (plain lists); the eager path turns them into a
``ForwardBatch`` (planning FlashInfer when it is the attention backend), the CUDA-graph path copies
them into the captured graph's static buffers. Only rows that need a next token are projected to
logits and sampled. The only device-to-host transfer of a step is the sampled ids.

A step is ``launch`` (queue the forward and the sampling on the device) then ``collect`` (read
the sampled ids back: the step's one host sync). Between the two the engine may launch the next
decode step (``engine.step_pipeline``), whose input ids are the previous step's sampled ids
*on the device* (``input_ids``): the host then prepares step N+1 while the device runs step N.
When step N+1's logits processing needs step N's tokens on the host (a grammar's mask, the
penalties' counts), ``launch`` queues only its forward, and ``sample_queued`` queues its
sampling once step N's tokens are read and applied, while the device still runs step N+1's
forward::

    device:  fwd N | sample N | fwd N+1 ................ | sample N+1 | fwd N+2 ...
    host:    launch fwd N+1 | wait ids N, accept them, fill masks | sample_queued(N+1) | ...

Under tensor parallelism rank 0's runner hands each step's ``StepPlan`` (its page copies and
inputs) to ``plan_sink`` before its own forward; a worker rank's runner gets the plan through
``run_plan`` and joins the same forward (``engine.step_plan``), replayed from the same CUDA graph
bucket when graphs are on (every rank captures the same buckets; the collectives are captured
with them). Reading or writing a cached prefix's state (``read_state`` / ``write_state``, for
session spill and resume) is a plan too: every rank joins the gather or scatter
(``engine.parallel.state_shards``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from phloem.engine.cache.memory import PoolPlan, allocate_caches, kv_dtype, plan_pools
from phloem.engine.cache.page_lists import PageListMirror
from phloem.engine.config import CacheConfig, ModelConfig, RunnerConfig
from phloem.engine.copy_fence import CopyFence, StreamFence
from phloem.engine.cuda_graph import CudaGraphRunner
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.host_copy import to_device
from phloem.engine.parallel.group import TPGroup
from phloem.engine.parallel.state_shards import StateTensors, gather_state, scatter_state, state_shapes, write_local
from phloem.engine.prefill_graph import PrefillGraphRunner
from phloem.engine.request import Request, TokenLogprob
from phloem.engine.sampling.logits_processors import StepLogprobs, StepProcessing
from phloem.engine.sampling.sampler import sample
from phloem.engine.scheduler import SchedulerOutput
from phloem.engine.step_plan import StateMove, StepInputs, StepPlan
from phloem.kernels.attention.flashinfer import FlashInferAttention, flashinfer_available
from phloem.kernels.config import KernelConfig

__all__ = [
    "AttnLayerHook", "CausalLM", "LaunchedStep", "ModelRunner", "StepInputs", "StepLayerHook", "StepResult",
    "build_runner",
]

PlanSink = Callable[[StepPlan], None]
# Called with a full-attention layer's cache index once that layer's forward wrote its KV.
AttnLayerHook = Callable[[int], None]
# Asked before each step: the step's AttnLayerHook, or None (the step runs as if there were none).
StepLayerHook = Callable[[SchedulerOutput], AttnLayerHook | None]


class CausalLM(Protocol):
    def forward(
        self, batch: ForwardBatch, caches: ModelCaches, on_attn_layer: AttnLayerHook | None = None
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None: ...


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled tokens of one step, keyed by the requests that reached the end of their tokens,
    and the log-probabilities of those that asked for them."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LaunchedStep:
    """A step queued on the device whose sampled ids have not been read back yet.

    ``sampled`` are the requests of the sampled rows, in row order; ``tokens`` their ids
    ``[len(sampled)]`` int64 on the device and ``host_tokens`` the same ids on the host (both None
    when the step samples nothing). On CUDA ``host_tokens`` is a pinned copy queued right after
    the sampling (for an all-greedy graph step, by the graph runner on its own stream:
    ``CudaGraphRunner.host_ids``), and ``copied`` is recorded behind that copy: reading them waits for this step
    only. (A plain ``tokens.tolist()`` would queue its copy behind everything launched since, i.e.
    behind the next step that async scheduling has queued, and wait for that step too.) On CPU
    ``host_tokens`` is ``tokens``. ``logprobs``: the sampled rows' log-probabilities, on their
    way to the host like the ids (None when no request asked).

    ``logits``: set on a step whose sampling is not queued yet (it waits for the tokens of the
    step before; ``tokens`` is then None and ``ModelRunner.sample_queued`` returns the sampled
    step). NOTE: logits from a CUDA graph are valid only until the next replay of any graph, so
    the engine queues the sampling before it launches another forward.
    """

    sched: SchedulerOutput
    sampled: tuple[Request, ...]
    tokens: torch.Tensor | None
    host_tokens: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    logprobs: StepLogprobs | None = None
    logits: torch.Tensor | None = None

    @property
    def awaits_sampling(self) -> bool:
        return self.logits is not None


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        caches: ModelCaches,
        page_size: int,
        model_config: ModelConfig,
        tp: TPGroup,
        attn: FlashInferAttention | None = None,
        plan_sink: PlanSink | None = None,
    ) -> None:
        device = tp.device
        self.model_config = model_config
        self.tp = tp
        self.model = model
        self.caches = caches
        self.page_size = page_size
        self.device = device
        self.attn = attn
        self.graphs: CudaGraphRunner | None = None
        self.prefill_graphs: PrefillGraphRunner | None = None
        # Each request's page ids as an array, grown step by step (``engine.cache.page_lists``).
        self.page_mirror = PageListMirror()
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(0)
        self.plan_sink = plan_sink
        # Copies made since the last plan; the workers replay them before the next forward.
        self._pending_copies: list[tuple[int, int]] = []
        # Set by a disaggregated prefill while its request runs (runtime.pd.prefill); a step with
        # a layer hook runs eagerly (no CUDA graph), every other step pays one None check.
        self.layer_hook: StepLayerHook | None = None
        # Set by speculative decoding (``engine.speculative``): sees every forward's final hidden
        # states ``[T, H]`` (eager, or a decode graph's real rows), to run the MTP layer over them.
        self.hidden_hook: Callable[[StepInputs, torch.Tensor], None] | None = None
        # Resumed states are copied in on this stream (``write_state_async``), beside the steps.
        self._state_stream: torch.cuda.Stream | None = None

    def enable_cuda_graphs(
        self, max_batch_size: int, pad_page: int, pad_slot: int, show_progress: bool | None = None,
        prefill_tokens: int = 0,
    ) -> None:  # fmt: skip
        """Capture the decode graphs and, with ``prefill_tokens`` (TP=1 only), the piecewise graphs
        of other steps up to that many tokens (``engine.prefill_graph``)."""
        assert self.attn is not None, "CUDA graphs need the FlashInfer attention backend"
        self.graphs = CudaGraphRunner(
            self.model, self.caches, self.attn, max_batch_size, pad_page, pad_slot, self.page_mirror  # type: ignore[arg-type]
        )
        self.graphs.capture(show_progress)
        if prefill_tokens > 0:
            assert self.tp.size == 1, "prefill graphs run at TP=1"
            self.prefill_graphs = PrefillGraphRunner(
                self.model, self.caches, prefill_tokens, pad_page * self.page_size, pad_slot  # type: ignore[arg-type]
            )
            self.prefill_graphs.capture(show_progress)

    def read_state(self, pages: list[int], slot: int) -> StateTensors:
        """The whole (TP=1 layout) KV of ``pages`` and GDN state of ``slot``, on rank 0's device."""
        self.send_plan(None, move=StateMove("export", tuple(pages), slot))
        state = gather_state(self.tp, self.model_config, self.caches, pages, slot)
        assert state is not None, "read_state runs on rank 0"
        return state

    def write_state(self, pages: list[int], slot: int, state: StateTensors) -> None:
        """Write a whole (TP=1 layout) state into ``pages`` and ``slot`` of every rank."""
        self.send_plan(None, move=StateMove("import", tuple(pages), slot))
        scatter_state(self.tp, self.model_config, self.caches, pages, slot, state)

    def write_state_async(self, pages: list[int], slot: int | None, state: StateTensors) -> CopyFence | None:
        """TP=1: write a whole state into ``pages`` and ``slot`` (None: the KV only) without
        waiting for the queued steps: on CUDA on a side stream, after the work queued so far (it may
        reuse memory those steps free), with a fence for ``engine.cache.import_fences``; on CPU at
        once (None). A state in pageable host memory (the pinned arena was full when it was
        copied out) is copied as it is: the call then blocks the engine thread until the side
        stream has taken it, where pinning it here would cost ~20x the copy, stall every CUDA call
        of the process meanwhile, and keep the block in torch's caching host allocator for good."""
        assert self.tp.size == 1, "state writes under tensor parallelism go through write_state"
        if self.device.type != "cuda":
            write_local(self.caches, pages, slot, state)
            return None
        if self._state_stream is None:
            self._state_stream = torch.cuda.Stream(self.device)
        stream = self._state_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            write_local(self.caches, pages, slot, state)
        return StreamFence(stream, tuple(state))

    def state_shapes(self, num_pages: int) -> tuple[tuple[int, ...], ...]:
        """The shapes ``read_state`` returns and ``write_state`` takes for ``num_pages`` pages."""
        return state_shapes(self.model_config, self.page_size, num_pages)

    def send_plan(self, inputs: StepInputs | None, **parts: Any) -> None:
        """Under tensor parallelism, hand the workers the page copies made since the last plan, then
        ``inputs``' forward (or ``StepPlan``'s other ``parts``); nothing to do at TP=1."""
        if self.plan_sink is not None:
            self.plan_sink(StepPlan(tuple(self._pending_copies), inputs, **parts))
            self._pending_copies.clear()

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one KV page across every full-attention layer (the copy-on-write of a partial page)."""
        self.caches.kv[:, dst].copy_(self.caches.kv[:, src])
        if self.plan_sink is not None:
            self._pending_copies.append((src, dst))

    def prepare_inputs(self, out: SchedulerOutput) -> StepInputs:
        ps = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        read: list[int] = []
        write: list[int] = []
        has_state: list[bool] = []
        pages: list[list[int]] = []
        sample_rows: list[int] = []
        for i, (req, n) in enumerate(zip(out.requests, out.num_new_tokens)):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            assert end <= len(req.page_ids) * ps, f"request {req.request_id} lacks pages for {end} tokens"
            assert req.write_slot is not None, f"request {req.request_id} scheduled without a state slot"
            ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(req.page_ids[p // ps] * ps + p % ps for p in range(start, end))
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            write.append(req.write_slot)
            read.append(req.read_slot if req.has_state and req.read_slot is not None else req.write_slot)
            has_state.append(req.has_state)
            pages.append(req.page_ids)
            if end == req.num_tokens and not req.finalizing and (not req.prefill_only or req.sample_first):
                sample_rows.append(i)
        return StepInputs(
            ids, positions, slots, qsl, seq_lens, read, write, has_state, tuple(out.num_new_tokens), pages, sample_rows
        )

    def build_batch(self, inp: StepInputs) -> ForwardBatch:
        dev = self.device

        def to_dev(values: list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype), dev)

        plan = None
        if self.attn is not None:
            plan = self.attn.plan(inp.query_lens, inp.seq_lens, self.page_mirror.arrays(inp.page_ids))
            # FlashInfer reads its plan's page lists; only the torch reference reads the table (at a
            # long context its rows are thousands of pages: milliseconds of host time a step).
            table = torch.zeros((len(inp.page_ids), 1), dtype=torch.int32)
        else:
            table = torch.zeros((len(inp.page_ids), max(len(p) for p in inp.page_ids)), dtype=torch.int32)
            for i, p in enumerate(inp.page_ids):
                table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
        return ForwardBatch(
            input_ids=to_dev(inp.input_ids, torch.int64),
            positions=to_dev(inp.positions, torch.int64),
            query_start_loc=to_dev(inp.query_start_loc, torch.int64),
            seq_lens=to_dev(inp.seq_lens, torch.int32),
            page_table=to_device(table, dev),
            slot_mapping=to_dev(inp.slot_mapping, torch.int64),
            read_slots=to_dev(inp.read_slots, torch.int64),
            write_slots=to_dev(inp.write_slots, torch.int64),
            has_initial_state=to_dev(inp.has_state, torch.bool),
            logits_indices=to_dev([inp.query_start_loc[i + 1] - 1 for i in inp.sample_rows], torch.int64),
            query_lens_cpu=inp.query_lens,
            is_decode=inp.is_decode,
            attn_metadata=plan,
        )

    def forward_logits(
        self, inp: StepInputs, on_attn_layer: AttnLayerHook | None = None, input_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Logits ``[len(sample_rows), V]`` of the step (None when nothing is sampled): fp32, or in
        the model's dtype from a CUDA graph.

        ``input_ids`` (on the device) replace ``inp.input_ids`` (a step queued behind the one
        that samples its ids; ``inp.input_ids`` then holds placeholders).
        """
        return self._forward(inp, on_attn_layer, input_ids)[0]

    @torch.inference_mode()
    def _forward(
        self, inp: StepInputs, on_attn_layer: AttnLayerHook | None, input_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``forward_logits``'s logits and, from a CUDA graph, the sampled rows' greedy ids."""
        graphs = self.graphs
        hooked = on_attn_layer is not None
        if graphs is not None and inp.is_decode and not hooked and len(inp.query_lens) <= graphs.max_batch_size():
            out = graphs.run(inp, input_ids)
            if self.hidden_hook is not None:
                # Before the next replay of any graph overwrites the graph's hidden states.
                self.hidden_hook(inp, graphs.last_hidden())
            if out is None or not inp.sample_rows:
                return None, None
            logits, greedy = out
            return _rows(logits, inp.sample_rows), _rows(greedy, inp.sample_rows)
        batch = self.build_batch(inp)
        if input_ids is not None:
            batch = replace(batch, input_ids=input_ids)
        # Models without a layer loop (test doubles) need not take the hook: passed only when set.
        if hooked:
            hidden = self.model.forward(batch, self.caches, on_attn_layer)
        elif self.prefill_graphs is not None and not inp.is_decode and self.prefill_graphs.covers(batch):
            hidden = self.prefill_graphs.run(batch)
        else:
            hidden = self.model.forward(batch, self.caches)
        # None on a worker rank (the LM head gathers the logits to rank 0), or with nothing to sample.
        logits = self.model.compute_logits(hidden[batch.logits_indices]) if inp.sample_rows else None
        # After the LM head: a tensor-parallel worker joins the hook's MTP step after the step's forward.
        if self.hidden_hook is not None:
            self.hidden_hook(inp, hidden)
        return logits, None

    def launch(
        self, out: SchedulerOutput, inp: StepInputs | None = None, input_ids: torch.Tensor | None = None
    ) -> LaunchedStep:
        """Queue the step's forward and sampling on the device; nothing is read back.

        ``inp`` defaults to ``prepare_inputs(out)``; ``input_ids`` as in ``forward_logits`` (under
        tensor parallelism the plan says so and every rank receives them by broadcast). A step
        with ``input_ids`` is queued before the step that samples them is read, so when one of
        its sampled requests reads the last token (``SamplingParams.reads_last_token``) only its
        forward is queued: ``sample_queued`` queues the sampling once those tokens are applied.
        """
        inp = inp if inp is not None else self.prepare_inputs(out)
        self.send_plan(inp, device_ids=input_ids is not None)
        if self.plan_sink is not None and input_ids is not None:
            self.tp.broadcast_first(input_ids)
        on_attn_layer = self.layer_hook(out) if self.layer_hook is not None else None
        logits, greedy = self._forward(inp, on_attn_layer, input_ids)
        if logits is None:
            return LaunchedStep(out, (), None)
        reqs = tuple(out.requests[i] for i in inp.sample_rows)
        if input_ids is not None and any(r.params.reads_last_token for r in reqs):
            return LaunchedStep(out, reqs, None, logits=logits)
        return self._sample(out, reqs, logits, greedy)

    def sample_queued(self, step: LaunchedStep) -> LaunchedStep:
        """Queue the sampling of a step whose ``launch`` left it out (its forward is queued or
        running) and return the sampled step; any other step is returned as it is.

        Call it once the tokens of the step before are applied to the requests (grammar matchers
        advanced, outputs appended): the masks and penalties are then those a synchronous step
        would have built, so the tokens are the same. Rows of requests that finished meanwhile
        are sampled without their grammar and dropped by the engine.
        """
        if step.logits is None:
            return step
        return self._sample(step.sched, step.sampled, step.logits, None)

    def _sample(
        self, out: SchedulerOutput, reqs: tuple[Request, ...], logits: torch.Tensor, greedy: torch.Tensor | None
    ) -> LaunchedStep:
        """Queue the processing and sampling of ``logits`` (one row per request of ``reqs``) and the
        copy of the sampled ids to the host."""
        generators = [r.generator or self.default_generator for r in reqs]
        # Built after the forward is queued: grammar masks are filled on the host meanwhile.
        mc = self.model_config
        processing = StepProcessing.build(reqs, mc.vocab_size, mc.eos_token_ids, self.device)
        tokens = sample(logits, [r.params for r in reqs], generators, greedy, processing)
        logprobs = processing.logprobs(logits, tokens) if processing is not None else None
        if not tokens.is_cuda:
            return LaunchedStep(out, reqs, tokens, tokens, logprobs=logprobs)
        # An all-greedy graph step's ids are already on their way to the host, off the compute stream.
        from_graph = self.graphs.host_ids(tokens) if self.graphs is not None else None
        if from_graph is not None:
            return LaunchedStep(out, reqs, tokens, *from_graph)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return LaunchedStep(out, reqs, tokens, host, copied, logprobs.to_host() if logprobs is not None else None)

    @staticmethod
    def collect(step: LaunchedStep) -> StepResult:
        """Read a launched step's sampled ids (waits for the device to finish that step only).

        A step whose sampling was never queued (the engine step that launched it failed before
        ``sample_queued``) reads as having sampled nothing."""
        if step.host_tokens is None:
            return StepResult({})
        if step.copied is not None:
            step.copied.synchronize()
        ids = step.host_tokens.tolist()
        logprobs = step.logprobs.read(ids) if step.logprobs is not None else {}
        return StepResult(
            {r.request_id: t for r, t in zip(step.sampled, ids)},
            {step.sampled[row].request_id: lp for row, lp in logprobs.items()},
        )

    def run_plan(self, plan: StepPlan) -> None:
        """A worker rank's step: replay rank 0's page copies, then join the forward."""
        for src, dst in plan.page_copies:
            self.copy_page(src, dst)
        if plan.inputs is not None:
            ids = None
            if plan.device_ids:
                ids = torch.empty(len(plan.inputs.input_ids), dtype=torch.int64, device=self.device)
                self.tp.broadcast_first(ids)
            # No sync at the end: like rank 0, a worker queues its steps and moves on (the pinned
            # staging buffers are guarded by events: ``CudaGraphRunner._fill``, FlashInfer's plan).
            self.forward_logits(plan.inputs, input_ids=ids)
        move = plan.move
        if move is not None and move.kind == "export":
            gather_state(self.tp, self.model_config, self.caches, move.pages, move.slot)
        elif move is not None:
            scatter_state(self.tp, self.model_config, self.caches, move.pages, move.slot, None)


def _rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``values[rows]``; no gather when ``rows`` is every row (a decode step samples them all)."""
    return values if len(rows) == values.shape[0] else values[to_device(torch.tensor(rows), values.device)]


def _attention_backend(
    mc: ModelConfig, cc: CacheConfig, rc: RunnerConfig, tp: TPGroup, dtype: torch.dtype, device: torch.device,
    kernels: KernelConfig,
) -> FlashInferAttention | None:
    """FlashInfer on CUDA (when importable, not turned off, and the dtype fp16 / bf16), else None:
    the torch reference (and no CUDA graphs: they capture FlashInfer's decode)."""
    if device.type != "cuda" or rc.attention_backend == "torch":
        return None
    asked = rc.attention_backend == "flashinfer"
    if not flashinfer_available():
        if asked:
            raise ValueError("attention_backend: 'flashinfer' was asked for but flashinfer does not import")
        return None
    if dtype not in (torch.float16, torch.bfloat16):
        # FlashInfer's JIT has no fp32 kernels (0.6: a KeyError deep in its module naming).
        if asked:
            raise ValueError(f"attention_backend: 'flashinfer' serves float16 / bfloat16 models, got {dtype}")
        return None
    num_heads, num_kv_heads = mc.num_attention_heads // tp.size, max(1, mc.num_key_value_heads // tp.size)
    return FlashInferAttention(num_heads, num_kv_heads, mc.head_dim, cc.page_size, dtype, device, kernels,
                               kv_dtype(cc, dtype))


def build_runner(
    mc: ModelConfig,
    model: CausalLM,
    cc: CacheConfig,
    rc: RunnerConfig,
    tp: TPGroup,
    dtype: torch.dtype,
    plan_sink: PlanSink | None = None,
    kernels: KernelConfig = KernelConfig(),
    extra_kv_layers: int = 0,
) -> tuple[ModelRunner, PoolPlan]:
    """Size the pools, allocate this rank's caches (on ``tp.device``) and wrap ``model`` in a runner
    (``kernels``: the attention backend's decode kernel and launch, ``FlashInferAttention``).

    Every rank of a group calls this together: free memory differs between GPUs, so the ranks
    agree on the smallest pool sizes (the pools must be identical in structure everywhere).
    """
    device = tp.device
    plan = plan_pools(mc, cc, dtype, device, tp.size, extra_kv_layers)
    if tp.size > 1:
        num_pages, num_slots = tp.all_min([plan.num_pages, plan.num_slots])
        plan = replace(plan, num_pages=num_pages, num_slots=num_slots)
    caches = allocate_caches(mc, plan, cc.page_size, dtype, device, tp.size, extra_kv_layers, kv_dtype(cc, dtype))
    attn = _attention_backend(mc, cc, rc, tp, dtype, device, kernels)
    return ModelRunner(model, caches, cc.page_size, mc, tp, attn, plan_sink), plan

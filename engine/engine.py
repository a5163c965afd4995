"""The offline engine: one process's inference core behind a small, stable API.

    engine = Engine.from_pretrained(path, load_format="dummy", device="cuda", dtype="bfloat16")
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))

A step reads as five calls: schedule → prepare → forward → sample → update. Requests are
validated when they are added, so a bad request raises at once and never reaches the loop; the
engine keeps serving the others.

Tensor parallelism (``tensor_parallel_size=N``): this process is rank 0 and the only one that
schedules, keeps the radix cache and samples; ``engine.tp_workers`` runs ranks 1..N-1 in child
processes, and each step the runner sends them a compact step plan before the shared forward.
``close()`` (or ``with Engine.from_pretrained(...) as engine``) stops them. CUDA graphs are off
under TP until captured collectives are validated on GPUs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType

import torch

from phloem.engine.cache_manager import CacheManager, CacheStats
from phloem.engine.config import (
    CacheConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from phloem.engine.errors import CapacityExceeded, InvalidRequest
from phloem.engine.kv_pages import PagePool
from phloem.engine.loader import load_model
from phloem.engine.model_runner import CausalLM, build_runner
from phloem.engine.parallel import TPGroup, check_tp_size
from phloem.engine.prefix_state import PrefixState, export_prefix, import_prefix
from phloem.engine.radix_cache import RadixCache, RadixNode
from phloem.engine.request import FinishReason, Request, RequestOutput, RequestStatus
from phloem.engine.sampling_params import SamplingParams
from phloem.engine.scheduler import Scheduler
from phloem.engine.state_slots import SlotPool
from phloem.engine.tp_workers import TPWorkers, WorkerSpec, rank_device

__all__ = ["Engine"]

_CACHE_OPTIONS = {
    "page_size",
    "memory_fraction",
    "state_fraction",
    "num_pages",
    "num_state_slots",
    "cpu_pool_bytes",
    "enable_prefix_caching",
    "checkpoint_interval",
}
_SCHED_OPTIONS = {"max_num_batched_tokens", "max_num_seqs", "max_model_len"}
_RUNNER_OPTIONS = {"attention_backend", "enable_cuda_graph", "max_graph_batch_size"}
_LOAD_OPTIONS = {"load_format", "device", "dtype", "seed"}
_PARALLEL_OPTIONS = {"tensor_parallel_size"}


class Engine:
    def __init__(
        self,
        model_config: ModelConfig,
        model: CausalLM,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        dtype: torch.dtype,
        runner_config: RunnerConfig | None = None,
        workers: TPWorkers | None = None,
    ) -> None:
        runner_config = runner_config or RunnerConfig()
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.workers = workers
        tp = workers.group if workers is not None else TPGroup.single(device)
        sink = workers.send if workers is not None else None
        self.runner, plan = build_runner(model_config, model, cache_config, runner_config, tp, dtype, sink)
        self.page_pool = PagePool(plan.num_pages, cache_config.page_size)
        self.slot_pool = SlotPool(plan.num_slots)
        tree = None
        if cache_config.enable_prefix_caching:
            tree = RadixCache(
                cache_config.page_size, self.page_pool.free, self.slot_pool.free, plan.page_bytes, plan.slot_bytes
            )
        self.cache = CacheManager(
            self.page_pool, self.slot_pool, self.runner.copy_page, tree, cache_config.checkpoint_interval
        )
        self.scheduler = Scheduler(scheduler_config, self.cache, finalize=tree is not None)
        if runner_config.enable_cuda_graph and self.runner.attn is not None and tp.size == 1:
            # One page and one slot absorb the writes of a graph bucket's padding rows.
            pad_page, pad_slot = self.page_pool.allocate(1), self.slot_pool.allocate()
            assert pad_page is not None and pad_slot is not None, "pools too small for CUDA-graph padding"
            size = min(runner_config.max_graph_batch_size, scheduler_config.max_num_seqs)
            self.runner.enable_cuda_graphs(size, pad_page[0], pad_slot)
        limit = model_config.max_position_embeddings
        self.max_model_len = min(scheduler_config.max_model_len or limit, limit)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(cls, path: str | Path, **options: object) -> Engine:
        """Load a Hugging Face model folder.

        Options: ``load_format`` ("safetensors" | "dummy"), ``device``, ``dtype``, ``seed``,
        ``page_size``, ``memory_fraction``, ``state_fraction``, ``num_pages``, ``num_state_slots``,
        ``cpu_pool_bytes``, ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len``,
        ``attention_backend``, ``enable_cuda_graph``, ``max_graph_batch_size``,
        ``tensor_parallel_size`` (N > 1 starts N - 1 worker processes; ``close()`` stops them).
        An unknown option is an error (never silently dropped).

        Raises:
            ValueError: a bad option, model folder or checkpoint; a tensor-parallel size that does
                not divide the heads, exceeds 8, or exceeds the visible GPUs.
            EngineError: a tensor-parallel worker failed to start.
        """
        known = _CACHE_OPTIONS | _SCHED_OPTIONS | _LOAD_OPTIONS | _RUNNER_OPTIONS | _PARALLEL_OPTIONS
        unknown = set(options) - known
        if unknown:
            raise TypeError(f"Engine.from_pretrained: unknown option(s) {sorted(unknown)}")
        pick = lambda names: {k: v for k, v in options.items() if k in names}  # noqa: E731
        load_config = LoadConfig(**pick(_LOAD_OPTIONS))  # type: ignore[arg-type]
        parallel = ParallelConfig(**pick(_PARALLEL_OPTIONS))  # type: ignore[arg-type]
        cache_config = CacheConfig(**pick(_CACHE_OPTIONS))  # type: ignore[arg-type]
        scheduler_config = SchedulerConfig(**pick(_SCHED_OPTIONS))  # type: ignore[arg-type]
        runner_config = RunnerConfig(**pick(_RUNNER_OPTIONS))  # type: ignore[arg-type]
        model_config = ModelConfig.from_pretrained(path)
        tp_size = parallel.tensor_parallel_size
        check_tp_size(model_config, tp_size, torch.device(load_config.device))
        workers = None
        if tp_size > 1:
            device = rank_device(torch.device(load_config.device), 0)
            load_config = replace(load_config, device=str(device))
            spec = WorkerSpec(
                str(path), model_config, load_config, cache_config, runner_config, tp_size, torch.get_num_threads()
            )
            workers = TPWorkers.launch(spec)
        try:
            model = load_model(Path(path), model_config, load_config, workers.group if workers else None)
            if workers is not None:
                workers.wait_ready()
            dtype = next(model.parameters()).dtype
            device = torch.device(load_config.device)
            return cls(model_config, model, cache_config, scheduler_config, device, dtype, runner_config, workers)
        except BaseException:
            if workers is not None:
                workers.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (idempotent; nothing to do at TP=1).

        A closed tensor-parallel engine can still be inspected but no longer steps.
        """
        if self.workers is not None:
            self.workers.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> str:
        """Validate and enqueue a request; returns its id.

        With ``prefill_only`` the prompt is computed and a checkpoint published at its end, and
        nothing is sampled: the request finishes with reason ``"prefill"`` and no tokens.

        Raises:
            InvalidRequest: empty prompt, token id outside the vocabulary, prompt at or over the
                context limit, or a duplicate request id.
            CapacityExceeded: the prompt cannot fit the KV pool even when it is empty.
        """
        prompt = self._validate(prompt_token_ids, params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._requests:
            raise InvalidRequest(f"request_id: {rid!r} is already in flight")
        req = Request(rid, prompt, params, arrival_idx=next(self._ids), prefill_only=prefill_only)
        if params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(params.seed)
        self._requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(f"params: expected SamplingParams, got {type(params).__name__}")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise InvalidRequest("prompt_token_ids: expected at least one token, got an empty prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt_token_ids: expected integers in [0, {vocab}), got {bad[:5]!r}")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt_token_ids: the prompt has {len(prompt)} tokens; the context limit is "
                f"{self.max_model_len} including at least one generated token"
            )
        if self.page_pool.pages_for(len(prompt) + 1) > self.page_pool.num_pages:
            raise CapacityExceeded(
                f"prompt_token_ids: {len(prompt)} tokens need more than the {self.page_pool.num_pages} KV pages "
                "of this engine"
            )
        return prompt

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its memory; returns False if it is unknown or already done."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return False
        self._requests.pop(request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that changed."""
        sched = self.scheduler.schedule()
        outputs = [self._output(r, []) for r in sched.finished_early]
        if sched.is_empty:
            return outputs
        result = self.runner.execute(sched)
        for req, n in zip(sched.requests, sched.num_new_tokens):
            req.num_computed_tokens += n
            req.has_state = True
            req.read_slot = req.write_slot
            if req.finalizing:
                self.scheduler.complete_finalize(req)
                continue
            if req.prefill_only and req.num_computed_tokens == req.num_tokens:
                # The prompt is computed: publishing on release puts the checkpoint at its end.
                self.scheduler.finish_now(req, FinishReason.PREFILL)
                outputs.append(self._output(req, []))
                continue
            self.cache.maybe_checkpoint(req)
            token = result.sampled.get(req.request_id)
            if token is None:
                continue
            req.append_output(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.scheduler.finish(req, reason)
            outputs.append(self._output(req, [token]))
        return outputs

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.model_config.eos_token_ids):
            return FinishReason.STOP
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _output(self, req: Request, new_tokens: list[int]) -> RequestOutput:
        finished = req.status is RequestStatus.FINISHED
        if finished:
            self._requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            new_token_ids=new_tokens,
            finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_cached_tokens=req.num_cached_tokens,
        )

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        params: SamplingParams | list[SamplingParams],
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order.

        Every prompt is validated before any is enqueued, so a bad one raises and runs nothing.
        """
        plist = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        if len(plist) != len(prompt_token_ids):
            raise InvalidRequest(f"params: expected {len(prompt_token_ids)} SamplingParams, got {len(plist)}")
        for prompt, p in zip(prompt_token_ids, plist):
            self._validate(prompt, p)
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompt_token_ids, plist)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        # Let turn-end checkpoints land, so a follow-up call hits the whole conversation.
        while self.scheduler.num_finalizing():
            self.step()
        return [final[i] for i in ids]

    def pin_prefix(self, token_ids: Sequence[int]) -> RadixNode | None:
        """Pin the deepest cached checkpoint within ``token_ids`` (a session's head) against eviction.

        Returns an opaque handle for ``unpin_prefix``, or None when nothing of it is cached.
        """
        tree = self.cache.tree
        if tree is None:
            return None
        match = tree.match(list(token_ids), len(token_ids))
        if match is None:
            return None
        tree.lock(match.node)
        return match.node

    def unpin_prefix(self, handle: RadixNode) -> None:
        assert self.cache.tree is not None, "unpin without a prefix cache"
        self.cache.tree.unlock(handle)

    def cached_prefix_len(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` a new request would take from the cache."""
        tree = self.cache.tree
        match = tree.match(list(token_ids), len(token_ids) - 1) if tree is not None and token_ids else None
        return match.num_tokens if match else 0

    def export_prefix(self, token_ids: Sequence[int]) -> PrefixState | None:
        """Host copies of the KV pages and head checkpoint of the deepest cached prefix of
        ``token_ids`` (for spilling a session); None when nothing of it is cached, and always under
        tensor parallelism (rank 0 holds only its shard of the caches; TP spill is not built yet)."""
        if self.workers is not None:
            return None
        return export_prefix(self.cache, self.runner.caches, list(token_ids))

    def import_prefix(self, state: PrefixState) -> bool:
        """Load a spilled prefix into fresh pages and a fresh slot and publish it in the radix
        cache; False (taking nothing) when no room can be made, and always under tensor parallelism."""
        if self.workers is not None:
            return False
        return import_prefix(self.cache, self.runner.caches, state)

    def cache_stats(self) -> CacheStats:
        """Prefix-cache and pool counters (prompt vs cached tokens, checkpoints, pages in use)."""
        return self.cache.stats()

"""Turns a scheduled step into tensors, runs the model, and samples.

``prepare_inputs`` gathers the step on the host (plain lists); the eager path turns them into a
``ForwardBatch`` (planning FlashInfer when it is the attention backend), the CUDA-graph path copies
them into the captured graph's static buffers. Only rows that need a next token are projected to
logits and sampled. The only device-to-host transfer of a step is the sampled ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from phloem.engine.cuda_graph import CudaGraphRunner
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.request import Request
from phloem.engine.sampler import sample
from phloem.engine.scheduler import SchedulerOutput
from phloem.kernels.flashinfer_attention import FlashInferAttention

__all__ = ["CausalLM", "ModelRunner", "StepInputs", "StepResult"]


class CausalLM(Protocol):
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled tokens of one step, keyed by the requests that reached the end of their tokens."""

    sampled: dict[str, int]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One step gathered on the host; ``sample_rows`` index requests (and logits rows) to sample."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    read_slots: list[int]
    write_slots: list[int]
    has_state: list[bool]
    query_lens: tuple[int, ...]
    page_ids: list[list[int]]
    sample_rows: list[int]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens) and all(self.has_state)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        caches: ModelCaches,
        page_size: int,
        device: torch.device,
        attn: FlashInferAttention | None = None,
    ) -> None:
        self.model = model
        self.caches = caches
        self.page_size = page_size
        self.device = device
        self.attn = attn
        self.graphs: CudaGraphRunner | None = None
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(0)

    def enable_cuda_graphs(self, max_batch_size: int, pad_page: int, pad_slot: int) -> None:
        assert self.attn is not None, "CUDA graphs need the FlashInfer attention backend"
        self.graphs = CudaGraphRunner(self.model, self.caches, self.attn, max_batch_size, pad_page, pad_slot)  # type: ignore[arg-type]
        self.graphs.capture()

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one KV page across every full-attention layer (the copy-on-write of a partial page)."""
        self.caches.kv[:, dst].copy_(self.caches.kv[:, src])

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
            if end == req.num_tokens and not req.finalizing:
                sample_rows.append(i)
        return StepInputs(
            ids, positions, slots, qsl, seq_lens, read, write, has_state, tuple(out.num_new_tokens), pages, sample_rows
        )

    def build_batch(self, inp: StepInputs) -> ForwardBatch:
        dev = self.device

        def to_dev(values: list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        max_pages = max(len(p) for p in inp.page_ids)
        table = torch.zeros((len(inp.page_ids), max_pages), dtype=torch.int32)
        for i, p in enumerate(inp.page_ids):
            table[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
        plan = self.attn.plan(inp.query_lens, inp.seq_lens, inp.page_ids) if self.attn is not None else None
        return ForwardBatch(
            input_ids=to_dev(inp.input_ids, torch.int64),
            positions=to_dev(inp.positions, torch.int64),
            query_start_loc=to_dev(inp.query_start_loc, torch.int32),
            seq_lens=to_dev(inp.seq_lens, torch.int32),
            page_table=table.to(dev, non_blocking=True),
            slot_mapping=to_dev(inp.slot_mapping, torch.int64),
            read_slots=to_dev(inp.read_slots, torch.int64),
            write_slots=to_dev(inp.write_slots, torch.int64),
            has_initial_state=to_dev(inp.has_state, torch.bool),
            logits_indices=to_dev([inp.query_start_loc[i + 1] - 1 for i in inp.sample_rows], torch.int64),
            query_lens_cpu=inp.query_lens,
            is_decode=inp.is_decode,
            attn_metadata=plan,
        )

    @torch.inference_mode()
    def forward_logits(self, inp: StepInputs) -> torch.Tensor | None:
        """Logits ``[len(sample_rows), V]`` of the step (None when nothing is sampled)."""
        graphs = self.graphs
        if graphs is not None and inp.is_decode and len(inp.query_lens) <= graphs.max_batch_size():
            logits = graphs.run(
                inp.input_ids, inp.positions, inp.slot_mapping, inp.seq_lens, inp.read_slots, inp.write_slots, inp.page_ids
            )
            return logits[inp.sample_rows] if inp.sample_rows else None
        batch = self.build_batch(inp)
        hidden = self.model.forward(batch, self.caches)
        if not inp.sample_rows:
            return None
        return self.model.compute_logits(hidden[batch.logits_indices])

    def execute(self, out: SchedulerOutput) -> StepResult:
        inp = self.prepare_inputs(out)
        logits = self.forward_logits(inp)
        if logits is None:
            return StepResult({})
        reqs: list[Request] = [out.requests[i] for i in inp.sample_rows]
        tokens = sample(logits.float(), [r.params for r in reqs], [r.generator or self.default_generator for r in reqs])
        return StepResult({r.request_id: t for r, t in zip(reqs, tokens.tolist())})

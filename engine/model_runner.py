"""Turns a scheduled step into tensors, runs the model, and samples.

``prepare`` builds the step's ``ForwardBatch`` on the host and moves it to the device in one
go; ``execute`` runs the forward, projects only the rows that need a next token to logits, and
samples them. The only device-to-host transfer of a step is the sampled ids.
"""

from __future__ import annotations

from typing import Protocol

import torch

from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.request import Request
from phloem.engine.sampler import sample
from phloem.engine.scheduler import SchedulerOutput

__all__ = ["CausalLM", "ModelRunner", "StepResult"]


class CausalLM(Protocol):
    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class StepResult:
    """Sampled tokens of one step, keyed by the requests that reached the end of their tokens."""

    __slots__ = ("sampled",)

    def __init__(self, sampled: dict[str, int]) -> None:
        self.sampled = sampled


class ModelRunner:
    def __init__(self, model: CausalLM, caches: ModelCaches, page_size: int, device: torch.device) -> None:
        self.model = model
        self.caches = caches
        self.page_size = page_size
        self.device = device
        self.default_generator = torch.Generator(device=device)
        self.default_generator.manual_seed(0)

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one KV page across every full-attention layer (the copy-on-write of a partial page)."""
        self.caches.kv[:, dst].copy_(self.caches.kv[:, src])

    def prepare(self, out: SchedulerOutput) -> ForwardBatch:
        ps = self.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        read_slots: list[int] = []
        write_slots: list[int] = []
        has_state: list[bool] = []
        max_pages = max(len(r.page_ids) for r in out.requests)
        page_table = torch.zeros((len(out.requests), max_pages), dtype=torch.int32)
        for i, (req, n) in enumerate(zip(out.requests, out.num_new_tokens)):
            start = req.num_computed_tokens
            end = start + n
            assert end <= len(req.page_ids) * ps, f"request {req.request_id} lacks pages for {end} tokens"
            input_ids.extend(req.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(req.page_ids[p // ps] * ps + p % ps for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            if end == req.num_tokens and not req.finalizing:
                logits_indices.append(query_start_loc[-1] - 1)
            assert req.write_slot is not None, f"request {req.request_id} scheduled without a state slot"
            write_slots.append(req.write_slot)
            read_slots.append(req.read_slot if req.has_state and req.read_slot is not None else req.write_slot)
            has_state.append(req.has_state)
            page_table[i, : len(req.page_ids)] = torch.tensor(req.page_ids, dtype=torch.int32)
        dev = self.device

        def to_dev(values: list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        return ForwardBatch(
            input_ids=to_dev(input_ids, torch.int64),
            positions=to_dev(positions, torch.int64),
            query_start_loc=to_dev(query_start_loc, torch.int32),
            seq_lens=to_dev(seq_lens, torch.int32),
            page_table=page_table.to(dev, non_blocking=True),
            slot_mapping=to_dev(slot_mapping, torch.int64),
            read_slots=to_dev(read_slots, torch.int64),
            write_slots=to_dev(write_slots, torch.int64),
            has_initial_state=to_dev(has_state, torch.bool),
            logits_indices=to_dev(logits_indices, torch.int64),
            query_lens_cpu=tuple(out.num_new_tokens),
            is_decode=all(n == 1 for n in out.num_new_tokens) and all(has_state),
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        batch = self.prepare(out)
        hidden = self.model.forward(batch, self.caches)
        needs_sample = [
            req
            for req, n in zip(out.requests, out.num_new_tokens)
            if req.num_computed_tokens + n == req.num_tokens and not req.finalizing
        ]
        if not needs_sample:
            return StepResult({})
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        tokens = sample(
            logits.float(),
            [r.params for r in needs_sample],
            [r.generator or self.default_generator for r in needs_sample],
        )
        ids = tokens.tolist()
        return StepResult({r.request_id: t for r, t in zip(needs_sample, ids)})

"""The speculator's forwards and GDN-state copies, run alike on every tensor-parallel rank.

``engine.speculative`` drafts, verifies and rolls back through ``SpeculativeRanks``: MTP-layer
steps, trunk forwards, the LM head, and the snapshot / restore of GDN states. Under tensor
parallelism only rank 0 decides (which rows, which drafts, how many accepted); each call sends
the workers a ``StepPlan`` first (``engine.step_plan``: trunk forwards as plain plans without
sampled rows, the rest with a ``SpecOp``) and every rank then runs the same collectives in the
same order. A worker's ``follow`` runs such a plan. At TP=1 nothing is sent and the calls are the
plain model calls.

Why the workers hold no speculation state: the hidden rows an MTP step or the LM head reads
(the trunk's final-normed states, the MTP layer's own outputs) are broadcast from rank 0 with
each call (``[T, H]``, a few rows a step at decode), so the pending rows, drafts and accepted
lengths live on rank 0 alone and a worker's state can never drift from it. Each rank keeps only
the GDN-state snapshot of the step in flight (its shard of the states).

``seconds`` (None: not timed) splits rank 0's time by phase for ``phloem bench decode
--speculative``: ``draft`` (MTP steps and their LM head), ``verify`` (the snapshot, the trunk
forward, its LM head), ``rollback`` (the restore and the rerun). Timing synchronizes the device
around each call, so it is for benchmarks only.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from phloem.engine.model_runner import ModelRunner
from phloem.engine.models.mtp import mtp_forward
from phloem.engine.step_plan import SpecOp, StepInputs, StepPlan

__all__ = ["SpeculativeRanks"]


class SpeculativeRanks:
    """Rank 0's speculative calls (each sends its plan first) and a worker's ``follow``."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model = runner.model
        self.caches = runner.caches
        self.tp = runner.tp
        self.dtype = runner.caches.conv.dtype  # the model's activations' (KV pages may be fp8)
        self.hidden_size = runner.model_config.hidden_size
        # This rank's copy of the GDN states read by the step in flight: (conv, ssm) of each row.
        self._snapshot: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seconds: dict[str, float] | None = None
        self._phase = "draft"  # what a trunk forward or LM head belongs to: after a snapshot, verify

    @contextmanager
    def _timed(self, phase: str | None = None) -> Iterator[None]:
        self._phase = phase or self._phase
        if self.seconds is None:
            yield
            return
        sync = torch.cuda.synchronize if self.runner.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        yield
        sync()
        self.seconds[self._phase] = self.seconds.get(self._phase, 0.0) + time.perf_counter() - start

    def _shared(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[T, H]``, rank 0's on every rank (a worker passes an empty buffer)."""
        return self.tp.broadcast_first(hidden.contiguous()) if self.tp.size > 1 else hidden

    def mtp(self, inp: StepInputs, hidden: torch.Tensor) -> torch.Tensor:
        """One MTP step over ``inp`` (its ids: the tokens after ``hidden``'s rows) from ``hidden``
        ``[T, H]``; writes the MTP KV at ``inp.slot_mapping``. Returns ``h'`` ``[T, H]``."""
        with self._timed("draft"):
            self.runner.send_plan(inp, spec=SpecOp("mtp"))
            batch = self.runner.build_batch(inp)
            return mtp_forward(self.model, batch.input_ids, self._shared(hidden), batch, self.caches)  # type: ignore[arg-type]

    def trunk(self, inp: StepInputs) -> torch.Tensor:
        """The trunk's forward over ``inp`` (nothing sampled): its final hidden states ``[T, H]``."""
        assert not inp.sample_rows, "a speculative trunk forward samples nothing (rank 0 takes its logits)"
        with self._timed():
            self.runner.send_plan(inp)
            return self.model.forward(self.runner.build_batch(inp), self.caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` -> fp32 logits ``[T, V]`` (rank 0)."""
        with self._timed():
            self.runner.send_plan(None, spec=SpecOp("logits", (hidden.shape[0],)))
            logits = self.model.compute_logits(self._shared(hidden))
        assert logits is not None, "the LM head's logits are gathered on rank 0"
        return logits

    def snapshot(self, slots: list[int]) -> None:
        """Keep a copy of the GDN states of ``slots`` (one row each), on every rank."""
        with self._timed("verify"):
            self.runner.send_plan(None, spec=SpecOp("snapshot", tuple(slots)))
            self._take(slots)

    def restore(self, rows: list[int], slots: list[int]) -> None:
        """Write the snapshot's ``rows`` into the state ``slots``, on every rank."""
        with self._timed("rollback"):
            self.runner.send_plan(None, spec=SpecOp("restore", (*rows, *slots)))
            self._put(rows, slots)

    def _take(self, slots: list[int]) -> None:
        index = torch.tensor(slots, device=self.runner.device)
        self._snapshot = self.caches.conv[:, index].clone(), self.caches.ssm[:, index].clone()

    def _put(self, rows: list[int], slots: list[int]) -> None:
        assert self._snapshot is not None and len(rows) == len(slots), "restore without a matching snapshot"
        conv, ssm = self._snapshot
        dev = self.runner.device
        src, dst = torch.tensor(rows, device=dev), torch.tensor(slots, device=dev)
        self.caches.conv[:, dst] = conv[:, src]
        self.caches.ssm[:, dst] = ssm[:, src]

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """A worker rank's part of rank 0's call that sent ``plan`` (a ``SpecOp`` plan)."""
        for src, dst in plan.page_copies:
            self.runner.copy_page(src, dst)
        op = plan.spec
        assert op is not None, "follow runs SpecOp plans; the runner runs the others"
        if op.kind == "mtp":
            assert plan.inputs is not None
            batch = self.runner.build_batch(plan.inputs)
            hidden = self._empty(len(plan.inputs.input_ids))
            mtp_forward(self.model, batch.input_ids, self._shared(hidden), batch, self.caches)  # type: ignore[arg-type]
        elif op.kind == "logits":
            self.model.compute_logits(self._shared(self._empty(op.values[0])))
        elif op.kind == "snapshot":
            self._take(list(op.values))
        else:
            n = len(op.values) // 2
            self._put(list(op.values[:n]), list(op.values[n:]))

    def _empty(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.runner.device)

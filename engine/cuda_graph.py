"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches hundreds of small kernels (40 layers × norms, projections, GDN, MoE);
at batch 1 the launches, not the bytes, would bound it. Each bucket (1, 2, 4, 8, 16, 24, 32,
48, 64, ...) is captured once with static input buffers (token ids, positions, slot mapping,
sequence lengths, read/write slots, and the split-KV Triton decode attention's page lists); a
step writes its inputs into the first ``n`` rows of a pinned mirror of those buffers, pads the rest
of the bucket with a scratch page and a scratch state slot that no request owns, queues one copy
of it to the device (with FlashInfer's decode instead, it re-plans that fixed-buffer wrapper for
the bucket) and replays.

Everything inside the graph must be capturable: the Triton ops and FlashInfer, never the torch
references (their per-sequence loops read values back to the host). Under tensor parallelism
every rank captures the same buckets at the same time (the warm-up forwards run the collectives,
which pair across ranks) and the NCCL all-reduces and the logits gather are captured with the
step; a step replays the same bucket on every rank because they all get the same ``StepInputs``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phloem.engine._progress import progress
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.step_plan import StepInputs
from phloem.kernels.flashinfer_attention import MAX_GRAPH_PAGES, FlashInferAttention, fill_page_lists

__all__ = ["CudaGraphRunner", "graph_buckets"]


def graph_buckets(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    return [b for b in sizes if b < max_batch_size] + [max_batch_size]


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        caches: ModelCaches,
        attn: FlashInferAttention,
        max_batch_size: int,
        pad_page: int,
        pad_slot: int,
    ) -> None:
        self.model, self.caches, self.attn = model, caches, attn
        self.page_size = attn.page_size
        self.pad_page, self.pad_slot = pad_page, pad_slot
        self.buckets = graph_buckets(max_batch_size)
        n, dev = max_batch_size, attn.device
        # The static inputs and (with the Triton decode attention) the page lists live in one device
        # buffer, mirrored by two pinned host buffers used in turn, so a step's inputs reach the
        # device in one copy (ten small copies cost ~27 us of device time a step on an H200,
        # docs/benchmarks.md). A step writes one host buffer while the other's copy (the previous
        # step's) may still be in flight; an event per buffer says when its copy is done, so no
        # step waits on the whole stream (the only host sync of a step stays the read of its ids).
        self._layout = _StagingLayout(n, MAX_GRAPH_PAGES if attn.triton_decode else 0)
        self._dev = torch.zeros(self._layout.nbytes, dtype=torch.uint8, device=dev)
        self._host = [torch.zeros(self._layout.nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._host_views = [self._layout.views(h.numpy()) for h in self._host]
        rows, self.seq_lens, lists = self._layout.views(self._dev)
        self.input_ids, self.positions, self.slot_mapping, self.read_slots, self.write_slots = rows
        self.kv_lists: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = lists  # indptr, last, indices
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._last_replay = 0  # the bucket replayed last (0: none yet)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # None on tensor-parallel worker ranks (the captured LM head gathers logits to rank 0).
        self.logits: dict[int, torch.Tensor | None] = {}
        self.greedy: dict[int, torch.Tensor | None] = {}

    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def _batch(self, bs: int) -> ForwardBatch:
        dev = self.input_ids.device
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            query_start_loc=torch.arange(bs + 1, dtype=torch.int32, device=dev),
            seq_lens=self.seq_lens[:bs],
            # Only the torch reference reads the page table; FlashInfer has its own buffers.
            page_table=torch.zeros((bs, 1), dtype=torch.int32, device=dev),
            slot_mapping=self.slot_mapping[:bs],
            read_slots=self.read_slots[:bs],
            write_slots=self.write_slots[:bs],
            has_initial_state=torch.ones(bs, dtype=torch.bool, device=dev),
            logits_indices=torch.arange(bs, dtype=torch.int64, device=dev),
            query_lens_cpu=(1,) * bs,
            is_decode=True,
            attn_metadata=self._attn_plan(bs),
        )

    def _attn_plan(self, bs: int) -> Any:
        if self.kv_lists is not None:
            indptr, last, indices = self.kv_lists
            return self.attn.staged_decode_plan(indptr[: bs + 1], indices, last[:bs])
        return self.attn.plan([1] * bs, [1] * bs, [[self.pad_page]] * bs, graph_batch_size=bs)

    @torch.inference_mode()
    def capture(self, show_progress: bool | None = None) -> None:
        """Capture one graph per bucket, largest first (smaller ones reuse its memory pool)."""
        self._fill(StepInputs.scratch(self.pad_page, self.page_size, self.pad_slot), self.buckets[-1])
        pool = None
        buckets = list(reversed(self.buckets))
        for bs in progress(buckets, len(buckets), "capturing CUDA graphs", "graph", show_progress):
            batch = self._batch(bs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs], self.greedy[bs] = self._step(batch)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _step(self, batch: ForwardBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The captured step: logits in the model's dtype (the sampler upcasts the rows it samples at
        random; an fp32 copy of ``[bs, V]`` in the graph cost ~4 us at batch 1) and every row's
        greedy id, so a greedy step samples nothing outside the graph. The ids are also written into
        the static input-id row: a following step of the same rows in the same order takes them from
        there (``run``) instead of from a device-to-device copy between the graphs."""
        logits = self.model.compute_logits(self.model.forward(batch, self.caches), upcast=False)
        return logits, (self.model.greedy_ids(logits, copy_to=batch.input_ids) if logits is not None else None)

    def _fill(self, inp: StepInputs, bs: int, device_ids: bool = False) -> None:
        """Copy the step's rows into the static buffers; rows ``n..bs`` write the scratch page/slot.
        ``device_ids``: the input ids come from the device (``run``), so the copy leaves their row
        alone and starts at the positions."""
        pad = bs - len(inp.input_ids)
        turn, self._turn = self._turn, 1 - self._turn
        copied = self._copied[turn]
        if copied is not None:
            copied.synchronize()  # this buffer's copy of two steps ago (long done in practice)
        rows, lens, lists = self._host_views[turn]
        rows[0, :bs] = inp.input_ids + [0] * pad
        rows[1, :bs] = inp.positions + [0] * pad
        rows[2, :bs] = inp.slot_mapping + [self.pad_page * self.page_size] * pad
        rows[3, :bs] = inp.read_slots + [self.pad_slot] * pad
        rows[4, :bs] = inp.write_slots + [self.pad_slot] * pad
        seq_lens = inp.seq_lens + [1] * pad
        lens[:bs] = seq_lens
        nbytes = self._layout.lists_offset
        if lists is not None:
            indptr, last, indices = lists
            nnz = fill_page_lists(inp.page_ids + [[self.pad_page]] * pad, seq_lens, self.page_size, indptr, indices, last)
            nbytes = self._layout.indices_end(nnz)
        start = self._layout.positions_offset if device_ids else 0
        self._dev[start:nbytes].copy_(self._host[turn][start:nbytes], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[turn] = event

    def run(
        self, inp: StepInputs, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Replay the smallest bucket that holds the decode step; returns logits ``[n, V]`` in the
        model's dtype and each row's greedy id ``[n]`` (None on a tensor-parallel worker rank):
        views of the graph's static outputs, valid until the bucket's next replay (whatever reads
        them is queued before it). ``input_ids`` (on the device, ``[n]``) replace the host ids: a
        device-to-device copy queued behind the step that sampled them, or none where they are this
        bucket's greedy ids of the graph replayed last (the same rows in the same order: that replay
        wrote them into the input-id row itself, ``_step``; ~3 us a step between the graphs on an
        H200, a copy and its hand-off between the copy engine and the compute stream)."""
        n = len(inp.input_ids)
        bs = next(b for b in self.buckets if b >= n)
        greedy = self.greedy.get(bs)
        in_place = (
            input_ids is not None and greedy is not None and self._last_replay == bs
            and input_ids.data_ptr() == greedy.data_ptr() and input_ids.is_contiguous()
        )  # fmt: skip
        self._fill(inp, bs, device_ids=input_ids is not None)
        if input_ids is not None and not in_place:
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if self.kv_lists is None:
            pad = bs - n
            self.attn.plan([1] * bs, inp.seq_lens + [1] * pad, inp.page_ids + [[self.pad_page]] * pad, graph_batch_size=bs)
        self.graphs[bs].replay()
        self._last_replay = bs
        logits, greedy = self.logits[bs], self.greedy[bs]
        return (logits[:n], greedy[:n]) if logits is not None and greedy is not None else None


class _StagingLayout:
    """One staging buffer's bytes: int64 rows ``[5, n]`` (input ids, positions, slot mapping, read
    and write slots), int32 sequence lengths ``[n]``, then the int32 page lists (indptr ``[n + 1]``,
    last-page lengths ``[n]``, page ids ``[max_pages]``), each part 16-byte aligned. A step copies
    the bytes up to its last page id."""

    def __init__(self, n: int, max_pages: int) -> None:
        self.n, self.max_pages = n, max_pages
        self.positions_offset = n * 8  # the rows after the input ids
        self.lens_offset = 5 * n * 8
        self.lists_offset = _align16(self.lens_offset + 4 * n)
        self.last_offset = self.lists_offset + _align16(4 * (n + 1))
        self.indices_offset = self.last_offset + _align16(4 * n)
        self.nbytes = self.indices_offset + 4 * max_pages if max_pages else self.lists_offset

    def indices_end(self, nnz: int) -> int:
        return self.indices_offset + 4 * nnz

    def views(self, buf: Any) -> tuple[Any, Any, tuple[Any, Any, Any] | None]:
        """``(rows [5, n] int64, seq_lens [n] int32, (indptr, last, indices) int32 or None)`` of a
        uint8 buffer (a device tensor or a pinned buffer's numpy array)."""
        i64 = torch.int64 if isinstance(buf, torch.Tensor) else np.int64
        i32 = torch.int32 if isinstance(buf, torch.Tensor) else np.int32
        n = self.n
        rows = buf[: self.lens_offset].view(i64).reshape(5, n)
        lens = buf[self.lens_offset : self.lens_offset + 4 * n].view(i32)
        if not self.max_pages:
            return rows, lens, None
        lists = (
            buf[self.lists_offset : self.lists_offset + 4 * (n + 1)].view(i32),
            buf[self.last_offset : self.last_offset + 4 * n].view(i32),
            buf[self.indices_offset : self.nbytes].view(i32),
        )
        return rows, lens, lists


def _align16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16

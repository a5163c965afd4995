"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches hundreds of small kernels (40 layers × norms, projections, GDN, MoE);
at batch 1 the launches, not the bytes, would bound it. Each bucket (1, 2, 4, 8, 16, 24, 32,
48, 64, ...) is captured once with static input buffers (token ids, positions, slot mapping,
sequence lengths, read/write slots); a step copies its inputs into the first ``n`` rows, pads
the rest of the bucket with a scratch page and a scratch state slot that no request owns,
re-plans FlashInfer's fixed-buffer decode wrapper for the bucket, and replays.

Everything inside the graph must be capturable: the Triton ops and FlashInfer, never the torch
references (their per-sequence loops read values back to the host). Under tensor parallelism
every rank captures the same buckets at the same time (the warm-up forwards run the collectives,
which pair across ranks) and the NCCL all-reduces and the logits gather are captured with the
step; a step replays the same bucket on every rank because they all get the same ``StepInputs``.
"""

from __future__ import annotations

import torch

from phloem.engine._progress import progress
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.step_plan import StepInputs
from phloem.kernels.flashinfer_attention import FlashInferAttention

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
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.read_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.write_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        # Two pinned staging buffers, used in turn: a step writes one while the other's copies
        # (the previous step's) may still be in flight; an event per buffer says when its copies
        # are done, so no step waits on the whole stream (the only host sync of a step stays the
        # read of its sampled ids).
        self._host = [torch.zeros((5, n), dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._host_lens = [torch.ones(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # None on tensor-parallel worker ranks (the captured LM head gathers logits to rank 0).
        self.logits: dict[int, torch.Tensor | None] = {}

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
            attn_metadata=self.attn.plan([1] * bs, [1] * bs, [[self.pad_page]] * bs, graph_batch_size=bs),
        )

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
                    self.model.compute_logits(self.model.forward(batch, self.caches))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[bs] = self.model.compute_logits(self.model.forward(batch, self.caches))
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _fill(self, inp: StepInputs, bs: int) -> None:
        """Copy the step's rows into the static buffers; rows ``n..bs`` write the scratch page/slot."""
        pad = bs - len(inp.input_ids)
        turn, self._turn = self._turn, 1 - self._turn
        copied = self._copied[turn]
        if copied is not None:
            copied.synchronize()  # this buffer's copies of two steps ago (long done in practice)
        host, lens = self._host[turn][:, :bs], self._host_lens[turn][:bs]
        host[0] = torch.tensor(inp.input_ids + [0] * pad)
        host[1] = torch.tensor(inp.positions + [0] * pad)
        host[2] = torch.tensor(inp.slot_mapping + [self.pad_page * self.page_size] * pad)
        host[3] = torch.tensor(inp.read_slots + [self.pad_slot] * pad)
        host[4] = torch.tensor(inp.write_slots + [self.pad_slot] * pad)
        lens.copy_(torch.tensor(inp.seq_lens + [1] * pad, dtype=torch.int32))
        for i, buf in enumerate((self.input_ids, self.positions, self.slot_mapping, self.read_slots, self.write_slots)):
            buf[:bs].copy_(host[i], non_blocking=True)
        self.seq_lens[:bs].copy_(lens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[turn] = event

    def run(self, inp: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Replay the smallest bucket that holds the decode step; returns logits ``[n, V]`` (None on a
        tensor-parallel worker rank). ``input_ids`` (on the device, ``[n]``) replace the host ids:
        a device-to-device copy queued behind the step that sampled them."""
        n = len(inp.input_ids)
        bs = next(b for b in self.buckets if b >= n)
        self._fill(inp, bs)
        if input_ids is not None:
            self.input_ids[:n].copy_(input_ids, non_blocking=True)
        pad = bs - n
        self.attn.plan([1] * bs, inp.seq_lens + [1] * pad, inp.page_ids + [[self.pad_page]] * pad, graph_batch_size=bs)
        self.graphs[bs].replay()
        logits = self.logits[bs]
        return logits[:n] if logits is not None else None

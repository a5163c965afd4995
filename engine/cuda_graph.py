"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (and turn, ``CudaGraphRunner``).

A decode step launches hundreds of small kernels (40 layers × norms, projections, GDN, MoE);
at batch 1 the launches, not the bytes, would bound it. Each bucket (1, 2, 4, 8, 16, 24, 32,
48, 64, ...) is captured with static input buffers (token ids, positions, slot mapping,
sequence lengths, read/write slots, and the split-KV Triton decode attention's page lists), once
per turn: two buffers used in turn, so one step's inputs are copied while the step before runs
(``CudaGraphRunner``); a step writes its inputs into the first ``n`` rows of a pinned mirror of
those buffers, pads the rest of the bucket with a scratch page and a scratch state slot that no
request owns, queues one copy of it to the device (with FlashInfer's decode instead, one turn, and
it re-plans that fixed-buffer wrapper for the bucket) and replays.

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

from phloem.engine.cache.page_lists import PageListMirror
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.progress_bars import progress
from phloem.engine.step_plan import StepInputs
from phloem.kernels.attention.flashinfer import MAX_GRAPH_PAGES, FlashInferAttention, fill_page_lists

__all__ = ["CudaGraphRunner", "graph_buckets"]


def graph_buckets(max_batch_size: int) -> list[int]:
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    return [b for b in sizes if b < max_batch_size] + [max_batch_size]


# Graph turns where the page lists are staged with the inputs (the Triton decode attention): step
# k + 1's inputs are copied while step k's graph runs.
_TURNS = 2


class CudaGraphRunner:
    """The decode graphs of every bucket, captured once per *turn*, each turn over its own static
    input buffer; replays alternate turns.

    With two turns nothing is copied between two graphs on the compute stream. A step's inputs go
    to its turn's buffer on a copy stream, once the last graph that read that buffer (two replays
    back) is done, so the copy overlaps the graph before; the compute stream only waits for the
    copy's event, long done. A graph of turn ``t`` also writes its greedy ids into the input-id row
    of the next turn's buffer (the next step of the same rows reads them there, ``run``), and a
    second stream copies them to the host after the graph ends, while the next graph runs; the next
    replay of turn ``t`` (which rewrites those ids) waits for that copy. Every cross-stream wait is
    for an event of a step before, so none holds the compute stream in the steady state. With
    FlashInfer's decode (``KernelConfig.triton_decode_attention`` off), whose wrappers keep their
    own per-bucket buffers, one turn orders the same copies behind the graph before instead.

    The host side of both staging buffers: a step writes pinned host buffer ``k % 2`` (guarded by
    the event of its previous copy) and reads its ids from pinned buffer ``k % 2``, which only
    replay ``k + 2`` rewrites: the engine collects step ``k`` before it launches step ``k + 2``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        caches: ModelCaches,
        attn: FlashInferAttention,
        max_batch_size: int,
        pad_page: int,
        pad_slot: int,
        page_mirror: PageListMirror | None = None,
    ) -> None:
        self.model, self.caches, self.attn = model, caches, attn
        self.page_mirror = page_mirror or PageListMirror()
        self.page_size = attn.page_size
        self.pad_page, self.pad_slot = pad_page, pad_slot
        self.buckets = graph_buckets(max_batch_size)
        n, dev = max_batch_size, attn.device
        # The static inputs and (with the Triton decode attention) the page lists live in one device
        # buffer per turn, mirrored by two pinned host buffers used in turn, so a step's inputs
        # reach the device in one copy, not ten small ones.
        self._layout = _StagingLayout(n, MAX_GRAPH_PAGES if attn.triton_decode else 0)
        self.turns = _TURNS if attn.triton_decode else 1
        self._dev = [torch.zeros(self._layout.nbytes, dtype=torch.uint8, device=dev) for _ in range(self.turns)]
        self._views = [self._layout.views(d) for d in self._dev]
        self.staged_lists = self._views[0][2] is not None
        self._host = [torch.zeros(self._layout.nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self._host_views = [self._layout.views(h.numpy()) for h in self._host]
        self._host_ids = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        # Each turn's greedy ids, outside the graphs' shared memory pool: a graph captured earlier
        # reuses as scratch the pool memory that later captures allocated their outputs from, so
        # an id tensor of the pool would be overwritten by the next replay while the ids stream
        # still copies it to the host (async scheduling queues that replay at once).
        self._ids_out = [torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(self.turns)]
        self._copy_stream = torch.cuda.Stream(dev)
        self._ids_stream = torch.cuda.Stream(dev)
        self._copied: list[torch.cuda.Event | None] = [None, None]  # per host buffer: its last copy done
        self._replayed: list[torch.cuda.Event | None] = [None] * self.turns  # per turn: its last replay done
        self._ids_read: list[torch.cuda.Event | None] = [None] * self.turns  # per turn: its last ids copied out
        self._host_turn = 0
        self._turn = 0  # the turn of the next replay
        self._last: tuple[int, int] | None = None  # (bucket, turn) replayed last
        # The greedy ids of the last replay as ``run`` returned them, their pinned host copy and its event.
        self._last_ids: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event] | None = None
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # None on tensor-parallel worker ranks (the captured LM head gathers logits to rank 0).
        self.logits: dict[int, list[torch.Tensor | None]] = {}
        self.greedy: dict[int, list[torch.Tensor | None]] = {}
        # Each graph's final hidden states [bs, H] (the LM head's input), for a speculating
        # engine's MTP step over a plain step's rows (``last_hidden``).
        self.hidden: dict[int, list[torch.Tensor]] = {}
        self._last_hidden: torch.Tensor | None = None

    def max_batch_size(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The smallest bucket that holds ``n`` rows (``n <= max_batch_size()``)."""
        return next(b for b in self.buckets if b >= n)

    def _batch(self, bs: int, turn: int) -> ForwardBatch:
        rows, seq_lens, lists = self._views[turn]
        input_ids, positions, slot_mapping, read_slots, write_slots = rows
        dev = input_ids.device
        return ForwardBatch(
            input_ids=input_ids[:bs],
            positions=positions[:bs],
            query_start_loc=torch.arange(bs + 1, dtype=torch.int64, device=dev),
            seq_lens=seq_lens[:bs],
            # Only the torch reference reads the page table; FlashInfer has its own buffers.
            page_table=torch.zeros((bs, 1), dtype=torch.int32, device=dev),
            slot_mapping=slot_mapping[:bs],
            read_slots=read_slots[:bs],
            write_slots=write_slots[:bs],
            has_initial_state=torch.ones(bs, dtype=torch.bool, device=dev),
            logits_indices=torch.arange(bs, dtype=torch.int64, device=dev),
            query_lens_cpu=(1,) * bs,
            is_decode=True,
            attn_metadata=self._attn_plan(bs, lists),
        )

    def _attn_plan(self, bs: int, lists: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> Any:
        if lists is not None:
            indptr, last, indices = lists
            return self.attn.staged_decode_plan(indptr[: bs + 1], indices, last[:bs])
        return self.attn.plan([1] * bs, [1] * bs, [[self.pad_page]] * bs, graph_batch_size=bs)

    def _ids_row(self, turn: int) -> torch.Tensor:
        return self._views[turn][0][0]

    @torch.inference_mode()
    def capture(self, show_progress: bool | None = None) -> None:
        """Capture one graph per bucket and turn, largest first (smaller ones reuse its memory pool)."""
        scratch = StepInputs.scratch(self.pad_page, self.page_size, self.pad_slot)
        for turn in range(self.turns):
            self._fill(scratch, self.buckets[-1], turn)
        torch.cuda.synchronize()
        pool = None
        steps = [(turn, bs) for turn in range(self.turns) for bs in reversed(self.buckets)]
        for turn, bs in progress(steps, len(steps), "capturing CUDA graphs", "graph", show_progress):
            batch = self._batch(bs, turn)
            copy_to = self._ids_row((turn + 1) % self.turns)[:bs]
            ids_out = self._ids_out[turn][:bs]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._step(batch, copy_to, ids_out)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden, logits, greedy = self._step(batch, copy_to, ids_out)
            pool = graph.pool()
            self.graphs.setdefault(bs, []).append(graph)
            self.hidden.setdefault(bs, []).append(hidden)
            self.logits.setdefault(bs, []).append(logits)
            self.greedy.setdefault(bs, []).append(greedy)
        torch.cuda.synchronize()

    def _step(
        self, batch: ForwardBatch, copy_to: torch.Tensor, ids_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The captured step: the final hidden states, logits in the model's dtype (the sampler
        upcasts the rows it samples at random) and every row's greedy id in ``ids_out``, so a
        greedy step samples nothing outside the graph. The ids are also written into ``copy_to``,
        the next turn's input-id row: a following step of the same rows in the same order takes
        them from there (``run``) instead of from a device-to-device copy.

        NOTE: the hidden states and logits live in the graphs' shared pool: they are valid only
        until the next replay of any graph, so whatever reads them is queued before it (the
        sampler and the speculator's MTP step are)."""
        hidden = self.model.forward(batch, self.caches)
        logits = self.model.compute_logits(hidden, upcast=False)
        if logits is None:
            return hidden, None, None
        return hidden, logits, self.model.greedy_ids(logits, copy_to=copy_to, out=ids_out)

    def _fill(self, inp: StepInputs, bs: int, turn: int, device_ids: bool = False) -> torch.cuda.Event:
        """Queue the copy of the step's rows into ``turn``'s static buffer on the copy stream (rows
        ``n..bs`` write the scratch page/slot); returns its event. ``device_ids``: the input ids come
        from the device (``run``), so the copy leaves their row alone and starts at the positions."""
        pad = bs - len(inp.input_ids)
        host_turn, self._host_turn = self._host_turn, 1 - self._host_turn
        copied = self._copied[host_turn]
        if copied is not None:
            copied.synchronize()  # this host buffer's copy of two steps ago (long done in practice)
        rows, lens, lists = self._host_views[host_turn]
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
            pages = self.page_mirror.arrays(inp.page_ids) + [np.array([self.pad_page], dtype=np.int32)] * pad
            nnz = fill_page_lists(pages, seq_lens, self.page_size, indptr, indices, last)
            nbytes = self._layout.indices_end(nnz)
        start = self._layout.positions_offset if device_ids else 0
        # One turn: the copy on the compute stream, behind the graph before (as before turns).
        stream = self._copy_stream if self.turns > 1 else torch.cuda.current_stream()
        if self.turns > 1:
            # The buffer's last reader is its turn's last replay; its input-id row is also written by
            # the graph of the turn before (``_step``'s ``copy_to``), so a copy of that row waits for
            # it too.
            readers = [self._replayed[turn]]
            if start == 0:
                readers.append(self._replayed[(turn - 1) % self.turns])
            for event in readers:
                if event is not None:
                    stream.wait_event(event)
        with torch.cuda.stream(stream):
            self._dev[turn][start:nbytes].copy_(self._host[host_turn][start:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        self._copied[host_turn] = event
        return event

    def run(
        self, inp: StepInputs, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Replay the smallest bucket that holds the decode step, in the next turn; returns logits
        ``[n, V]`` in the model's dtype and each row's greedy id ``[n]`` (None on a tensor-parallel
        worker rank): the logits are valid until the next replay of any graph, the ids (the turn's
        ids buffer) until the turn's next replay (whatever reads them is queued before it). ``input_ids`` (on the device, ``[n]``)
        replace the host ids: a device-to-device copy queued behind the step that sampled them, or
        none where they are the greedy ids of the graph replayed last in the same bucket (the same
        rows in the same order: that replay wrote them into this turn's input-id row, ``_step``)."""
        n = len(inp.input_ids)
        bs = self.bucket(n)
        turn = self._turn
        in_place = False
        if input_ids is not None and self._last is not None and self._last[0] == bs:
            last_greedy = self.greedy[bs][self._last[1]]
            in_place = last_greedy is not None and input_ids.data_ptr() == last_greedy.data_ptr() and input_ids.is_contiguous()
        staged = self._fill(inp, bs, turn, device_ids=input_ids is not None)
        main = torch.cuda.current_stream()
        if input_ids is not None and not in_place:
            self._ids_row(turn)[:n].copy_(input_ids, non_blocking=True)
        if not self.staged_lists:
            pad = bs - n
            self.attn.plan([1] * bs, inp.seq_lens + [1] * pad, inp.page_ids + [[self.pad_page]] * pad, graph_batch_size=bs)
        if self.turns > 1:
            main.wait_event(staged)
        ids_read = self._ids_read[turn]
        if ids_read is not None:
            main.wait_event(ids_read)  # the turn's last greedy ids are on the host before they are rewritten
        self.graphs[bs][turn].replay()
        if self.turns > 1:
            replayed = torch.cuda.Event()
            replayed.record(main)
            self._replayed[turn] = replayed
        self._last, self._turn = (bs, turn), (turn + 1) % self.turns
        self._last_hidden = self.hidden[bs][turn][:n]
        logits, greedy = self.logits[bs][turn], self.greedy[bs][turn]
        self._last_ids = None
        if logits is None or greedy is None:
            return None
        ids = greedy[:n]
        if self.turns == 1:
            return logits[:n], ids  # the caller copies the ids to the host behind the graph
        host = self._host_ids[self._host_turn][:n]  # the host buffer this step's inputs did not use
        stream = self._ids_stream
        replayed = self._replayed[turn]
        assert replayed is not None  # recorded above (two turns)
        stream.wait_event(replayed)
        with torch.cuda.stream(stream):
            host.copy_(ids, non_blocking=True)
            read = torch.cuda.Event()
            read.record(stream)
        self._ids_read[turn] = read
        self._last_ids = (ids, host, read)
        return logits[:n], ids

    def last_hidden(self) -> torch.Tensor:
        """The final hidden states ``[n, H]`` of the last ``run``'s rows (valid until the next
        replay of any graph, like its logits)."""
        assert self._last_hidden is not None, "no graph was replayed yet"
        return self._last_hidden

    def host_ids(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event] | None:
        """The pinned host copy of ``tokens`` and its event where ``tokens`` are the greedy ids the
        last ``run`` returned (the sampler passes them through for an all-greedy step), else None."""
        last = self._last_ids
        return (last[1], last[2]) if last is not None and tokens is last[0] else None


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

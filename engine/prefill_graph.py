"""Prefill and mixed steps of up to ``max_tokens`` tokens, replayed from piecewise CUDA graphs.

A step that appends a tool result (hundreds of tokens) beside the other sessions' decode rows
launches a few thousand small kernels: at a mixed step's size the host issuing them, not the
device, bounds the step, and every decoding session waits for it. Only the full-attention layers'
cores depend on more than the step's token and sequence counts (FlashInfer plans its kernels per
step from the query and KV lengths), so each (token bucket, sequence tier) captures one graph per
stretch between them::

    graph 0      embedding, the GDN layers before the first attention layer, its mixer_in
    attention    that layer's mixer_core, eager: attention over the step's pages
    graph 1      its mixer_out (output projection, norm, MLP), the GDN layers up to the next
                 attention layer, that one's mixer_in (input norm, projections, KV write)
    ...
    graph A      the last attention layer's mixer_out, the GDN layers after it, the final norm

(``DecoderLayer.mixer_in`` / ``mixer_core`` / ``mixer_out``; the vLLM design of splitting the
graph at attention.) The GDN layers run whole inside the graphs, conv and chunked recurrence
included, over a static layout of ``tier + 2`` sequences: the step's own (decode rows are
sequences of one token), empty ones up to the tier, one holding the padding rows, and an empty
last one. fla's chunk indices are built on the device from that layout
(``kernels.gdn.chunk_indices``); padding and empty sequences read and write the scratch state
slot. Tiers (``_SEQ_TIERS``) exist because every padded sequence still costs a state read and
write per GDN layer.

Tensors cross a graph boundary through static buffers of ``max_tokens`` rows (the token ids,
positions and KV slot mapping; the GDN layout; the attention layers' mixer tensors and core
output; the residual stream; the final hidden states): a graph reads its inputs there and copies
its outputs there, so nothing a graph allocates outlives it, and every graph shares one memory
pool in any replay order. Rows ``T .. bucket`` of a step of ``T`` tokens are padding: their KV
writes go to the scratch page, their GDN state to the scratch slot, the attention cores see only
rows ``:T``, and no layer mixes rows across sequences, so padding never reaches a real token (its
ids and positions are whatever an earlier step left).

Decode steps keep their own graphs (``engine.cuda_graph``); a step over ``max_tokens`` tokens (a
long first turn's chunks: the device bounds those) or over the largest tier's sequences runs
eagerly. Tensor parallelism is not covered (the engine builds this only at TP=1). On CPU (tests)
the graphs' bodies run as plain calls in the same order over the same buffers
(``use_graphs=False``), which checks everything but the capture.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.progress_bars import progress
from phloem.kernels.gdn.chunk_indices import max_chunks, static_chunk_indices

__all__ = ["PrefillGraphRunner", "prefill_buckets", "seq_tiers"]

# Token-count buckets: fine steps where a tool result lands (a few hundred tokens plus the decode
# rows), so padding costs little of a step whose work grows with its tokens.
_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 3072, 4096)
# Sequence tiers: the most sequences (decode rows count one each) a step of a tier may have. An
# empty padded sequence costs a GDN state's read and write per layer (8 MiB at Qwen3.5-35B-A3B's
# 32 heads of 128 x 128 fp32: ~60 us a step on an H200): one agent's appends take the first
# tier, 16 agents' mixed steps the second, up to 64 decode rows beside appends the last.
_SEQ_TIERS = (4, 24, 72)


def prefill_buckets(max_tokens: int) -> list[int]:
    return [b for b in _BUCKETS if b < max_tokens] + [max_tokens]


def seq_tiers(bucket: int) -> list[int]:
    """The sequence tiers of a token bucket (a step has at most one sequence a token)."""
    return sorted({*(c for c in _SEQ_TIERS if c < bucket), min(bucket, _SEQ_TIERS[-1])})


class PrefillGraphRunner:
    """The piecewise graphs of ``model`` (a ``Qwen3HybridForCausalLM``) for steps of up to
    ``max_tokens`` tokens; padding rows write KV slot ``pad_slot`` (``page * page_size + offset``)
    and GDN state slot ``pad_state_slot``."""

    def __init__(
        self, model: torch.nn.Module, caches: ModelCaches, max_tokens: int, pad_slot: int, pad_state_slot: int,
        use_graphs: bool = True,
    ) -> None:  # fmt: skip
        self.model, self.caches = model, caches
        self.layers = list(model.model.layers)
        # Graph boundaries: -1 (the embedding), the attention layers, L (the final norm).
        self.attn_layers = [i for i, layer in enumerate(self.layers) if layer.is_full_attention]
        self.bounds = [-1, *self.attn_layers, len(self.layers)]
        self.has_gdn = len(self.attn_layers) < len(self.layers)
        self.max_tokens, self.pad_slot, self.pad_state_slot = max_tokens, pad_slot, pad_state_slot
        self.buckets = prefill_buckets(max_tokens)
        self.tiers = {bs: seq_tiers(bs) for bs in self.buckets}
        self.use_graphs = use_graphs
        weight = model.model.embed_tokens.weight
        dev, dtype, n = weight.device, weight.dtype, max_tokens
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), pad_slot, dtype=torch.int64, device=dev)
        self.residual = torch.zeros(n, weight.shape[1], dtype=dtype, device=dev)
        self.final = torch.zeros(n, weight.shape[1], dtype=dtype, device=dev)
        # The GDN layout of the largest tier (``_layout``); a tier's batch views its head.
        seqs = _SEQ_TIERS[-1] + 2
        self.cu = torch.zeros(seqs + 1, dtype=torch.int64, device=dev)
        self.read_slots = torch.full((seqs,), pad_state_slot, dtype=torch.int64, device=dev)
        self.write_slots = torch.full((seqs,), pad_state_slot, dtype=torch.int64, device=dev)
        self.has_initial = torch.zeros(seqs, dtype=torch.bool, device=dev)
        self.chunk_indices = torch.zeros(max_chunks(n, seqs), 2, dtype=torch.int64, device=dev)
        self.chunk_offsets = torch.zeros(seqs + 1, dtype=torch.int64, device=dev)
        # The attention layers' core output and mixer tensors (once a first pass has shown their
        # shapes, ``_mix_buffers``).
        attn = self.layers[self.attn_layers[0]] if self.attn_layers else None
        self.core = torch.zeros(n, *attn.core_shape(), dtype=dtype, device=dev) if attn is not None else None
        self.mix: list[torch.Tensor] = []
        self.graphs: dict[tuple[int, int], list[Callable[[], None]]] = {}

    def covers(self, batch: ForwardBatch) -> bool:
        return batch.num_tokens <= self.max_tokens and batch.num_seqs <= _SEQ_TIERS[-1]

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _batch(self, bs: int, tier: int) -> ForwardBatch:
        """What the graphs of bucket ``bs`` and tier ``tier`` read of a step: its tokens' positions
        and KV slots (``mixer_in``), the GDN layout of ``tier + 2`` sequences."""
        empty, seqs = self.ids[:0], tier + 2
        return ForwardBatch(
            input_ids=self.ids[:bs], positions=self.positions[:bs], query_start_loc=self.cu[: seqs + 1],
            seq_lens=empty, page_table=empty, slot_mapping=self.slots[:bs], read_slots=self.read_slots[:seqs],
            write_slots=self.write_slots[:seqs], has_initial_state=self.has_initial[:seqs], logits_indices=empty,
            query_lens_cpu=(), is_decode=False,
            gdn_chunks=(self.chunk_indices[: max_chunks(bs, seqs)], self.chunk_offsets[: seqs + 1]),
        )  # fmt: skip

    def _layout(self, bs: int, tier: int, batch: ForwardBatch | None) -> None:
        """The static GDN layout of a step (``None``: of no token, every row padding): its
        sequences, then empty ones up to ``tier``, the padding rows ``n .. bs``, an empty last."""
        n, s = (batch.num_tokens, batch.num_seqs) if batch is not None else (0, 0)
        if batch is not None:
            self.cu[: s + 1].copy_(batch.query_start_loc)
            self.read_slots[:s].copy_(batch.read_slots)
            self.write_slots[:s].copy_(batch.write_slots)
            self.has_initial[:s].copy_(batch.has_initial_state)
        self.cu[s + 1 : tier + 1].fill_(n)
        self.cu[tier + 1 : tier + 3].fill_(bs)
        self.read_slots[s : tier + 2].fill_(self.pad_state_slot)
        self.write_slots[s : tier + 2].fill_(self.pad_state_slot)
        self.has_initial[s : tier + 2].fill_(False)

    def _segment(self, start: int, end: int, batch: ForwardBatch) -> None:
        """Layer ``start``'s ``mixer_out`` (the embedding for ``start = -1``), the GDN layers
        between whole, layer ``end``'s ``mixer_in`` (the final norm for ``end = L``), through the
        static buffers."""
        model, layers, bs = self.model, self.layers, batch.num_tokens
        inv_freq = model.rope_inv_freq
        if start < 0:
            if self.has_gdn:
                assert batch.gdn_chunks is not None
                static_chunk_indices(batch.query_start_loc, batch.gdn_chunks[0].shape[0], out=batch.gdn_chunks)
            hidden, residual = model.model.embed_tokens(self.ids[:bs]), None
        else:
            assert self.core is not None
            mix = tuple(b[:bs] for b in self.mix)
            hidden, residual = layers[start].mixer_out(mix, self.core[:bs], self.residual[:bs])
        for layer in layers[start + 1 : end]:
            hidden, residual = layer(hidden, residual, batch, self.caches, inv_freq)
        if end == len(layers):
            out, _ = model.model.norm.forward_residual(hidden, residual)
            self.final[:bs].copy_(out)
            return
        mix, residual = layers[end].mixer_in(hidden, residual, batch, self.caches, inv_freq)
        for buf, t in zip(self._mix_buffers(mix), mix):
            buf[:bs].copy_(t)
        self.residual[:bs].copy_(residual)

    def _mix_buffers(self, mix: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        if not self.mix:  # the first pass, outside any capture (``capture`` runs every graph eagerly first)
            self.mix = [torch.zeros(self.max_tokens, *t.shape[1:], dtype=t.dtype, device=t.device) for t in mix]
        return self.mix

    @torch.inference_mode()
    def capture(self, show_progress: bool | None = None) -> None:
        """Run every graph's body once (largest bucket first; Triton compiles and autotunes), then
        capture them, one memory pool for all."""
        keys = [(bs, tier) for bs in reversed(self.buckets) for tier in reversed(self.tiers[bs])]
        side = torch.cuda.Stream() if self.use_graphs else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks (None: no-op)
            for bs, tier in keys:
                batch = self._batch(bs, tier)
                self._layout(bs, tier, None)
                self.graphs[(bs, tier)] = [partial(self._segment, a, b, batch) for a, b in zip(self.bounds, self.bounds[1:])]
                for segment in self.graphs[(bs, tier)]:
                    segment()
        if side is None:
            return
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = None
        for key in progress(keys, len(keys), "capturing prefill graphs", "graph set", show_progress):
            graphs = []
            for segment in self.graphs[key]:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    segment()
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[key] = [g.replay for g in graphs]
        torch.cuda.synchronize()

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The final-normed hidden states ``[T, H]`` of the step's tokens (a view of a static buffer:
        valid until the next ``run``)."""
        n = batch.num_tokens
        bs = self.bucket(n)
        tier = next(c for c in self.tiers[bs] if c >= batch.num_seqs)
        self.ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        if bs > n:
            self.slots[n:bs].fill_(self.pad_slot)
        if self.has_gdn:
            self._layout(bs, tier, batch)
        graphs = self.graphs[(bs, tier)]
        graphs[0]()
        inv_freq = self.model.rope_inv_freq
        for i, graph in zip(self.attn_layers, graphs[1:]):
            assert self.core is not None
            mix = tuple(b[:n] for b in self.mix)
            self.core[:n].copy_(self.layers[i].mixer_core(mix, batch, self.caches, inv_freq))
            graph()
        return self.final[:n]

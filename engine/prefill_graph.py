"""Prefill and mixed steps of up to ``max_tokens`` tokens, replayed from piecewise CUDA graphs.

A step that appends a tool result (hundreds of tokens) beside the other sessions' decode rows
launches a few thousand small kernels: at a mixed step's size the host issuing them, not the
device, bounds the step, and every decoding session waits for it. Most of that work does not
depend on which requests are in the step, only on how many tokens it has: each layer's norms,
projections, output gates and MoE compute every token apart. So each token-count bucket
captures ``L + 1`` graphs (``L`` layers) between the parts that do depend on the requests::

    graph 0      embedding, layer 0's mixer_in (input norm, projections, KV write)
    core 0       layer 0's mixer_core, eager: attention over the step's pages / GDN conv + chunk
    graph 1      layer 0's mixer_out (output projection, norm, MLP), layer 1's mixer_in
    ...
    graph L      layer L-1's mixer_out, the final norm

(``DecoderLayer.mixer_in`` / ``mixer_core`` / ``mixer_out``; the vLLM design of splitting the
graph at attention.) The cores run eagerly with the step's own ``ForwardBatch``: FlashInfer's
plan for its query and KV lengths, fla's varlen chunk kernels over its state slots.

Tensors cross a boundary through static buffers of ``max_tokens`` rows (the token ids, positions
and KV slot mapping; each layer kind's mixer tensors and core output; the residual stream; the
final hidden states): a graph reads its inputs there and copies its outputs there, so nothing a
graph allocates outlives it, and every graph of every bucket shares one memory pool in any
replay order. Rows ``T .. bucket`` of a step of ``T`` tokens are padding: their KV writes go to
the scratch page, the cores see only rows ``:T``, and no part of a graph mixes rows, so padding
never reaches a real token (its ids and positions are whatever an earlier step left).

Decode steps keep their own graphs (``engine.cuda_graph``); a step over ``max_tokens`` tokens
(a long first turn's chunks: the device bounds those) runs eagerly. Tensor parallelism is not
covered (the engine builds this only at TP=1). On CPU (tests) the pieces run as plain calls in
the same order over the same buffers (``use_graphs=False``), which checks everything but the capture.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.progress_bars import progress

__all__ = ["PrefillGraphRunner", "prefill_buckets"]

# Token-count buckets: fine steps where a tool result lands (a few hundred tokens plus the decode
# rows), so padding costs little of a step whose work grows with its tokens.
_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 3072, 4096)


def prefill_buckets(max_tokens: int) -> list[int]:
    return [b for b in _BUCKETS if b < max_tokens] + [max_tokens]


class PrefillGraphRunner:
    """The piecewise graphs of ``model`` (a ``Qwen3HybridForCausalLM``) for steps of up to
    ``max_tokens`` tokens; ``pad_slot`` is the KV slot (``page * page_size + offset``) that padding
    rows write."""

    def __init__(
        self, model: torch.nn.Module, caches: ModelCaches, max_tokens: int, pad_slot: int, use_graphs: bool = True
    ) -> None:
        self.model, self.caches = model, caches
        self.layers = list(model.model.layers)
        self.max_tokens, self.pad_slot = max_tokens, pad_slot
        self.buckets = prefill_buckets(max_tokens)
        self.use_graphs = use_graphs
        weight = model.model.embed_tokens.weight
        dev, dtype, n = weight.device, weight.dtype, max_tokens
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), pad_slot, dtype=torch.int64, device=dev)
        self.residual = torch.zeros(n, weight.shape[1], dtype=dtype, device=dev)
        self.final = torch.zeros(n, weight.shape[1], dtype=dtype, device=dev)
        # Per layer kind (True: full attention): its core's output; its mixer tensors once a first
        # pass has shown their shapes (``_mix_buffers``).
        self.core = {layer.is_full_attention: torch.zeros(n, *layer.core_shape(), dtype=dtype, device=dev)
                     for layer in self.layers}  # fmt: skip
        self.mix: dict[bool, list[torch.Tensor]] = {}
        self.pieces: dict[int, list[Callable[[], None]]] = {}

    def covers(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _batch(self, bs: int) -> ForwardBatch:
        """What the pieces read of a step: its tokens' positions and KV slots (``mixer_in``)."""
        empty = self.ids[:0]
        return ForwardBatch(
            input_ids=self.ids[:bs], positions=self.positions[:bs], query_start_loc=empty, seq_lens=empty,
            page_table=empty, slot_mapping=self.slots[:bs], read_slots=empty, write_slots=empty,
            has_initial_state=empty, logits_indices=empty, query_lens_cpu=(), is_decode=False,
        )  # fmt: skip

    def _piece(self, i: int, bs: int, batch: ForwardBatch) -> None:
        """Graph ``i`` of bucket ``bs``: layer ``i - 1``'s ``mixer_out`` (the embedding for ``i = 0``),
        then layer ``i``'s ``mixer_in`` (the final norm for ``i = L``), through the static buffers."""
        model, layers = self.model, self.layers
        if i == 0:
            hidden, residual = model.model.embed_tokens(self.ids[:bs]), None
        else:
            prev = layers[i - 1]
            kind = prev.is_full_attention
            mix = tuple(b[:bs] for b in self.mix[kind])
            hidden, residual = prev.mixer_out(mix, self.core[kind][:bs], self.residual[:bs])
        if i == len(layers):
            out, _ = model.model.norm.forward_residual(hidden, residual)
            self.final[:bs].copy_(out)
            return
        layer = layers[i]
        mix, residual = layer.mixer_in(hidden, residual, batch, self.caches, model.rope_inv_freq)
        for buf, t in zip(self._mix_buffers(layer.is_full_attention, mix), mix):
            buf[:bs].copy_(t)
        self.residual[:bs].copy_(residual)

    def _mix_buffers(self, kind: bool, mix: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        bufs = self.mix.get(kind)
        if bufs is None:  # the first pass, outside any capture (``capture`` runs every bucket eagerly first)
            bufs = self.mix[kind] = [torch.zeros(self.max_tokens, *t.shape[1:], dtype=t.dtype, device=t.device)
                                     for t in mix]  # fmt: skip
        return bufs

    @torch.inference_mode()
    def capture(self, show_progress: bool | None = None) -> None:
        """Run every bucket's pieces once (largest first: it sizes the buffers; Triton compiles),
        then capture them, one memory pool for all."""
        count = len(self.layers) + 1
        side = torch.cuda.Stream() if self.use_graphs else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks (None: no-op)
            for bs in reversed(self.buckets):
                batch = self._batch(bs)
                self.pieces[bs] = [partial(self._piece, i, bs, batch) for i in range(count)]
                for step in self.pieces[bs]:
                    step()
        if side is None:
            return
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = None
        buckets = list(reversed(self.buckets))
        for bs in progress(buckets, len(buckets), "capturing prefill graphs", "bucket", show_progress):
            graphs = []
            for step in self.pieces[bs]:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    step()
                pool = graph.pool()
                graphs.append(graph)
            self.pieces[bs] = [g.replay for g in graphs]
        torch.cuda.synchronize()

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The final-normed hidden states ``[T, H]`` of the step's tokens (a view of a static buffer:
        valid until the next ``run``)."""
        n = batch.num_tokens
        bs = self.bucket(n)
        self.ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slots[:n].copy_(batch.slot_mapping)
        if bs > n:
            self.slots[n:bs].fill_(self.pad_slot)
        pieces = self.pieces[bs]
        pieces[0]()
        inv_freq = self.model.rope_inv_freq
        for layer, piece in zip(self.layers, pieces[1:]):
            kind = layer.is_full_attention
            mix = tuple(b[:n] for b in self.mix[kind])
            self.core[kind][:n].copy_(layer.mixer_core(mix, batch, self.caches, inv_freq))
            piece()
        return self.final[:n]

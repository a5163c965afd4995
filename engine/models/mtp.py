"""The multi-token-prediction (MTP) layer of Qwen3.5 / Qwen3-Next checkpoints, and drafting with it.

Every Qwen3.5-MoE, Qwen3.5 dense and Qwen3-Next checkpoint ships one MTP layer (``mtp.*``). For
the trunk's final hidden state ``h[t]`` (after ``model.norm``) and the token ``x[t+1]`` after the
one it predicted, it computes (as vLLM's ``Qwen3NextMultiTokenPredictor``)::

    x = mtp.fc(cat(mtp.pre_fc_norm_embedding(embed(x[t+1])), mtp.pre_fc_norm_hidden(h[t])))
    x = mtp.layers.0(x)                 # a gated full-attention decoder layer, at position t
    h'[t] = mtp.norm(x)                 # lm_head(h'[t]) predicts x[t+2]

``embed_tokens`` and ``lm_head`` are the trunk's own. A further step feeds ``h'[t]`` back as ``h``
with the token it drafted, at position ``t+1``, and so on (``propose_drafts``).

Its decoder layer is the trunk's ``DecoderLayer`` built as one more layer after the trunk's last:
a full-attention layer (``GatedAttention``) with the sparse MoE when the model has experts
(Qwen3.5-MoE, Qwen3-Next: ``mtp.layers.0.mlp.experts.*``), else the dense SwiGLU MLP (Qwen3.5
dense). Its weights load through ``engine.loader`` like any layer's (fused or per-expert experts,
``q/k/v_proj`` into ``qkv_proj``, the shared expert into the expert tensor), and it is sharded by
the same parallel layers; ``fc`` is row-parallel (each rank multiplies its columns of the
concatenated input; the layer's input norm reduces the partial sums, as after the embedding).

**Its KV** is full-attention cache index ``len(config.full_attention_layers)``: one more layer of
the same paged KV tensor (``ModelCaches.kv``), after the trunk's attention layers, addressed by
the request's own page table and slot mapping. The MTP entry of position ``p`` lives in the same
page and slot as the trunk's entries of ``p``, so the page allocator, the prefix cache (a cached
page carries the MTP KV of its positions) and KV transfer see one page list per request. The pool
is allocated with ``mtp_kv_layers(config)`` KV layers (the trunk's + 1) when MTP is on
(``Engine``, through ``build_runner``'s ``extra_kv_layers``); the engine loop drafts and verifies
with it in ``engine.speculative``.
docs/decisions.md, "The MTP layer's KV is one more attention layer of the page pool".
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from phloem.engine.config import FULL_ATTENTION, ModelConfig
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.models._fp8 import project
from phloem.engine.models._norm import RMSNorm
from phloem.engine.models.qwen3_hybrid import DecoderLayer, Qwen3HybridForCausalLM
from phloem.engine.parallel.group import TPGroup
from phloem.engine.parallel.layers import RowParallelLinear, Shard
from phloem.kernels.dispatch import KernelOps

__all__ = [
    "MultiTokenPredictor", "add_mtp", "mtp_forward", "mtp_kv_layers", "mtp_layer_config", "propose_drafts", "shifted_ids",
]


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """``config`` with the MTP layer appended as layer ``num_hidden_layers``: full attention, MoE
    exactly when the model has experts (``mlp_only_layers`` / ``decoder_sparse_step`` name trunk
    layers; every published MoE checkpoint's MTP layer is MoE)."""
    return dataclasses.replace(
        config, layer_types=(*config.layer_types, FULL_ATTENTION), mlp_only_layers=(), decoder_sparse_step=1
    )


def mtp_kv_layers(config: ModelConfig) -> int:
    """Full-attention KV layers of the page pool with the MTP layer: the trunk's, then the MTP's."""
    return len(config.full_attention_layers) + 1


class MultiTokenPredictor(nn.Module):
    """The ``mtp.*`` weights (names as in the checkpoint after ``mtp.``) and one MTP step."""

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.tp = tp
        self.ops = ops
        self.hidden_size = hidden
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, ops)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, ops)
        if (2 * hidden) % tp.size:
            raise ValueError(f"tensor_parallel_size: must divide 2 * hidden_size={2 * hidden}, got {tp.size}")
        per_rank = 2 * hidden // tp.size
        self.fc_cols = (tp.rank * per_rank, (tp.rank + 1) * per_rank)
        self.fc = RowParallelLinear(per_rank, hidden, ops.linear)
        extended = mtp_layer_config(config)
        layer = DecoderLayer(extended, config.num_hidden_layers, ops, tp)
        # One-token steps take the same path as longer ones (the fused decode path reads the
        # trunk's decode plans; the MTP step is eager for now).
        layer.fuse_decode = False
        assert layer.is_full_attention and layer.cache_idx == len(config.full_attention_layers)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(hidden, eps, ops, tp)

    @property
    def cache_idx(self) -> int:
        """Its index into ``ModelCaches.kv``: after the trunk's full-attention layers."""
        return int(self.layers[0].cache_idx)

    def checkpoint_shards(self) -> dict[str, Shard]:
        return {"fc.weight": Shard.cols(*self.fc_cols)} if self.tp.size > 1 else {}

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, caches: ModelCaches,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """``embeds`` ``[T, H]`` (whole: reduced over the ranks) of the tokens after the ones
        ``hidden`` ``[T, H]`` (the trunk's, or a previous step's, final-normed states) predicted
        from, at ``batch.positions`` (those of ``hidden``); writes the layer's KV at
        ``batch.slot_mapping``. Returns ``h'`` ``[T, H]``, final-normed (``lm_head``'s input)."""
        x = torch.cat((self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)), dim=-1)
        if self.tp.size > 1:
            x = x[:, self.fc_cols[0] : self.fc_cols[1]]
        x = project(self.ops, self.fc, x)  # this rank's partial sum: the layer's input norm reduces it
        x, residual = self.layers[0](x, None, batch, caches, inv_freq)
        out, _ = self.norm.forward_residual(x, residual)
        return out


def add_mtp(model: Qwen3HybridForCausalLM) -> MultiTokenPredictor:
    """Attach a ``MultiTokenPredictor`` as ``model.mtp`` (parameters ``mtp.*``, on the model's
    device: build the model under ``torch.device("meta")`` first, as the loader does)."""
    mtp = MultiTokenPredictor(model.config, model.ops, model.tp)
    model.mtp = mtp
    return mtp


def _mtp(model: Qwen3HybridForCausalLM) -> MultiTokenPredictor:
    mtp = getattr(model, "mtp", None)
    if not isinstance(mtp, MultiTokenPredictor):
        raise ValueError("model: no MTP layer loaded (load it with SpeculativeConfig(method='mtp', ...))")
    return mtp


def _embed(model: Qwen3HybridForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Whole embeddings on every rank (``ParallelEmbedding`` returns this rank's partial sum)."""
    return model.tp.all_reduce(model.model.embed_tokens(ids))


def shifted_ids(batch: ForwardBatch, next_tokens: torch.Tensor) -> torch.Tensor:
    """The MTP step's input ids for ``batch``'s rows: each request's tokens shifted left by one,
    its last row taking ``next_tokens[i]`` (the token after the last one: sampled, or the next
    prompt token of a chunked prefill)."""
    ids = torch.empty_like(batch.input_ids)
    ids[:-1] = batch.input_ids[1:]
    last = batch.query_start_loc[1:].long() - 1
    ids[last] = next_tokens.to(ids.dtype)
    return ids


def _decode_batch(batch: ForwardBatch, positions: torch.Tensor, page_size: int) -> ForwardBatch:
    """One token per request at ``positions`` ``[B]``, on ``batch``'s page table (torch reference
    attention: the table must cover the positions)."""
    table = batch.page_table.long()
    rows = torch.arange(len(positions), device=positions.device)
    slots = table[rows, positions // page_size] * page_size + positions % page_size
    b = len(positions)
    return ForwardBatch(
        input_ids=torch.zeros(b, dtype=torch.int64, device=positions.device),
        positions=positions,
        query_start_loc=torch.arange(b + 1, dtype=batch.query_start_loc.dtype, device=positions.device),
        seq_lens=(positions + 1).to(torch.int32),
        page_table=batch.page_table,
        slot_mapping=slots,
        read_slots=batch.read_slots,
        write_slots=batch.write_slots,
        has_initial_state=torch.ones(b, dtype=torch.bool, device=positions.device),
        logits_indices=rows,
        query_lens_cpu=(1,) * b,
        is_decode=True,
    )


@torch.no_grad()
def propose_drafts(
    model: Qwen3HybridForCausalLM, batch: ForwardBatch, caches: ModelCaches, hidden: torch.Tensor,
    next_tokens: torch.Tensor, num_drafts: int,
) -> torch.Tensor:  # fmt: skip
    """``num_drafts`` greedy draft tokens per request: ``[B, num_drafts]`` int64 (rank 0; under
    tensor parallelism every rank gets rank 0's, broadcast).

    ``batch`` is the trunk's step that produced ``hidden`` (``[T, H]``, ``model(batch, caches)``)
    and ``next_tokens`` ``[B]`` the token after each request's last row. Step 1 runs the MTP layer
    over all of the step's rows (writing its KV at their slots: the MTP layer's history follows
    the trunk's) and drafts from each request's last row; step ``j`` runs one token per request,
    the draft of step ``j-1`` at the next position, from step ``j-1``'s ``h'``, writing its KV
    there too (pages for positions up to ``last + num_drafts - 1`` must be in the table; the
    entries of rejected drafts are overwritten when the trunk's next step reruns step 1).

    Plain eager torch over the torch-reference attention (``batch.attn_metadata`` None): the
    reference for the engine's future drafting path.
    """
    if num_drafts < 1:
        raise ValueError(f"num_drafts: expected >= 1, got {num_drafts}")
    mtp = _mtp(model)
    ids = shifted_ids(batch, next_tokens)
    h = mtp(_embed(model, ids), hidden, batch, caches, model.rope_inv_freq)
    last = batch.query_start_loc[1:].long() - 1
    positions = batch.positions[last]
    h = h[last]
    page_size = caches.kv.shape[3]
    drafts = []
    for step in range(num_drafts):
        token = _greedy(model, h)
        drafts.append(token)
        if step + 1 == num_drafts:
            break
        positions = positions + 1
        step_batch = _decode_batch(batch, positions, page_size)
        h = mtp(_embed(model, token), h, step_batch, caches, model.rope_inv_freq)
    return torch.stack(drafts, dim=1)


def _greedy(model: Qwen3HybridForCausalLM, h: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit (``greedy_ids``), on every rank."""
    logits = model.compute_logits(h)
    out = torch.empty(h.shape[0], dtype=torch.int64, device=h.device)
    if logits is not None:
        model.greedy_ids(logits, out=out)
    return model.tp.broadcast_first(out)


@torch.no_grad()
def mtp_forward(
    model: Qwen3HybridForCausalLM, next_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
    caches: ModelCaches,
) -> torch.Tensor:  # fmt: skip
    """One MTP step over ``batch``'s rows: ``next_ids`` ``[T]`` the token after each row's,
    ``hidden`` ``[T, H]`` the trunk's (or a previous step's) final-normed states at
    ``batch.positions``; writes the MTP KV there and returns ``h'`` ``[T, H]``."""
    return _mtp(model)(_embed(model, next_ids), hidden, batch, caches, model.rope_inv_freq)

"""One model class for the hybrid GDN + gated-attention family.

Serves ``Qwen3_5MoeForCausalLM``, ``Qwen3_5ForCausalLM`` (dense MLP) and ``Qwen3NextForCausalLM``;
they differ only in which layers are MoE (``ModelConfig.is_moe_layer``) and in checkpoint naming,
which ``engine.loader`` absorbs. Parameter names follow the plain Hugging Face layout
(``model.layers.{i}...``, ``lm_head.weight``) except for the fused tensors described in
``_moe`` and ``_gdn``.

Each layer is pre-norm with a residual stream carried beside the hidden states::

    normed, residual = input_layernorm(h, residual)        # residual += all_reduce(h)
    h = self_attn(normed) | linear_attn(normed)
    normed, residual = post_attention_layernorm(h, residual)
    h = mlp(normed)

Head, expert-FFN, GDN head and vocab counts are per rank of the ``TPGroup`` the model is built
with (``engine.parallel`` has the sharding table); the hidden size and the residual stream are
whole on every rank. Under tensor parallelism the embedding and every sublayer return this rank's
partial sum and the norm after it reduces (``RMSNorm.forward_residual``), so the all-reduce, the
residual add and the norm are one kernel where the group has the one-shot path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from phloem.engine.config import FULL_ATTENTION, ModelConfig
from phloem.engine.forward_batch import ForwardBatch, ModelCaches
from phloem.engine.models._attention import GatedAttention
from phloem.engine.models._fp8 import project
from phloem.engine.models._gdn import GatedDeltaNet
from phloem.engine.models._moe import SparseMoe, SwiGluMlp
from phloem.engine.models._norm import RMSNorm
from phloem.engine.parallel.group import TPGroup
from phloem.engine.parallel.layers import ParallelEmbedding, ParallelLMHead
from phloem.kernels.dispatch import KernelOps, get_ops
from phloem.kernels.attention.rope import rope_inv_freq

__all__ = ["Qwen3HybridForCausalLM"]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, ops: KernelOps, tp: TPGroup) -> None:
        super().__init__()
        self.is_full_attention = config.layer_types[layer_idx] == FULL_ATTENTION
        # Rank of this layer among layers of its kind: its index into ModelCaches.
        same_kind = config.full_attention_layers if self.is_full_attention else config.linear_attention_layers
        self.cache_idx = same_kind.index(layer_idx)
        if self.is_full_attention:
            self.self_attn = GatedAttention(config, ops, tp)
        else:
            self.linear_attn = GatedDeltaNet(config, ops, tp)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_idx):
            self.mlp = SparseMoe(config, ops, tp)
        else:
            self.mlp = SwiGluMlp(config.hidden_size, config.intermediate_size, tp, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, tp)
        # One-token decode steps take the fused projections (kernels.linear.reference): the norms, the
        # conv, the output gates and the routing inside the GEMVs next to them (under TP too).
        self.fuse_decode = ops.fused_decode

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        caches: ModelCaches,
        inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fuse_decode and batch.is_decode and hidden.shape[0] == 1:
            return self._forward_decode(hidden, residual, batch, caches, inv_freq)
        mix, residual = self.mixer_in(hidden, residual, batch, caches, inv_freq)
        return self.mixer_out(mix, self.mixer_core(mix, batch, caches, inv_freq), residual)

    # ``forward`` in three parts. ``mixer_in`` and ``mixer_out`` compute each token apart and read
    # of the step only its tokens' positions and KV slots; ``mixer_core`` is what reads the requests
    # (their KV lengths and pages, their GDN state slots). ``engine.prefill_graph`` captures all
    # but the full-attention layers' cores as CUDA graphs (GDN layers whole, over a static layout
    # of sequences) and runs those cores eagerly between them.

    def mixer_in(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, caches: ModelCaches,
        inv_freq: torch.Tensor,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:  # fmt: skip
        """The input norm and the mixer's projections (for attention also the KV write):
        ``(mix, residual)``."""
        normed, residual = self.input_layernorm.forward_residual(hidden, residual)
        if self.is_full_attention:
            return self.self_attn.prepare(normed, batch, caches.kv[self.cache_idx], inv_freq), residual
        return (project(self.linear_attn.ops, self.linear_attn.in_proj, normed),), residual

    def mixer_core(
        self, mix: tuple[torch.Tensor, ...], batch: ForwardBatch, caches: ModelCaches, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """``mixer_in``'s tensors -> the mixer's output before its output projection: the gated
        attention output ``[T, Hq * D]`` or the delta rule's ``[T, Hv, Dv]``."""
        if self.is_full_attention:
            return self.self_attn.attend(mix, batch, caches.kv[self.cache_idx], inv_freq)
        return self.linear_attn.mix(mix[0], batch, caches.conv[self.cache_idx], caches.ssm[self.cache_idx])

    def mixer_out(
        self, mix: tuple[torch.Tensor, ...], core: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output projection, the post-attention norm and the MLP: ``(hidden, residual)``."""
        if self.is_full_attention:
            hidden = project(self.self_attn.ops, self.self_attn.o_proj, core)
        else:
            hidden = self.linear_attn.finish(core, mix[0])
        normed, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        return self.mlp(normed), residual

    def core_shape(self) -> tuple[int, ...]:
        """``mixer_core``'s output shape per token."""
        if self.is_full_attention:
            return (self.self_attn.num_heads * self.self_attn.head_dim,)
        return (self.linear_attn.num_v_heads, self.linear_attn.value_head_dim)

    def _forward_decode(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        caches: ModelCaches,
        inv_freq: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` for one decode token: each norm runs inside the projection after it; a MoE
        layer's router, where ``KernelOps.route_partial`` (TP=1), inside the mixer's output
        projection (``SparseMoe.decode_route``; the mixer then returns the residual sum twice).

        Under tensor parallelism ``hidden`` is this rank's partial sum: it is all-reduced in front
        of the projection whose prologue is the norm (``RMSNorm.reduce``; the one-shot kernel adds
        the residual in the same launch), and the mixer's output projection returns its partial
        sum to the block after it, which reduces it the same way."""
        norm = self.input_layernorm
        hidden, residual = norm.reduce(hidden, residual)
        route = self.mlp.decode_route(self.post_attention_layernorm) if isinstance(self.mlp, SparseMoe) else None
        if self.is_full_attention:
            kv = caches.kv[self.cache_idx]
            hidden, residual = self.self_attn.forward_decode(hidden, residual, norm, batch, kv, inv_freq, route)
        else:
            conv, ssm = caches.conv[self.cache_idx], caches.ssm[self.cache_idx]
            hidden, residual = self.linear_attn.forward_decode(hidden, residual, norm, batch, conv, ssm, route)
        if route is not None:
            return self.mlp.forward_decode_partial(hidden, route, self.post_attention_layernorm), residual
        if isinstance(self.mlp, SparseMoe):
            return self.mlp.forward_decode(hidden, residual, self.post_attention_layernorm)
        normed, residual = self.post_attention_layernorm.forward_residual(hidden, residual)
        return self.mlp(normed), residual


class Qwen3HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = ParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, ops, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, tp)


class Qwen3HybridForCausalLM(nn.Module):
    """Hybrid Qwen3.5 / Qwen3-Next causal LM over the engine's paged KV and GDN state slots.

    Build it under ``torch.device("meta")`` and let ``engine.loader.load_model`` materialise it;
    a model built on a real device is usable as is (after its weights are filled).
    """

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None, ops: KernelOps | None = None) -> None:
        super().__init__()
        # The op table binds every layer to Triton kernels (CUDA) or the torch references.
        ops = ops if ops is not None else get_ops(torch.device("cpu"))
        self.config = config
        self.ops = ops
        self.tp = tp if tp is not None else TPGroup.single()
        self.model = Qwen3HybridModel(config, ops, self.tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.tp, ops.linear)
        self.tie_weights()
        inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta)  # [rotary_dim // 2] fp32
        self.register_buffer("rope_inv_freq", inv_freq, persistent=False)
        # The MTP layer (``engine.models.mtp.add_mtp``, parameters ``mtp.*``) when speculation
        # loads it; ``forward`` never runs it.
        self.mtp: nn.Module | None = None

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def post_materialize(self) -> None:
        """Restore what ``to_empty`` loses: the embedding tie and the fp32 RoPE frequencies."""
        self.tie_weights()
        device = self.model.embed_tokens.weight.device
        with torch.device(device):
            self.rope_inv_freq = rope_inv_freq(self.config.rotary_dim, self.config.rope_theta)

    def forward(
        self, batch: ForwardBatch, caches: ModelCaches, on_attn_layer: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, H]`` of every token of the batch.

        ``on_attn_layer(cache_idx)`` runs after each full-attention layer, once its KV of this
        batch is written (the KV stream of a disaggregated prefill); never under graph capture.
        """
        hidden = self.model.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for layer in self.model.layers:
            hidden, residual = layer(hidden, residual, batch, caches, self.rope_inv_freq)
            if on_attn_layer is not None and layer.is_full_attention:
                on_attn_layer(layer.cache_idx)
        hidden, _ = self.model.norm.forward_residual(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor | None:
        """``[S, H]`` -> ``[S, V]`` fp32 (the GEMM runs in the weight dtype, as in HF; ``upcast``
        False: left in that dtype, the values the same); under tensor parallelism the whole logits
        exist on rank 0 only (None elsewhere)."""
        logits = self.lm_head(hidden)
        if logits is None or not upcast:
            return logits
        return logits.float()

    def greedy_ids(
        self, logits: torch.Tensor, copy_to: torch.Tensor | None = None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[S, V]`` logits -> ``[S]`` int64, each row's first largest (``kernels.sampling.reference``); also
        written into ``copy_to`` where given; into ``out`` (and returned) where given."""
        ids: torch.Tensor = self.ops.argmax(logits, copy_to, out)
        return ids

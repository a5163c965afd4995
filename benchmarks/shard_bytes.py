"""One rank's decode step at tensor-parallel size N, from the model's config alone: the bytes it
reads and the collectives it issues (no torch, no device).

The bytes are the roofline of one rank (every rank reads its share at the same time): the
weights the step touches (its shard of every dense projection, the LM head, the embedding rows
of the batch's tokens, and of each MoE layer the routed experts the batch reaches plus the
shared expert), the KV of every request, and each request's GDN state read and written. The
weight shard is ``engine.cache.sizing.weight_bytes``'s (the engine's sharding); under expert
parallelism rank 0 is counted, the busiest (it holds the shared expert whole).

The collectives are the model's under ``engine.parallel.group``'s table: every row-parallel
output is reduced once, by the RMSNorm that reads it next, so a step of L layers issues
``2 L + 1`` all-reduces of ``[tokens, hidden]`` activations (each layer's input and
post-attention norms, and the final norm) and one gather of rank 0's ``[sampled rows,
ceil(V / N)]`` logits; none at N = 1. ``tests/benchmarks/test_simulated_tp.py`` checks these
counts against what real gloo ranks issue.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from phloem.engine.cache.sizing import WEIGHT_FORMATS, kv_page_bytes, state_slot_bytes, weight_bytes
from phloem.engine.config import ModelConfig

__all__ = ["RankStep", "mtp_rank_step", "rank_step"]

_BF16 = 2


@dataclass(frozen=True, slots=True)
class RankStep:
    """One rank's decode step: bytes read (``weights``, ``kv``, ``state``) and collectives issued
    (calls and bytes this rank passes in, by kind)."""

    weights: int
    kv: int
    state: int
    all_reduces: int
    all_reduce_bytes: int
    gathers: int
    gather_bytes: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state

    @property
    def collectives(self) -> int:
        return self.all_reduces + self.gathers

    def roofline_ms(self, bandwidth: float) -> float:
        """Milliseconds to read ``total`` bytes at ``bandwidth`` bytes/s."""
        return 1000.0 * self.total / bandwidth

    def projection_ms(self, bandwidth: float, collective_us: float) -> float:
        """The roofline plus ``collective_us`` per collective: a projection, not a measurement."""
        return self.roofline_ms(bandwidth) + self.collectives * collective_us / 1000.0


def rank_step(mc: ModelConfig, tp_size: int, batch: int, context: int, weight_format: str = "bf16",
              expert_parallel: bool = False, tokens_per_request: int = 1, element_size: int = _BF16) -> RankStep:
    """Rank 0's decode step of ``batch`` requests of ``context`` tokens of history at ``tp_size``
    (``tokens_per_request`` > 1: a speculative verify step, every row sampled); the activations
    and logits the collectives carry have ``element_size`` bytes (bf16 on GPUs).

    Raises:
        ValueError: an unknown ``weight_format``.
    """
    held = weight_bytes(mc, tp_size, weight_format, expert_parallel)
    per_weight = WEIGHT_FORMATS[weight_format]
    h, tp = mc.hidden_size, tp_size
    ep = expert_parallel and tp > 1
    vocab_rows = -(-mc.vocab_size // tp)
    moe_layers = sum(mc.is_moe_layer(i) for i in range(mc.num_hidden_layers))
    experts_stored = 0
    touched = 0
    if moe_layers:
        e, k = mc.num_experts, mc.num_experts_per_tok
        expert = 3 * h * (mc.moe_intermediate_size if ep else mc.moe_intermediate_size // tp) * per_weight
        shared = 3 * h * (mc.shared_expert_intermediate_size if ep else mc.shared_expert_intermediate_size // tp)
        shared *= per_weight
        own = e // tp if ep else e
        # Distinct routed experts a batch of independent tokens reaches (uniform routing).
        distinct = own * (1 - (1 - k / e) ** (batch * tokens_per_request))
        experts_stored = moe_layers * ((own + (1 if ep else 0)) * expert + shared)
        touched = int(moe_layers * (distinct * expert + shared))
    embedding = 0 if mc.tie_word_embeddings else vocab_rows * h * _BF16
    tokens = batch * tokens_per_request
    weights = held.total - experts_stored - embedding + touched + tokens * h * _BF16
    kv = batch * context * kv_page_bytes(mc, 1, _BF16, tp)
    state = batch * 2 * state_slot_bytes(mc, _BF16, tp)
    if tp == 1:
        return RankStep(weights, kv, state, 0, 0, 0, 0)
    reduces = 2 * mc.num_hidden_layers + 1
    return RankStep(weights, kv, state, reduces, reduces * tokens * h * element_size, 1,
                    tokens * vocab_rows * element_size)


def mtp_rank_step(mc: ModelConfig, tp_size: int, batch: int, context: int, num_drafts: int,
                  weight_format: str = "bf16", expert_parallel: bool = False) -> RankStep:
    """Rank 0's speculative step with MTP drafting ``num_drafts`` tokens, approximately: the verify
    step over ``num_drafts + 1`` tokens a request, plus per draft one MTP layer (counted as an
    average layer of the trunk, at one token a request) and the LM head shard, with that layer's
    collectives (its two norms and the final one reduce, the logits gather, the hidden states'
    broadcast to the ranks)."""
    verify = rank_step(mc, tp_size, batch, context, weight_format, expert_parallel, num_drafts + 1)
    one = rank_step(mc, tp_size, batch, context, weight_format, expert_parallel)
    lm_head = -(-mc.vocab_size // tp_size) * mc.hidden_size * _BF16
    draft = num_drafts * ((one.weights - lm_head) // mc.num_hidden_layers + lm_head)
    if tp_size == 1:
        return replace(verify, weights=verify.weights + draft)
    per_reduce = one.all_reduce_bytes // one.all_reduces
    return replace(verify, weights=verify.weights + draft, all_reduces=verify.all_reduces + 4 * num_drafts,
                   all_reduce_bytes=verify.all_reduce_bytes + 4 * num_drafts * per_reduce,
                   gathers=verify.gathers + num_drafts, gather_bytes=verify.gather_bytes + num_drafts * one.gather_bytes)

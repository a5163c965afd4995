"""The arithmetic of memory, without torch and without a device: bytes of one KV page and one GDN
state slot, the split of a pool budget into pages and slots, and a whole-GPU estimate per rank.

``engine.cache.memory.plan_pools`` sizes the pools of a loaded engine with ``kv_page_bytes``,
``state_slot_bytes`` and ``split_budget``; ``estimate_memory`` runs the same arithmetic for a
model that is not loaded, on a GPU that may not be here (``phloem estimate``, docs/models.md):
the weights one rank holds (``weight_bytes``, counted from the model's config as the engine
shards them), the memory left on a GPU of a given size, the pools ``memory_fraction`` of it buys.

Decision: the weight count follows ``engine.models`` and ``engine.parallel``: the vocabulary
(embedding, LM head) and the attention, GDN and expert projections are split over the ranks
(KV heads down to one per rank, then replicated); the norms, the router and the GDN's per-head
parameters of its own heads are small; the router is replicated. Under expert parallelism each
rank holds ``E / tp`` whole experts plus the whole shared expert and one zero expert. FP8
(``Qwen3.5-*-FP8``: ``float8_e4m3fn`` weights with an fp32 scale per 128×128 block) is
approximated as 1 byte per weight of the attention, GDN ``in_proj_qkvz`` / ``out_proj``, expert,
shared-expert and dense-MLP projections plus their block scales, everything else bf16; the KV
pages are bf16 or, with ``CacheConfig.kv_cache_dtype`` ``fp8_e4m3``, 1 byte per element, the
conv state bf16 and the recurrent state fp32. That is the published layout; the engine
(``engine.models._fp8``, which the FP8 kernels read as stored) holds more: GDN ``in_proj_qkvz``
in bf16 (fused with the bf16 ``in_proj_ba``) and one scale per row and 128 columns instead of
per 128x128 block (3 % of the FP8 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from phloem.engine.config import CacheConfig, ModelConfig

__all__ = ["WEIGHT_FORMATS", "MemoryEstimate", "WeightBytes", "estimate_memory", "kv_page_bytes", "split_budget",
           "state_slot_bytes", "weight_bytes"]

WEIGHT_FORMATS = {"bf16": 2, "fp8": 1}
"""Bytes of one quantizable projection weight, by checkpoint format."""
_BF16 = 2
_FP8_BLOCK = 128 * 128  # weights per fp32 block scale
_FP32 = 4


def kv_page_bytes(mc: ModelConfig, page_size: int, element_size: int, tp_size: int = 1) -> int:
    """Bytes of one KV page on one rank: ``page_size`` tokens of K and V of every full-attention
    layer, this rank's KV heads (at least one: replicated beyond the model's count)."""
    kv_heads = max(1, mc.num_key_value_heads // tp_size)
    return len(mc.full_attention_layers) * 2 * page_size * kv_heads * mc.head_dim * element_size


def state_slot_bytes(mc: ModelConfig, element_size: int, tp_size: int = 1) -> int:
    """Bytes of one GDN state slot on one rank: the conv state (``element_size``) and the fp32
    recurrent state of this rank's heads, for every GDN layer."""
    conv = (mc.conv_dim // tp_size) * (mc.linear_conv_kernel_dim - 1) * element_size
    ssm = (mc.linear_num_value_heads // tp_size) * mc.linear_key_head_dim * mc.linear_value_head_dim * _FP32
    return len(mc.linear_attention_layers) * (conv + ssm)


def split_budget(budget: int, cc: CacheConfig, page_bytes: int, slot_bytes: int) -> tuple[int, int]:
    """``(num_pages, num_slots)`` a pool budget of ``budget`` bytes buys: ``state_fraction`` of
    it in slots, the rest in pages; ``cc.num_pages`` / ``cc.num_state_slots`` win when given."""
    num_slots = cc.num_state_slots or max(0, int(budget * cc.state_fraction)) // slot_bytes
    num_pages = cc.num_pages or max(0, int(budget * (1 - cc.state_fraction))) // page_bytes
    return num_pages, num_slots


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """Bytes of the weights one rank holds.

    Args:
        projections: The quantizable projection weights (attention, GDN ``in_proj_qkvz`` /
            ``out_proj``, experts, shared expert, dense MLP) and, in FP8, their block scales.
        other: What stays bf16: embedding, LM head, norms, router, the GDN's conv, ``A_log``,
            ``dt_bias`` and ``in_proj_ba``.
    """

    projections: int
    other: int

    @property
    def total(self) -> int:
        return self.projections + self.other


def weight_bytes(mc: ModelConfig, tp_size: int = 1, weight_format: str = "bf16",
                 expert_parallel: bool = False) -> WeightBytes:
    """The weights one of ``tp_size`` ranks holds, as ``engine.models`` shards them (MTP weights,
    which the engine does not load, are not counted).

    Raises:
        ValueError: an unknown ``weight_format`` (``WEIGHT_FORMATS``).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format: expected one of {sorted(WEIGHT_FORMATS)}, got {weight_format!r}")
    per_weight = WEIGHT_FORMATS[weight_format]
    h, tp = mc.hidden_size, tp_size
    projections = 0  # weights
    other = 0  # bf16 weights

    def proj(rows: int, cols: int, count: int = 1) -> None:
        nonlocal projections
        projections += rows * cols * count

    vocab_rows = -(-mc.vocab_size // tp)
    other += vocab_rows * h * (1 if mc.tie_word_embeddings else 2) + h  # embedding, LM head, final norm
    for layer in range(mc.num_hidden_layers):
        other += 2 * h  # input and post-attention norms
        if layer in mc.full_attention_layers:
            heads, kv_heads, d = mc.num_attention_heads // tp, max(1, mc.num_key_value_heads // tp), mc.head_dim
            proj(h, 2 * heads * d + 2 * kv_heads * d)  # q (with its gate), k, v
            proj(heads * d, h)  # o_proj
            other += 2 * d  # q_norm, k_norm
        else:
            k_dim = mc.linear_num_key_heads // tp * mc.linear_key_head_dim
            v_heads = mc.linear_num_value_heads // tp
            v_dim = v_heads * mc.linear_value_head_dim
            proj(h, 2 * k_dim + 2 * v_dim)  # in_proj_qkvz
            proj(v_dim, h)  # out_proj
            other += h * 2 * v_heads + (2 * k_dim + v_dim) * mc.linear_conv_kernel_dim  # in_proj_ba, conv1d
            other += 2 * v_heads + mc.linear_value_head_dim  # A_log, dt_bias, gated norm
        if mc.is_moe_layer(layer):
            other += mc.num_experts * h + h  # router, shared-expert gate: replicated
            if expert_parallel and tp > 1:
                proj(3 * h, mc.moe_intermediate_size, mc.num_experts // tp + 1)  # own experts + a zero one
                proj(3 * h, mc.shared_expert_intermediate_size)  # the whole shared expert
            else:
                proj(3 * h, mc.moe_intermediate_size // tp, mc.num_experts)
                proj(3 * h, mc.shared_expert_intermediate_size // tp)
        else:
            proj(3 * h, mc.intermediate_size // tp)
    scales = -(-projections // _FP8_BLOCK) * _FP32 if weight_format == "fp8" else 0
    return WeightBytes(projections * per_weight + scales, other * _BF16)


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """One rank's memory on a GPU of ``gpu_bytes``, as the engine would size it.

    Args:
        weights: The weights this rank holds.
        gpu_bytes / reserve_bytes: The GPU's memory, and what is taken before the pools are
            sized besides the weights (CUDA context, buffers).
        pool_budget: ``memory_fraction`` of the memory free after the weights (0 when they do
            not fit).
        num_pages / num_slots: What the budget buys (or the explicit sizes).
        page_bytes / slot_bytes: One KV page, one state slot, on this rank.
        page_size: Tokens per page.
    """

    weights: WeightBytes
    gpu_bytes: int
    reserve_bytes: int
    pool_budget: int
    num_pages: int
    num_slots: int
    page_bytes: int
    slot_bytes: int
    page_size: int

    @property
    def fits(self) -> bool:
        """The weights fit and the pools hold at least 2 pages and 2 slots (``plan_pools``'s
        minimum), within the GPU."""
        used = self.weights.total + self.reserve_bytes + self.kv_bytes + self.state_bytes
        return self.num_pages >= 2 and self.num_slots >= 2 and used <= self.gpu_bytes

    @property
    def kv_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def state_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the page pool holds (over all sequences and cached prefixes)."""
        return self.num_pages * self.page_size


def estimate_memory(mc: ModelConfig, cc: CacheConfig, *, gpu_bytes: int, tp_size: int = 1,
                    weight_format: str = "bf16", expert_parallel: bool = False, reserve_bytes: int = 1 << 30,
                    cache_element_size: int = _BF16) -> MemoryEstimate:
    """One rank's weights and pools of ``mc`` at ``tp_size`` on a GPU of ``gpu_bytes``: the
    pool budget is ``cc.memory_fraction`` of what the weights and ``reserve_bytes`` leave free
    (what ``plan_pools`` reads from the device after loading), split as ``plan_pools`` splits it.
    KV pages take ``cache_element_size`` bytes per element, or 1 with ``cc.kv_cache_dtype`` fp8.

    Raises:
        ValueError: an unknown ``weight_format``, or ``tp_size`` does not divide the model's
            heads (or experts, with ``expert_parallel``).
    """
    for name, count in (("num_attention_heads", mc.num_attention_heads),
                        ("linear_num_key_heads", mc.linear_num_key_heads),
                        ("num_experts", mc.num_experts if expert_parallel else 0)):
        if count % tp_size:
            raise ValueError(f"tp: {tp_size} does not divide the model's {name}={count}")
    weights = weight_bytes(mc, tp_size, weight_format, expert_parallel)
    free = gpu_bytes - weights.total - reserve_bytes
    budget = max(0, int(free * cc.memory_fraction))
    kv_element_size = 1 if cc.kv_cache_dtype == "fp8_e4m3" else cache_element_size
    page = max(1, kv_page_bytes(mc, cc.page_size, kv_element_size, tp_size))
    slot = max(1, state_slot_bytes(mc, cache_element_size, tp_size))
    num_pages, num_slots = split_budget(budget, cc, page, slot)
    return MemoryEstimate(weights, gpu_bytes, reserve_bytes, budget, num_pages, num_slots, page, slot, cc.page_size)

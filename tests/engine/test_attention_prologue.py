"""The gated attention layer of a decode step with the Triton decode plan: its prologue (QK norm,
RoPE, gate, KV write) run by the attention's split launch (``TritonDecodePlan.prologue``, the
default; ``PHLOEM_ATTN_PROLOGUE=0`` turns it off) against the same layer with the prologue run
first, and against the torch reference attention. On CPU the Triton kernels run under the
interpreter, in fp32."""

from __future__ import annotations

import torch

from phloem.engine.config import ModelConfig
from phloem.engine.forward_batch import ForwardBatch
from phloem.engine.models._attention import GatedAttention
from phloem.engine.parallel import TPGroup
from phloem.kernels.attention.flashinfer import TritonDecodePlan, page_indices
from phloem.kernels.attention.rope import rope_inv_freq
from phloem.kernels.dispatch import get_ops

CPU = torch.device("cpu")
PAGE = 4


def _config() -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3_5ForCausalLM", vocab_size=64, hidden_size=32,
        layer_types=("full_attention",), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=512,
        linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=1, linear_value_head_dim=1,
        linear_conv_kernel_dim=2,
    )  # fmt: skip


def _layer(config: ModelConfig) -> GatedAttention:
    torch.manual_seed(0)
    layer = GatedAttention(config, get_ops(CPU), TPGroup(0, 1, CPU))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 1.0))
    return layer


def _step(seq_lens: list[int], plan_prologue: bool | None) -> tuple[ForwardBatch, torch.Tensor]:
    """A decode step over random histories on shuffled pages; ``plan_prologue`` None: no plan (the
    torch reference attention)."""
    gen = torch.Generator().manual_seed(1)
    pages_used = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(sum(pages_used), generator=gen).tolist()
    page_ids = []
    for used in pages_used:
        page_ids.append(order[:used])
        order = order[used:]
    kv_cache = torch.randn(sum(pages_used), 2, PAGE, 2, 16, generator=gen)
    slots = [ids[(n - 1) // PAGE] * PAGE + (n - 1) % PAGE for ids, n in zip(page_ids, seq_lens)]
    page_table = torch.zeros(len(seq_lens), max(pages_used), dtype=torch.int32)
    for i, ids in enumerate(page_ids):
        page_table[i, : len(ids)] = torch.tensor(ids)
    plan = None
    if plan_prologue is not None:
        plan = TritonDecodePlan(*page_indices(page_ids, seq_lens, PAGE), 16**-0.5, plan_prologue)
    n = len(seq_lens)
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64), positions=torch.tensor(seq_lens) - 1,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        page_table=page_table, slot_mapping=torch.tensor(slots), read_slots=torch.zeros(n, dtype=torch.int64),
        write_slots=torch.zeros(n, dtype=torch.int64), has_initial_state=torch.zeros(n, dtype=torch.bool),
        logits_indices=torch.arange(n), query_lens_cpu=(1,) * n, is_decode=True, attn_metadata=plan,
    )  # fmt: skip
    return batch, kv_cache


def test_prologue_in_the_split_launch_gives_the_layers_output() -> None:
    config = _config()
    layer = _layer(config)
    hidden = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(2))
    inv_freq = rope_inv_freq(8, config.rope_theta)
    seq_lens = [5, 1, 21]
    results = {}
    for prologue in (None, False, True):
        batch, kv_cache = _step(seq_lens, prologue)
        before = kv_cache.clone()
        with torch.no_grad():
            out = layer.forward(hidden, batch, kv_cache, inv_freq)
        results[prologue] = out, kv_cache
    # The step wrote its K and V rows (one page slot per sequence, both planes) and nothing else.
    written = (kv_cache != before).any(dim=(1, 3, 4))  # [pages, page offset]
    assert sorted((p * PAGE + o) for p, o in written.nonzero().tolist()) == sorted(batch.slot_mapping.tolist())
    fused, fused_cache = results[True]
    # On CPU the layer's own prologue is the torch reference op: equal up to fp32 rounding.
    for other, other_cache in (results[False], results[None]):
        torch.testing.assert_close(fused_cache, other_cache, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fused, other, atol=1e-5, rtol=1e-5)

"""A toy model whose answer is known in closed form, to drive the engine loop in tests.

The toy model keeps a running sum of the tokens in its GDN state slot and writes every token into
its KV pages; on each forward it re-reads the whole history back through the page table and checks
it against the state. Its next token is ``sum(history) % vocab``. So a wrong page table, slot
mapping, read/write slot, chunk boundary, tail-page copy or preemption shows up as a wrong token or
an assertion.
"""

from __future__ import annotations

import torch

from phloem.engine import Engine
from phloem.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from phloem.engine.forward_batch import ForwardBatch, ModelCaches

VOCAB = 97
# Distinct first tokens, lengths across page and chunk boundaries (async-scheduling tests).
PROMPTS_FOR_PIPELINE = [[3], [1, 2, 3, 4, 5], list(range(10, 40)), [7] * 4, [9, 8], list(range(50, 63)), [11] * 17]


def toy_config(eos: tuple[int, ...] = ()) -> ModelConfig:
    return ModelConfig(
        architecture="Qwen3_5ForCausalLM",
        vocab_size=VOCAB,
        hidden_size=1,
        layer_types=("linear_attention", "full_attention"),
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=1,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        partial_rotary_factor=1.0,
        max_position_embeddings=512,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=1,
        linear_value_head_dim=1,
        linear_conv_kernel_dim=2,
        eos_token_ids=eos,
    )


class ToyModel:
    def __init__(self) -> None:
        self.num_forwards = 0

    def forward(self, batch: ForwardBatch, caches: ModelCaches) -> torch.Tensor:
        self.num_forwards += 1
        kv, ssm = caches.kv[0], caches.ssm[0]
        page_size = kv.shape[2]
        hidden = torch.empty(batch.num_tokens, 1)
        kv[batch.slot_mapping // page_size, 0, batch.slot_mapping % page_size, 0, 0] = batch.input_ids.float()
        qsl = batch.query_start_loc.tolist()
        for i in range(batch.num_seqs):
            state = ssm[batch.read_slots[i], 0, 0, 0].item() if batch.has_initial_state[i] else 0.0
            toks = batch.input_ids[qsl[i] : qsl[i + 1]].double()
            running = state + toks.cumsum(0)
            hidden[qsl[i] : qsl[i + 1], 0] = running.float()
            ssm[batch.write_slots[i], 0, 0, 0] = running[-1].item()
            seq_len = int(batch.seq_lens[i])
            pages = batch.page_table[i, : -(-seq_len // page_size)].long()
            history = kv[pages, 0, :, 0, 0].reshape(-1)[:seq_len]
            assert history.double().sum().item() == running[-1].item(), "KV pages disagree with GDN state"
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        target = hidden[:, 0].long() % VOCAB
        return -(torch.arange(VOCAB)[None, :] - target[:, None]).abs().float()


def expected(prompt: list[int], n: int, stop: set[int] = frozenset()) -> list[int]:
    toks, out = list(prompt), []
    for _ in range(n):
        t = sum(toks) % VOCAB
        out.append(t)
        toks.append(t)
        if t in stop:
            break
    return out


def make_engine(
    num_pages: int = 64,
    num_slots: int = 16,
    budget: int = 32,
    max_seqs: int = 8,
    caching: bool = True,
    interval: int = 0,
    async_scheduling: bool = True,
    prompt_end_split_min_tokens: int = 256,
    # Toy prompts are tens of tokens: a margin of 1 (not the engine's 256) lets turns take seats.
    seat_yield_min_tokens: int | None = 1,
    **mc,
) -> Engine:
    return Engine(
        toy_config(**mc),
        ToyModel(),
        EngineConfig(
            cache=CacheConfig(
                page_size=4,
                num_pages=num_pages,
                num_state_slots=num_slots,
                enable_prefix_caching=caching,
                checkpoint_interval=interval,
                prompt_end_split_min_tokens=prompt_end_split_min_tokens,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=budget, max_num_seqs=max_seqs, async_scheduling=async_scheduling,
                seat_yield_min_tokens=seat_yield_min_tokens,
            ),
        ),
        torch.device("cpu"),
        torch.float32,
    )


def assert_pools_empty(engine: Engine) -> None:
    """Every page and slot is free once the radix cache is emptied (exact counts)."""
    if engine.cache.tree is not None:
        engine.cache.tree.clear()
        assert engine.cache.tree.num_pages == 0 and engine.cache.tree.num_checkpoints == 0
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages
    assert engine.slot_pool.num_free_slots == engine.slot_pool.num_slots


POISON = 1000  # a running sum that makes the padded model pick an id past the vocabulary


class PaddedModel(ToyModel):
    """The toy model with two logit columns past ``VOCAB``; the first wins once a sequence's
    running sum reaches ``POISON``."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        pad = torch.full((logits.shape[0], 2), -1e9)
        pad[hidden[:, 0] >= POISON, 0] = 1.0
        return torch.cat([logits, pad], dim=1)


def padded_engine(async_scheduling: bool = True) -> Engine:
    """A toy engine on ``PaddedModel``."""
    engine = make_engine(async_scheduling=async_scheduling)
    engine.runner.model = PaddedModel()
    return engine

"""The engine loop driven by a toy model whose answer is known in closed form.

The toy model keeps a running sum of the tokens in its GDN state slot and writes every token into
its KV pages; on each forward it re-reads the whole history back through the page table and checks
it against the state. Its next token is ``sum(history) % vocab``. So a wrong page table, slot
mapping, read/write slot, chunk boundary or preemption shows up as a wrong token or an assertion.
"""

from __future__ import annotations

import pytest
import torch

from phloem.engine import CapacityExceeded, Engine, InvalidRequest, SamplingParams
from phloem.engine.config import CacheConfig, ModelConfig, SchedulerConfig
from phloem.engine.forward_batch import ForwardBatch, ModelCaches

VOCAB = 97


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


def make_engine(num_pages: int = 64, num_slots: int = 16, budget: int = 32, max_seqs: int = 8, **mc) -> Engine:
    return Engine(
        toy_config(**mc),
        ToyModel(),
        CacheConfig(page_size=4, num_pages=num_pages, num_state_slots=num_slots),
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        torch.device("cpu"),
        torch.float32,
    )


def assert_pools_empty(engine: Engine) -> None:
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages
    assert engine.slot_pool.num_free_slots == engine.slot_pool.num_slots


PROMPTS = [[3], [1, 2, 3, 4, 5], list(range(1, 40)), [7] * 4, [9, 8], list(range(50, 63)), [11] * 17, [5, 6, 7]]


def test_batched_equals_alone_and_closed_form() -> None:
    params = SamplingParams(max_tokens=12)
    batched = make_engine().generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, batched):
        alone = make_engine().generate([prompt], params)[0]
        assert out.token_ids == alone.token_ids == expected(prompt, 12)
        assert out.finish_reason == "length"


def test_long_prompt_is_chunked() -> None:
    engine = make_engine(budget=8)
    out = engine.generate([list(range(1, 40))], SamplingParams(max_tokens=3))[0]
    assert out.token_ids == expected(list(range(1, 40)), 3)
    # 39 prompt tokens in chunks of <= 8 → 5 prefill steps, then 2 decode steps.
    assert engine.runner.model.num_forwards == 5 + 2


def test_pools_return_to_full_after_every_request() -> None:
    engine = make_engine()
    engine.generate(PROMPTS, SamplingParams(max_tokens=9))
    assert_pools_empty(engine)
    engine.generate(PROMPTS[:3], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=30), SamplingParams(max_tokens=2)])
    assert_pools_empty(engine)


def test_preemption_recomputes_to_the_same_tokens() -> None:
    # 10 pages of 4 tokens cannot hold 8 requests growing to ~20 tokens: preemption must happen.
    engine = make_engine(num_pages=10, num_slots=8, budget=64)
    prompts = [[i + 1] * 5 for i in range(8)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=14))
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == expected(prompt, 14)
    assert_pools_empty(engine)


def test_slot_shortage_queues_instead_of_failing() -> None:
    engine = make_engine(num_slots=2)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in outs] == [expected(p, 4) for p in PROMPTS]
    assert_pools_empty(engine)


def test_stop_tokens_eos_and_ignore_eos() -> None:
    prompt = [1, 2, 3]
    free_run = expected(prompt, 10)
    stop = free_run[3]
    out = make_engine().generate([prompt], SamplingParams(max_tokens=10, stop_token_ids=(stop,)))[0]
    assert out.token_ids == free_run[: free_run.index(stop) + 1] and out.finish_reason == "stop"
    eos_engine = make_engine(eos=(stop,))
    assert eos_engine.generate([prompt], SamplingParams(max_tokens=10))[0].finish_reason == "stop"
    ignored = eos_engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert ignored.token_ids == free_run and ignored.finish_reason == "length"


@pytest.mark.parametrize(
    ("prompt", "field"),
    [([], "prompt_token_ids"), ([1, VOCAB], "prompt_token_ids"), ([-1], "prompt_token_ids"), ([1] * 512, "prompt_token_ids")],
    ids=["empty", "out-of-vocab", "negative", "over-context"],
)
def test_bad_prompts_raise_and_engine_keeps_serving(prompt: list[int], field: str) -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequest, match=field):
        engine.generate([[1, 2], prompt], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests(), "a rejected batch must enqueue nothing"
    assert engine.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids == expected([1, 2], 2)
    assert_pools_empty(engine)


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_max_tokens_must_be_positive(max_tokens: int) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=max_tokens)


def test_prompt_larger_than_the_pool_is_a_capacity_error() -> None:
    engine = make_engine(num_pages=4)
    with pytest.raises(CapacityExceeded, match="KV pages"):
        engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=1))
    assert engine.generate([[1]], SamplingParams(max_tokens=3))[0].token_ids == expected([1], 3)


def test_abort_frees_memory() -> None:
    engine = make_engine()
    rid = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.page_pool.num_used_pages > 0
    assert engine.abort_request(rid)
    assert not engine.abort_request(rid)
    assert_pools_empty(engine)
    assert not engine.has_unfinished_requests()

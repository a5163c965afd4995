"""Prefill/decode transfer inside the engine: reserve, install, release; the prefill side's first
token; continuing after it. Engine to engine, no network (``test_kv_transfer_dist.py`` covers the
wire, ``tests/runtime/test_pd.py`` two processes).

The toy model re-reads every request's whole KV history through its page table on each forward
and checks it against the GDN state, so a wrongly installed page or slot fails loudly; its tokens
have a closed form (``expected``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from toy_model import assert_pools_empty, expected, make_engine

from phloem.engine import CacheConfig, Engine, InvalidRequest, SamplingParams
from phloem.engine.transfer.pool_side import TransferReservation

GREEDY = SamplingParams(max_tokens=6)


def run(engine: Engine, rid: str) -> tuple[list[int], str | None, int]:
    """Step until ``rid`` finishes (and the turn-end checkpoints land); its tokens, reason, cached count."""
    final = None
    while final is None or engine.scheduler.num_finalizing():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    return final.token_ids, final.finish_reason, final.num_cached_tokens


def prefill(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[int, int]:
    """What the prefill instance does: compute ``prompt``, sample its first token."""
    rid = engine.add_request(prompt, params, prefill_only=True, sample_first=True)
    tokens, reason, cached = run(engine, rid)
    assert reason == "prefill" and len(tokens) == 1
    return tokens[0], cached


def ship(src: Engine, dst: Engine, res: TransferReservation) -> None:
    """Copy the prompt's state from ``src``'s cache into ``dst``'s reservation (the transport's job)."""
    source = src.transfer_source(list(res.token_ids), res.first_page)
    assert source is not None and len(source.pages) == len(res.pages)
    kv = source.whole()[0]
    conv, ssm = source.state()
    dst.install_transfer(res, kv, conv, ssm)


def free_counts(engine: Engine) -> tuple[int, int]:
    return engine.page_pool.num_free_pages, engine.slot_pool.num_free_slots


def test_prefill_only_can_sample_its_first_token_and_publishes_the_prompt_end() -> None:
    engine = make_engine()
    prompt = list(range(1, 11))
    first, cached = prefill(engine, prompt)
    assert (first, cached) == (expected(prompt, 1)[0], 0)
    # The checkpoint covers the prompt, not the sampled token: a request on prompt + [first] hits it.
    assert engine.cached_prefix_len(prompt + [first]) == len(prompt)
    assert_pools_empty(engine)


@pytest.mark.parametrize(
    ("held", "prompt_len"),
    [(0, 1), (0, 13), (0, 16), (6, 13), (8, 22), (12, 12 + 1)],
    ids=["one-token", "fresh-mid-page", "fresh-aligned", "held-mid-page", "held-aligned", "one-new-token"],
)
def test_transfer_installs_into_the_reservation_and_decoding_continues(held: int, prompt_len: int) -> None:
    prompt = [(5 * i + 2) % 90 + 1 for i in range(prompt_len)]
    prefill_engine, decode_engine = make_engine(), make_engine()
    if held:
        # The decode side holds a checkpoint at ``held`` (an earlier prompt-only turn).
        run(decode_engine, decode_engine.add_request(prompt[:held], GREEDY, prefill_only=True))
    start = free_counts(decode_engine)
    res = decode_engine.reserve_transfer(prompt, GREEDY)
    assert res is not None and res.held_len == held and res.first_page == held // 4
    assert len(res.pages) == -(-prompt_len // 4) - held // 4
    first, _ = prefill(prefill_engine, prompt)
    ship(prefill_engine, decode_engine, res)
    assert decode_engine.cached_prefix_len(prompt + [first]) == prompt_len
    rid = decode_engine.add_request(prompt, GREEDY, output_token_ids=[first])
    tokens, reason, cached = run(decode_engine, rid)
    assert tokens == expected(prompt, GREEDY.max_tokens) and reason == "length" and cached == prompt_len
    assert free_counts(decode_engine) != start  # the transferred prompt is cached now
    assert_pools_empty(decode_engine)
    assert_pools_empty(prefill_engine)


def test_release_gives_back_pages_slot_and_the_held_prefix() -> None:
    engine = make_engine()
    prompt = list(range(1, 30))
    run(engine, engine.add_request(prompt[:10], GREEDY, prefill_only=True))
    start = free_counts(engine)
    res = engine.reserve_transfer(prompt, GREEDY)
    assert res is not None and res.held_len == 10
    assert free_counts(engine) == (start[0] - len(res.pages), start[1] - 1)
    engine.cache.tree.clear()  # the held prefix is locked: it survives
    assert engine.cached_prefix_len(prompt) == 10
    engine.release_transfer(res)
    engine.release_transfer(res)  # idempotent
    assert_pools_empty(engine)  # unlocked: clear() now frees the held prefix too


def test_install_checks_shapes_and_takes_nothing_on_a_mismatch() -> None:
    engine = make_engine()
    prompt = list(range(1, 10))
    start = free_counts(engine)
    res = engine.reserve_transfer(prompt, GREEDY)
    assert res is not None
    caches = engine.runner.caches
    kv = torch.zeros(caches.kv.shape[0], len(res.pages) + 1, *caches.kv.shape[2:])
    with pytest.raises(ValueError, match="transfer: expected kv"):
        engine.install_transfer(res, kv, caches.conv[:, 0].clone(), caches.ssm[:, 0].clone())
    assert engine.cached_prefix_len(prompt + [1]) == 0
    engine.release_transfer(res)
    assert free_counts(engine) == start


def test_reserve_declines_few_uncached_tokens_or_no_room_and_validates() -> None:
    engine = make_engine(num_pages=8)
    prompt = list(range(1, 20))
    run(engine, engine.add_request(prompt[:16], GREEDY, prefill_only=True))
    start = free_counts(engine)
    assert engine.reserve_transfer(prompt, GREEDY, local_up_to=3) is None  # 3 past the held 16: compute here
    fresh = engine.reserve_transfer(list(range(60, 63)), GREEDY, local_up_to=3)  # nothing held: transfer
    assert fresh is not None
    engine.release_transfer(fresh)
    other = engine.reserve_transfer(list(range(50, 66)), GREEDY)  # takes the 4 pages the tree leaves
    assert other is not None and free_counts(engine)[0] == 0
    # It would need 4 pages: none is free, and the tree's are the locked held prefix.
    assert engine.reserve_transfer(list(range(1, 30)), GREEDY) is None
    engine.release_transfer(other)
    assert free_counts(engine) == start
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        engine.reserve_transfer([], GREEDY)
    assert_pools_empty(engine)


def test_output_token_ids_are_validated() -> None:
    engine = make_engine()
    with pytest.raises(InvalidRequest, match="output_token_ids"):
        engine.add_request([1, 2], GREEDY, output_token_ids=[500])
    with pytest.raises(InvalidRequest, match="nothing is left to generate"):
        engine.add_request([1, 2], SamplingParams(max_tokens=1), output_token_ids=[3])
    with pytest.raises(InvalidRequest, match="sample_first"):
        engine.add_request([1, 2], GREEDY, sample_first=True)
    assert_pools_empty(engine)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=7), SamplingParams(max_tokens=7, temperature=0.9, top_p=0.9, seed=11)],
    ids=["greedy", "seeded"],
)
def test_first_token_from_prefill_then_continuation_equals_one_engine(
    tiny_checkpoint: Callable[..., Path], params: SamplingParams
) -> None:
    options = dict(cache=CacheConfig(page_size=16, num_pages=64, num_state_slots=8, checkpoint_interval=0))
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    prompt = [(11 * i + 5) % 256 for i in range(37)]
    reference = Engine.from_pretrained(path, **options).generate([prompt], params)[0].token_ids
    prefill_engine, decode_engine = (Engine.from_pretrained(path, **options) for _ in range(2))
    res = decode_engine.reserve_transfer(prompt, params)
    assert res is not None
    first, _ = prefill(prefill_engine, prompt, params)
    ship(prefill_engine, decode_engine, res)
    tokens, _, cached = run(decode_engine, decode_engine.add_request(prompt, params, output_token_ids=[first]))
    assert tokens == reference and cached == len(prompt)

"""Radix prefix cache on the toy model: exact hit counts, copy-on-write, periodic checkpoints, eviction.

The toy model (tests/support/toy_model.py) re-reads the whole KV history through the page table on
every step and checks it against the GDN state slot, so any wrong page, tail copy, or slot shows
up as an assertion or a wrong token.
"""

from __future__ import annotations

import pytest

from toy_model import assert_pools_empty, expected, make_engine

from phloem.engine import SamplingParams


def test_twelve_turn_conversation_computes_only_new_tokens() -> None:
    engine = make_engine(num_pages=128, budget=64)
    history: list[int] = list(range(1, 42))  # a long first turn
    outputs_per_turn = 5
    for turn in range(12):
        out = engine.generate([history], SamplingParams(max_tokens=outputs_per_turn))[0]
        assert out.token_ids == expected(history, outputs_per_turn)
        # From turn 2 on, everything before this turn's new tokens comes from the cache.
        assert out.num_cached_tokens == (0 if turn == 0 else len(history) - 3)
        history = history + out.token_ids + [turn + 1, turn + 2, turn + 3]  # tool result appended
    stats = engine.cache_stats()
    # A turn-end and a prompt-end checkpoint per turn; the 16 slots keep the most recent.
    assert stats.checkpoints_created == 24 and stats.checkpoints + stats.checkpoints_evicted == 24
    assert_pools_empty(engine)


@pytest.mark.parametrize("prompt_len", [7, 8], ids=["mid-page", "page-boundary"])
def test_prompt_end_checkpoint_serves_a_retried_turn(prompt_len: int) -> None:
    """Resending the prompt with another continuation hits the prompt-end checkpoint; mid-page,
    the tree's tail is a copy, so the first request's later writes to its page do not leak in."""
    engine = make_engine()
    prompt = list(range(3, 3 + prompt_len))
    first = engine.generate([prompt], SamplingParams(max_tokens=6))[0]
    retry = prompt + [(first.token_ids[0] + 1) % 97, 50]
    out = engine.generate([retry], SamplingParams(max_tokens=4))[0]
    # A fresh prompt's prompt-end checkpoint sits one token before its end (issue 48: a resend
    # of the same prompt then needs only that token's logits), so it serves all but one token.
    assert out.num_cached_tokens == prompt_len - 1
    assert out.token_ids == expected(retry, 4)
    assert_pools_empty(engine)


def test_hit_mid_page_copies_only_the_tail_page() -> None:
    engine = make_engine()
    prompt = [5, 6, 7, 8, 9, 10, 11]  # 7 + 3 outputs = 10 tokens: checkpoint mid-page (page size 4)
    first = engine.generate([prompt], SamplingParams(max_tokens=3))[0]
    conv = prompt + first.token_ids
    tail = engine.cache.tree.match(conv + [1], 100).checkpoint.tail_page
    before = engine.runner.caches.kv[:, tail].clone()
    # Two branches continue the same conversation: both copy the tail, neither writes into it.
    branches = [conv + [1, 2], conv + [3]]
    outs = engine.generate(branches, SamplingParams(max_tokens=6))
    for b, o in zip(branches, outs):
        assert o.token_ids == expected(b, 6) and o.num_cached_tokens == len(conv)
    assert engine.runner.caches.kv[:, tail].equal(before)
    assert_pools_empty(engine)


def test_hit_on_a_page_boundary() -> None:
    engine = make_engine()
    prompt = [1, 2, 3, 4, 5]  # 5 + 3 outputs = 8 tokens = two full pages, no tail
    first = engine.generate([prompt], SamplingParams(max_tokens=3))[0]
    conv = prompt + first.token_ids
    assert engine.cache.tree.match(conv + [9], 100).checkpoint.tail_page is None
    out = engine.generate([conv + [9]], SamplingParams(max_tokens=4))[0]
    assert out.token_ids == expected(conv + [9], 4) and out.num_cached_tokens == 8


def test_periodic_checkpoints_serve_a_shared_prefix() -> None:
    engine = make_engine(budget=64, interval=8)
    shared = list(range(10, 30))  # 20 tokens: checkpoints at 8 and 16
    a = engine.generate([shared + [1, 2, 3]], SamplingParams(max_tokens=2))[0]
    b = engine.generate([shared + [7]], SamplingParams(max_tokens=4))[0]
    assert a.token_ids == expected(shared + [1, 2, 3], 2)
    assert b.token_ids == expected(shared + [7], 4) and b.num_cached_tokens == 16
    assert_pools_empty(engine)


def test_a_resumed_turn_crossing_an_interval_runs_in_one_step() -> None:
    """An agent's next turn resumes from its cached conversation; its new tokens cross a multiple
    of the interval but are not cut there (``engine.scheduler``): one prefill step, and the
    prompt-end checkpoint stands in for the periodic one. A fresh prompt is still cut."""
    engine = make_engine(budget=64, interval=8)
    first = [5, 6, 7, 8, 9]
    conv = first + engine.generate([first], SamplingParams(max_tokens=2))[0].token_ids  # 7 tokens
    turn = conv + [3, 1, 4, 1, 5, 9]  # new tokens at positions 7..12, across 8
    before = engine.runner.model.num_forwards
    out = engine.generate([turn], SamplingParams(max_tokens=1))[0]
    assert out.num_cached_tokens == len(conv) and out.token_ids == expected(turn, 1)
    assert engine.runner.model.num_forwards - before == 2, "one prefill step and the turn-end finalize"
    # No checkpoint at 8: a prompt diverging at 9 resumes from the previous turn's end.
    probe = engine.generate([turn[:9] + [2]], SamplingParams(max_tokens=3))[0]
    assert probe.num_cached_tokens == len(conv) and probe.token_ids == expected(turn[:9] + [2], 3)
    nxt = engine.generate([turn + out.token_ids + [6]], SamplingParams(max_tokens=3))[0]
    assert nxt.num_cached_tokens == len(turn) + 1 and nxt.token_ids == expected(turn + out.token_ids + [6], 3)
    before = engine.runner.model.num_forwards
    engine.generate([list(range(30, 43))], SamplingParams(max_tokens=1))  # fresh, 13 tokens
    # Issue 48: a fresh prompt is also cut one token before its end (its prompt-end checkpoint).
    assert engine.runner.model.num_forwards - before == 4, "cut at 8, cut at 12, the last token, the finalize"
    assert_pools_empty(engine)


def test_concurrent_requests_sharing_a_prefix_publish_once() -> None:
    engine = make_engine(budget=64, interval=8)
    shared = list(range(40, 64))
    prompts = [shared + [1], shared + [2, 3], shared + [4, 5, 6]]
    outs = engine.generate(prompts, SamplingParams(max_tokens=5))
    assert [o.token_ids for o in outs] == [expected(p, 5) for p in prompts]
    # The three computed the shared 24 tokens side by side; the tree keeps one copy of each page.
    shared_node = engine.cache.tree.match(shared + [0], 24).node
    assert shared_node.depth == 24
    assert_pools_empty(engine)


def test_eviction_keeps_pinned_paths_and_recomputes_the_rest() -> None:
    # 24 pages of 4 tokens, 6 slots: ten conversations cannot all stay cached.
    engine = make_engine(num_pages=24, num_slots=6, budget=64)
    pinned_prompt = [3] * 9
    first = engine.generate([pinned_prompt], SamplingParams(max_tokens=3))[0]
    pinned_conv = pinned_prompt + first.token_ids
    node = engine.cache.tree.match(pinned_conv + [0], 100).node
    engine.cache.tree.lock(node)
    others = [[i + 10] * 9 for i in range(10)]
    for p in others:
        assert engine.generate([p], SamplingParams(max_tokens=3))[0].token_ids == expected(p, 3)
    assert engine.cache_stats().checkpoints_evicted > 0
    # The pinned conversation is still a full hit; an evicted one is recomputed correctly.
    hit = engine.generate([pinned_conv + [1]], SamplingParams(max_tokens=2))[0]
    assert hit.num_cached_tokens == len(pinned_conv) and hit.token_ids == expected(pinned_conv + [1], 2)
    again = engine.generate([others[0]], SamplingParams(max_tokens=3))[0]
    assert again.token_ids == expected(others[0], 3)
    engine.cache.tree.unlock(node)
    assert_pools_empty(engine)


def test_preemption_with_cache_resumes_from_published_prefix() -> None:
    engine = make_engine(num_pages=12, num_slots=8, budget=64)
    prompts = [[i + 1] * 6 for i in range(6)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [expected(p, 12) for p in prompts]
    assert_pools_empty(engine)


def test_cache_disabled_never_hits() -> None:
    engine = make_engine(caching=False)
    conv = [1, 2, 3]
    out = engine.generate([conv], SamplingParams(max_tokens=3))[0]
    again = engine.generate([conv + out.token_ids + [4]], SamplingParams(max_tokens=3))[0]
    assert again.num_cached_tokens == 0 and again.token_ids == expected(conv + out.token_ids + [4], 3)


def test_next_turn_added_while_previous_is_finalizing_still_hits() -> None:
    engine = make_engine()
    prompt = [2, 4, 6, 8, 10]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3))
    outputs = []
    while not (outputs and outputs[-1].finished):
        outputs += [o for o in engine.step() if o.request_id == rid]
    # The caller sees the turn finished; its checkpoint lands on the next step.
    nxt = prompt + outputs[-1].token_ids + [1]
    engine.add_request(nxt, SamplingParams(max_tokens=2), request_id="turn-2")
    done = []
    while not done:
        done = [o for o in engine.step() if o.request_id == "turn-2" and o.finished]
    assert done[0].num_cached_tokens == len(nxt) - 1 and done[0].token_ids == expected(nxt, 2)


def test_pin_prefix_survives_eviction() -> None:
    engine = make_engine(num_pages=16, num_slots=4, budget=64)
    conv = [7] * 6
    conv += engine.generate([conv], SamplingParams(max_tokens=2))[0].token_ids
    handle = engine.pin_prefix(conv)
    assert handle is not None and handle.depth == len(conv)
    for i in range(6):
        engine.generate([[i + 20] * 7], SamplingParams(max_tokens=2))
    assert engine.cached_prefix_len(conv + [1]) == len(conv)
    engine.unpin_prefix(handle)
    assert_pools_empty(engine)


def test_prefill_only_request_publishes_its_prompt_and_samples_nothing() -> None:
    engine = make_engine()
    prompt = list(range(1, 23))  # 22 tokens: a mid-page checkpoint
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1), prefill_only=True)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished and outs[-1].finish_reason == "prefill" and outs[-1].token_ids == []
    assert engine.cached_prefix_len(prompt + [5]) == len(prompt)
    nxt = engine.generate([prompt + [5]], SamplingParams(max_tokens=4))[0]
    assert nxt.num_cached_tokens == len(prompt) and nxt.token_ids == expected(prompt + [5], 4)
    assert_pools_empty(engine)


def test_common_prefix_matches_the_element_walk() -> None:
    """The block-wise comparison the tree's insert uses, against the element-by-element walk."""
    import random

    from phloem.engine.cache.radix import _common_prefix

    rng = random.Random(0)
    for _ in range(500):
        key = [rng.randrange(3) for _ in range(rng.randrange(0, 3000))]
        start = rng.randrange(0, 40)
        tokens = [rng.randrange(3) for _ in range(start)] + key[: rng.randrange(0, len(key) + 1)]
        tokens += [rng.randrange(3) for _ in range(rng.randrange(0, 2000))]
        want = 0
        while want < min(len(key), len(tokens) - start) and key[want] == tokens[start + want]:
            want += 1
        assert _common_prefix(key, tokens, start) == want


def test_a_hit_a_preemption_lost_is_not_reported_as_cached() -> None:
    """A request admitted on a cached prefix, preempted, and admitted again after the cache
    evicted that prefix computed it after all: its output reports only what the cache served
    (the sessions layer counts the rest as recomputed), and the engine's hit count agrees."""
    engine = make_engine(async_scheduling=False)
    history = list(range(1, 21))
    engine.generate([history], SamplingParams(max_tokens=2))
    prompt = history + [5, 6, 7]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3))
    engine.step()
    (req,) = engine.scheduler.running
    first_hit = req.num_cached_tokens
    assert first_hit > 0 and engine.cache.cached_tokens == first_hit
    engine.scheduler._preempt(req)  # as for pages a peer's decode needed
    engine.cache.tree.clear()  # and the cache evicted everything unlocked meanwhile
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].token_ids == expected(prompt, 3)
    assert outs[-1].num_cached_tokens == 0 and engine.cache.cached_tokens == 0
    assert_pools_empty(engine)

"""Turn-end holds: a session's finished turn stays in the prefix cache until its pin takes it.

Between a request's end and its session's pin the turn-end checkpoint would be unlocked: under
memory pressure eviction takes it first and the session's next turn recomputes everything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from phloem.engine import CacheConfig, Engine, SamplingParams

CACHE = CacheConfig(page_size=16, num_pages=64, num_state_slots=8, checkpoint_interval=0)


def finish_turn(engine: Engine, prompt: list[int], hold: bool) -> list[int]:
    """Run ``prompt`` to its end (turn-end checkpoint published); returns the conversation."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), hold_turn_end=hold)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens = out.token_ids
    return prompt + tokens


def test_a_held_turn_end_survives_eviction_until_pinned_then_the_pin_takes_it(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), cache=CACHE)
    tree = engine.cache.tree
    plain = finish_turn(engine, list(range(30, 70)), hold=False)
    held = finish_turn(engine, list(range(100, 140)), hold=True)
    tree.clear()  # memory pressure: every unlocked node goes
    assert engine.cached_prefix_len([*plain, 1]) == 0
    assert engine.cached_prefix_len([*held, 1]) == len(held)
    assert len(engine.cache.holds) == 1

    handle = engine.pin_prefix(held)
    assert handle is not None and len(engine.cache.holds) == 0  # the pin took the hold over
    tree.clear()
    assert engine.cached_prefix_len([*held, 1]) == len(held)
    engine.unpin_prefix(handle)
    tree.clear()
    assert engine.cached_prefix_len([*held, 1]) == 0  # one lock, not two: nothing leaked
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages
    assert engine.slot_pool.num_free_slots == engine.slot_pool.num_slots


def test_a_hold_no_pin_claims_expires(tiny_checkpoint: Callable[..., Path]) -> None:
    cache = CacheConfig(page_size=16, num_pages=64, num_state_slots=8, checkpoint_interval=0, handoff_hold_s=0.2)
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), cache=cache)
    held = finish_turn(engine, list(range(100, 140)), hold=True)
    engine.cache.tree.clear()
    assert engine.cached_prefix_len([*held, 1]) == len(held)
    time.sleep(0.25)
    engine.step()  # expires holds past their time
    assert len(engine.cache.holds) == 0
    engine.cache.tree.clear()
    assert engine.cached_prefix_len([*held, 1]) == 0
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages


def test_an_imported_prefix_is_held_until_the_request_resuming_on_it_is_admitted(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    """Between an import and the admission of the request behind it, memory pressure must not
    evict what was just copied in; once admitted, the request's own lock is the only one."""
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), cache=CACHE)
    conv = finish_turn(engine, list(range(30, 70)), hold=False)
    state = engine.export_prefix(conv)
    assert state is not None
    engine.cache.tree.clear()
    assert engine.import_prefix(state)
    engine.cache.tree.clear()  # pressure before the request arrives
    assert engine.cached_prefix_len([*conv, 1]) == len(conv)
    out = engine.generate([[*conv, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.num_cached_tokens == len(conv)
    assert len(engine.cache.holds) == 0  # the admission took the hold over
    engine.cache.tree.clear()
    assert engine.page_pool.num_free_pages == engine.page_pool.num_pages
    assert engine.slot_pool.num_free_slots == engine.slot_pool.num_slots


def test_a_request_short_only_of_held_memory_waits_instead_of_failing(tiny_checkpoint: Callable[..., Path]) -> None:
    """Alone and short of pages, a request fails at once ("length", no token) — unless a hold
    locks the memory it lacks: holds end within ``handoff_hold_s``, so it waits and then runs."""
    cache = CacheConfig(page_size=16, num_pages=8, num_state_slots=8, checkpoint_interval=0)
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), cache=cache)
    held = finish_turn(engine, list(range(100, 180)), hold=True)  # 84 tokens: 6 of the 8 pages
    rid = engine.add_request(list(range(30, 80)), SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(3):
        assert all(out.request_id != rid for out in engine.step())  # waits: no output, no failure
    handle = engine.pin_prefix(held)
    assert handle is not None
    engine.unpin_prefix(handle)  # the session let go: evictable now
    tokens: list[int] = []
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens, reason = out.token_ids, out.finish_reason
    assert len(tokens) == 4 and reason == "length"

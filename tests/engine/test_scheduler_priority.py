"""Short prefills (an agent's next turn) never wait behind long ones (other agents' first turns).

The toy model's answers are known in closed form, so each test also checks that the reordering
changes no token.
"""

from __future__ import annotations

import pytest
from toy_model import assert_pools_empty, expected, make_engine

from phloem.engine import SamplingParams

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def run_all(engine, first: dict[str, int]) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """Step to the end; ``first`` gets each request's step index of its first token."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if out.new_token_ids:
                first.setdefault(out.request_id, step)
            tokens[out.request_id] = out.token_ids
    return tokens


def count_preemptions(engine) -> list[str]:  # type: ignore[no-untyped-def]
    """Record the ids of the requests the scheduler preempts from now on."""
    preempted: list[str] = []
    preempt = engine.scheduler._preempt

    def record(req, preempt=preempt) -> None:  # type: ignore[no-untyped-def]
        preempted.append(req.request_id)
        preempt(req)

    engine.scheduler._preempt = record  # type: ignore[method-assign]
    return preempted


def test_a_waiting_short_prompt_is_admitted_before_long_ones_queued_ahead_of_it() -> None:
    engine = make_engine(budget=8, num_pages=64, max_seqs=8)
    long_a, long_b, short = list(range(1, 41)), list(range(2, 42)), [5, 6, 7]
    ids = [engine.add_request(p, PARAMS) for p in (long_a, long_b, short)]
    first: dict[str, int] = {}
    tokens = run_all(engine, first)
    # In the first step, beside the first chunk of long_a, all but its last token: a fresh
    # prompt's chunk ends one token early for its prompt-end checkpoint (issue 48), so its first
    # token comes in the second step (its last prompt token rides with the decode batch).
    assert first[ids[2]] == 2
    assert first[ids[0]] < first[ids[1]]  # the long ones keep their arrival order
    for rid, prompt in zip(ids, (long_a, long_b, short)):
        assert tokens[rid] == expected(prompt, 4)
    assert_pools_empty(engine)


def test_a_running_long_prefill_yields_the_budget_to_a_short_one_that_arrives() -> None:
    engine = make_engine(budget=8, num_pages=64, max_seqs=8, async_scheduling=False)
    long_prompt = list(range(1, 61))
    long_id = engine.add_request(long_prompt, PARAMS)
    engine.step()
    engine.step()
    (long_req,) = engine.scheduler.running
    assert long_req.num_computed_tokens == 16
    short = [3, 1, 4, 1, 5]
    short_id = engine.add_request(short, PARAMS)
    outs = engine.step()
    # All of its prompt but the last token (cut there for its prompt-end checkpoint, issue 48),
    # then that token and its first output token in the next step, beside the long prefill.
    assert outs == []
    assert long_req.num_computed_tokens == 16 + 4  # the rest of the budget
    outs = engine.step()
    assert [o.request_id for o in outs] == [short_id]
    assert long_req.num_computed_tokens == 16 + 4 + 7
    first: dict[str, int] = {}
    tokens = run_all(engine, first)
    assert tokens[long_id] == expected(long_prompt, 4) and tokens[short_id] == expected(short, 4)
    assert_pools_empty(engine)


def test_a_continuation_that_hits_the_cache_counts_as_short() -> None:
    """A next turn whose history is cached is short, however long its whole prompt."""
    engine = make_engine(budget=8, num_pages=128, max_seqs=8)
    history = list(range(1, 41))
    out = engine.generate([history], PARAMS)[0]
    turn2 = history + out.token_ids + [7, 8]
    fresh = list(range(3, 43))
    fresh_id = engine.add_request(fresh, PARAMS)
    turn2_id = engine.add_request(turn2, PARAMS)
    first: dict[str, int] = {}
    tokens = run_all(engine, first)
    assert first[turn2_id] == 1 and first[fresh_id] > 1
    assert tokens[turn2_id] == expected(turn2, 4) and tokens[fresh_id] == expected(fresh, 4)
    assert_pools_empty(engine)


def test_waits_for_memory_tells_a_full_pool_from_a_queue() -> None:
    prompts = [list(range(k, k + 29)) for k in (1, 2, 3)]
    engine = make_engine(num_slots=2, budget=100, async_scheduling=False)
    a, b, c = (engine.add_request(p, PARAMS) for p in prompts)
    engine.step()
    # a and b hold the two state slots; c has budget left but no slot.
    assert not engine.waits_for_memory(a) and not engine.waits_for_memory(b) and engine.waits_for_memory(c)
    roomy = make_engine(num_slots=8, budget=4, async_scheduling=False)
    d, e = (roomy.add_request(p, PARAMS) for p in prompts[:2])
    roomy.step()
    assert not roomy.waits_for_memory(d) and not roomy.waits_for_memory(e)  # e only waits for its turn
    first: dict[str, int] = {}
    tokens = run_all(engine, first)
    assert [tokens[r] for r in (a, b, c)] == [expected(p, 4) for p in prompts]
    assert_pools_empty(engine)


def test_a_turn_is_admitted_before_fresh_prompts_that_also_fit_one_step() -> None:
    """A fresh prompt that fits one step's budget is short too (an 8K first turn under an 8K
    budget), but a turn's few new tokens go first: the short ones are admitted smallest first."""
    engine = make_engine(budget=12, num_pages=128, max_seqs=2)
    history = list(range(1, 13))
    out = engine.generate([history], PARAMS)[0]
    fresh = [list(range(k, k + 10)) for k in range(2, 8)]
    fresh_ids = [engine.add_request(p, PARAMS) for p in fresh]
    engine.step()  # two of them take both seats
    turn = history + out.token_ids + [7, 8]
    turn_id = engine.add_request(turn, PARAMS)
    first: dict[str, int] = {}
    tokens = run_all(engine, first)
    # The turn takes the first seat that frees; the four fresh prompts queued ahead of it wait.
    assert all(first[turn_id] < first[rid] for rid in fresh_ids[2:])
    for rid, prompt in zip([turn_id, *fresh_ids], [turn, *fresh]):
        assert tokens[rid] == expected(prompt, 4)
    assert_pools_empty(engine)


def test_preemption_takes_fresh_prompts_before_an_agents_turn() -> None:
    """With the pages short, decode growth preempts the fresh prompts, not the turn that arrived
    after them. Preempting the newest request took the turn each time: it lost the history it was
    admitted on, came back as a long recompute, and got its first token only after every fresh
    prompt had had its own (step 29-60 of this workload, against 2-8 now)."""
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for num_pages in (20, 24, 28, 32):
        engine = make_engine(budget=12, num_pages=num_pages, num_slots=32, max_seqs=16,
                             async_scheduling=False, prompt_end_split_min_tokens=2)
        history = list(range(1, 13))
        out = engine.generate([history], SamplingParams(max_tokens=2, ignore_eos=True))[0]
        pin = engine.pin_prefix(history + out.token_ids)  # the session's head, as a session pins it
        fresh = [list(range(k, k + 10)) for k in range(2, 12)]
        fresh_ids = [engine.add_request(p, params) for p in fresh]
        engine.step()
        engine.step()
        turn = history + out.token_ids + [7, 8, 9, 10]
        turn_id = engine.add_request(turn, PARAMS)
        preempted = count_preemptions(engine)
        first: dict[str, int] = {}
        tokens = run_all(engine, first)
        assert preempted and turn_id not in preempted, num_pages  # fresh prompts were preempted
        assert first[turn_id] <= 3 and sum(first[rid] > first[turn_id] for rid in fresh_ids) >= 4, num_pages
        for rid, prompt in zip(fresh_ids, fresh):
            assert tokens[rid] == expected(prompt, 16)
        assert tokens[turn_id] == expected(turn, 4)
        engine.unpin_prefix(pin)
        assert_pools_empty(engine)


@pytest.mark.parametrize("margin", [1, 8, 9, None])
def test_a_turn_takes_a_seat_from_a_decoding_fresh_prompt(margin: int | None) -> None:
    """Every seat decodes a fresh prompt for 32 steps: the turn that arrives preempts the one that
    brought the most work (the newest of equals) if that is ``seat_yield_min_tokens`` more than
    the turn's (10 against 2 here), gets its first token at once, and the preempted prompt comes
    back on its published prefix as the first seat frees, its tokens unchanged."""
    engine = make_engine(budget=12, num_pages=128, max_seqs=2, async_scheduling=False, seat_yield_min_tokens=margin)
    history = list(range(1, 13))
    out = engine.generate([history], PARAMS)[0]
    long_params = SamplingParams(max_tokens=32, ignore_eos=True)
    fresh = [list(range(k, k + 10)) for k in (2, 3)]
    fresh_ids = [engine.add_request(p, long_params) for p in fresh]
    for _ in range(3):
        engine.step()  # both decode
    preempted = count_preemptions(engine)
    turn = history + out.token_ids + [7, 8]
    turn_id = engine.add_request(turn, PARAMS)
    first: dict[str, int] = {}
    tokens = run_all(engine, first)
    if margin is not None and margin <= 8:
        assert first[turn_id] <= 2 and preempted == [fresh_ids[1]]
    else:
        assert first[turn_id] > 30 and preempted == []
    for rid, prompt in zip(fresh_ids, fresh):
        assert tokens[rid] == expected(prompt, 32)
    assert tokens[turn_id] == expected(turn, 4)
    assert_pools_empty(engine)


def test_a_turn_takes_no_seat_from_a_request_that_brought_no_more_work() -> None:
    """Seats do not change hands among equals: two turns decoding keep their seats from a third of
    the same size, which waits for the first to finish; a preempted request is not a claimant."""
    engine = make_engine(budget=12, num_pages=128, max_seqs=2, async_scheduling=False)
    histories = [list(range(k, k + 12)) for k in (1, 2, 3)]
    outs = engine.generate(histories, PARAMS)
    long_params = SamplingParams(max_tokens=16, ignore_eos=True)
    turns = [h + o.token_ids + [7, 8] for h, o in zip(histories, outs)]
    ids = [engine.add_request(t, long_params) for t in turns[:2]]
    engine.step()
    engine.step()
    preempted = count_preemptions(engine)
    ids.append(engine.add_request(turns[2], long_params))
    first: dict[str, int] = {}
    tokens = run_all(engine, first)
    assert preempted == [] and first[ids[2]] > 14
    for rid, turn in zip(ids, turns):
        assert tokens[rid] == expected(turn, 16)
    assert_pools_empty(engine)

"""Random workloads on the toy model with async scheduling: every answer is its closed form.

Each seed interleaves, between engine steps, new requests (fresh prompts and continuations of
earlier conversations, so prefix hits, turn-end checkpoints and forks happen), aborts and steps,
on small pools (preemption, slot shortage, eviction) and with random stop tokens, lengths,
chunk budgets and checkpoint intervals; with the prefix cache, sessions' operations too: pins
and unpins of finished conversations, and spills (export, cache reset, import back; or a
continuation that resumes the spilled state when it is admitted). The toy model checks on every forward that its KV pages
agree with its GDN state; here every finished request must equal ``expected`` (the closed form),
every aborted one must have reported a prefix of it, and the pools must come back full. A
request longer than the whole KV pool is refused at admission (``CapacityExceeded``) or, alone
and out of pages, finishes early with ``length`` (then its tokens are a prefix of the closed form
and it filled the pool, unless pins held part of it).
"""

from __future__ import annotations

import random

import pytest
from toy_model import VOCAB, assert_pools_empty, expected, make_engine

from phloem.engine import CapacityExceeded, Engine, InvalidRequest, SamplingParams


def run_random_workload(engine: Engine, rng: random.Random, num_ops: int = 120) -> int:
    prompts: dict[str, list[int]] = {}
    params: dict[str, SamplingParams] = {}
    reported: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    aborted: set[str] = set()
    conversations: list[list[int]] = []
    pins: list[object] = []
    pinned_ever = False
    tree = engine.cache.tree

    def collect(outputs: list) -> None:  # type: ignore[type-arg]
        for out in outputs:
            assert out.request_id not in aborted, "output after abort"
            assert out.request_id not in finished, "output after the finish"
            reported[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
                conversations.append(prompts[out.request_id] + reported[out.request_id])

    for _ in range(num_ops):
        op = rng.random()
        if op < 0.3:
            spilled = None
            if conversations and rng.random() < 0.5:  # continue (or fork) an earlier conversation
                conv = rng.choice(conversations)
                prompt = conv + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 6))]
                if tree is not None and rng.random() < 0.25:  # spilled while idle: resumed at admission
                    spilled = engine.export_prefix(conv)
                    tree.clear()
            else:
                prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 30))]
            stop = (rng.randrange(VOCAB),) if rng.random() < 0.3 else ()
            p = SamplingParams(max_tokens=rng.randrange(1, 25), stop_token_ids=stop)
            try:
                rid = engine.add_request(prompt, p, resume=spilled)
            except (CapacityExceeded, InvalidRequest):
                continue  # longer than the pool or the context: refused, nothing enqueued
            prompts[rid], params[rid], reported[rid] = prompt, p, []
        elif op < 0.42 and tree is not None and conversations:
            conv = rng.choice(conversations)
            if op < 0.39:
                handle = engine.pin_prefix(conv)
                if handle is not None:
                    pins.append(handle)
                    pinned_ever = True
            elif op < 0.40 and pins:
                engine.unpin_prefix(pins.pop(rng.randrange(len(pins))))  # type: ignore[arg-type]
            else:
                state = engine.export_prefix(conv)
                if state is not None:
                    tree.clear()  # what a cache reset drops (locked paths stay)
                    engine.import_prefix(state)  # False when no room: then it is recomputed
        elif op < 0.49:
            live = [r for r in prompts if r not in finished and r not in aborted]
            if live:
                victim = rng.choice(live)
                if engine.abort_request(victim):  # False: it finished in the step just collected
                    aborted.add(victim)
        else:
            collect(engine.step())
    # Pins held for good could keep a waiting request out forever (the sessions layer expires
    # them; here they all go before the final drain). Likewise the hand-off hold of an import no
    # request resumed on, which lasts ``handoff_hold_s`` (``engine.cache.holds``): longer than
    # this whole workload.
    for handle in pins:
        engine.unpin_prefix(handle)  # type: ignore[arg-type]
    engine.cache.holds.clear()
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        collect(engine.step())
    assert not engine.has_unfinished_requests(), "the engine did not drain"

    for rid, prompt in prompts.items():
        want = expected(prompt, params[rid].max_tokens, set(params[rid].stop_token_ids))
        if rid in aborted:
            assert reported[rid] == want[: len(reported[rid])], f"{rid} reported a wrong token before its abort"
            continue
        if len(reported[rid]) < len(want):
            assert reported[rid] == want[: len(reported[rid])] and finished[rid] == "length", rid
            pool = engine.page_pool
            held = len(prompt) + len(reported[rid])
            assert pinned_ever or held > (pool.num_pages - 1) * pool.page_size, f"{rid} cut short"
            continue
        assert reported[rid] == want, f"{rid}: {reported[rid]} != {want}"
        stopped = bool(want) and want[-1] in params[rid].stop_token_ids
        assert finished[rid] == ("stop" if stopped else "length")
    return len(prompts)


def random_engine(seed: int) -> tuple[Engine, random.Random]:
    """A toy engine on small random pools and budgets (a quarter of seeds without the prefix
    cache), and the random stream its workload goes on drawing from."""
    rng = random.Random(seed)
    engine = make_engine(
        num_pages=rng.choice([12, 24, 64]), num_slots=rng.choice([3, 6, 16]), budget=rng.choice([4, 16, 64]),
        max_seqs=rng.choice([2, 4, 8]), caching=seed % 4 != 3, interval=rng.choice([0, 0, 4, 8]),
    )
    return engine, rng


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_give_closed_form_answers(seed: int) -> None:
    engine, rng = random_engine(seed)
    num_requests = run_random_workload(engine, rng)
    assert num_requests > 10
    assert engine.num_pipelined_steps > 0, "the workload never reached steady decode"
    assert_pools_empty(engine)


def test_a_request_preempted_and_admitted_again_in_one_step_runs_once() -> None:
    """Seed 385 over 20 operations (12 pages, 8 seats, a 16-token budget): a decoding request
    preempted for another's page in a step's decode pass is admitted again in the same step, its
    published prefix evicted meanwhile, as a long prefill; the long pass then scheduled it a
    second time from the running order taken before (two rows writing one state slot: "KV pages
    disagree with GDN state", or the step's one-row-a-request assertion)."""
    engine, rng = random_engine(385)
    run_random_workload(engine, rng, num_ops=20)
    assert engine.scheduler.num_preemptions > 0
    assert_pools_empty(engine)

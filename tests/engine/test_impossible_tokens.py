"""A sampled id outside the vocabulary fails the step: never text, never a published checkpoint.

A model whose logits have padded columns past the vocabulary (a padded ``lm_head``), or a step
whose sampled ids were overwritten on their way to the host, can hand the engine an id no
tokenizer knows. The engine refuses it (``CorruptStep``), drops the step's requests without
publishing their state, and keeps serving (the engine loop's side: tests/runtime/test_engine_loop.py).
"""

from __future__ import annotations

import pytest
from toy_model import VOCAB, assert_pools_empty, expected, padded_engine

from phloem.engine import CorruptStep, SamplingParams

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_id_past_the_vocabulary_fails_the_step_and_publishes_nothing(async_scheduling: bool) -> None:
    engine = padded_engine(async_scheduling)
    good = [1, 2, 3]
    bad = [90] * 11  # sum 990: the first tokens are in range, then the running sum passes POISON
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request(good, params)
    engine.add_request(bad, params)
    seen: list[int] = []
    with pytest.raises(CorruptStep, match=f"outside the vocabulary \\[0, {VOCAB}\\)"):
        for _ in range(50):
            for out in engine.step():
                seen += out.new_token_ids
    assert all(0 <= t < VOCAB for t in seen)
    assert not engine.has_unfinished_requests()
    # The prompt-end checkpoint stays (its state was right); nothing of the failed step does. It
    # sits one token before the prompt's end (``CacheConfig.checkpoint_prompt_end``).
    tree = engine.cache.tree
    assert tree is not None
    match = tree.match(bad + expected(bad, 1) + [0] * 5, 30)
    assert match is not None and match.num_tokens == len(bad) - 1
    # The engine keeps serving, and its answers are right.
    short = SamplingParams(max_tokens=5, ignore_eos=True)  # running sums stay under POISON
    assert engine.generate([good], short)[0].token_ids == expected(good, 5)
    assert_pools_empty(engine)

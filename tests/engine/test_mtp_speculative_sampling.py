"""Speculation beyond plain greedy requests, on the trained built-in model (a real MTP layer):
sampled requests, log-probabilities, grammars and forks (``engine.sampling.draft_sampler``).

* Unseeded sampled requests (the standard rule) follow the plain sampler's distribution: the
  first three tokens of 1,024 requests (temperature 1, top-k 3: 27 sequences) against their exact
  probabilities, computed from the plain engine's log-probabilities; the same test rejects a
  deliberately wrong rule (a rejection resampled from ``p``, not the residual).
* Seeded sampled requests (the coupled rule) emit exactly their plain tokens, alone and batched.
* Log-probabilities of accepted tokens equal the plain step's, within fp32 tolerance.
* A JSON-schema request and a required tool call give the plain tokens with ``mtp:1..3``.
* Branches forked from a finished conversation (prefix hits with tail copies) give the plain tokens.

Each case runs engines over several prompts: seconds on the 2-core CPU, so they are marked slow.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from chi_square import chi_square_p_value
from grammars import JSON, SCHEMA, TOOL_CALL

from phloem.engine import Engine, RequestOutput
from phloem.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from phloem.engine.sampling import draft_sampler
from phloem.engine.sampling.draft_acceptance import accept_standard, race
from phloem.engine.sampling.params import SamplingParams
from phloem.runtime.builtin_model import trained_model_path

pytestmark = pytest.mark.slow

TEXTS = (
    "The module provides a simple way to parse command-line arguments, and the class",
    "def mean(xs):\n    return sum(xs) / len(xs)\n",
    "<|im_start|>user\nWhat is the weather in Rome? Reply in JSON.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n",
)


def _engine(k: int, **sections) -> Engine:
    # A verify limit above the distribution test's batch (N_SAMPLES): its steps must speculate.
    spec = SpeculativeConfig("mtp", k, max_verify_tokens=4 * N_SAMPLES) if k else SpeculativeConfig()
    return Engine.from_pretrained(trained_model_path(), EngineConfig(speculative=spec), dtype="float32", **sections)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained_model_path())
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain() -> Engine:
    return _engine(0)


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.token_ids for o in outs]


# --- unseeded sampled requests: the standard rule -----------------------------------------------

N_SAMPLES = 1024
TOP_K = 3


def _exact_distribution(plain: Engine, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(first three tokens) under temperature 1 and top-k 3, from the plain engine's top-3
    log-probabilities (softmax over the top 3 of the logits is softmax over their logprobs)."""

    def next_dist(contexts: list[list[int]]) -> list[dict[int, float]]:
        outs = plain.generate([prompt + c for c in contexts], SamplingParams(max_tokens=1, logprobs=TOP_K))
        dists = []
        for o in outs:
            assert o.new_logprobs is not None
            top = o.new_logprobs[0].top
            z = sum(math.exp(lp) for _, lp in top)
            dists.append({t: math.exp(lp) / z for t, lp in top})
        return dists

    (d0,) = next_dist([[]])
    d1 = dict(zip(d0, next_dist([[a] for a in d0])))
    pairs = [(a, b) for a in d0 for b in d1[a]]
    d2 = dict(zip(pairs, next_dist([list(ab) for ab in pairs])))
    return {(a, b, c): d0[a] * d1[a][b] * d2[(a, b)][c] for a, b in pairs for c in d2[(a, b)]}


def _p_value(outs: list[RequestOutput], expected: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit; sequences expected fewer than 5 times are pooled in one cell
    (with everything else observed: a sequence outside the support lands there)."""
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    n = len(outs)
    big = [s for s, p in expected.items() if p * n >= 5]
    observed = [counts.get(s, 0) for s in big]
    want = [expected[s] * n for s in big]
    observed.append(n - sum(observed))
    want.append(n - sum(want))
    want = [w * n / sum(want) for w in want]
    return chi_square_p_value(observed, want)


def _resample_from_p(p, q, drafts, uniform, noise):  # type: ignore[no-untyped-def]
    n, _ = accept_standard(p, q, drafts, uniform, noise)
    return n, race(p[torch.arange(p.shape[0]), n], noise)


def test_sampled_tokens_follow_the_plain_distribution(prompts, plain, monkeypatch) -> None:
    """Non-centrality of the wrong rule's statistic here: about 118 (25 degrees of freedom), so it
    fails ``p < 1e-4`` for all but about 5e-6 of seeds; the right rule passes ``p > 1e-3`` for
    all but 1e-3 of them (the seeds are fixed: the engine's default generator)."""
    expected = _exact_distribution(plain, prompts[0])
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=TOP_K, ignore_eos=True)
    sections = {"scheduler": SchedulerConfig(max_num_seqs=N_SAMPLES, max_num_batched_tokens=32 * N_SAMPLES),
                "cache": CacheConfig(num_state_slots=2 * N_SAMPLES + 4, num_pages=4 * N_SAMPLES)}
    engine = _engine(2, **sections)
    outs = engine.generate([prompts[0]] * N_SAMPLES, params)
    # Every request's second and third tokens came from speculative steps.
    assert engine.speculator.stats.request_steps >= N_SAMPLES and engine.speculator.stats.steps <= 3
    assert _p_value(outs, expected) > 1e-3
    monkeypatch.setattr(draft_sampler, "accept_standard", _resample_from_p)
    wrong = _engine(2, **sections).generate([prompts[0]] * N_SAMPLES, params)
    assert _p_value(wrong, expected) < 1e-4


# --- seeded sampled requests: the coupled rule, and log-probabilities ---------------------------

SEEDED = [
    SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=1),
    SamplingParams(max_tokens=40),
    SamplingParams(max_tokens=40, temperature=1.2, top_k=20, seed=2, logprobs=3),
    SamplingParams(max_tokens=40, logprobs=2),
]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_seeded_tokens_and_logprobs_equal_plain(k: int, prompts, plain) -> None:
    want = plain.generate(prompts, SEEDED)
    engine = _engine(k)
    for outs in (engine.generate(prompts, SEEDED),
                 [engine.generate([p], s)[0] for p, s in zip(prompts, SEEDED)]):
        assert _tokens(outs) == _tokens(want)
        for got, ref in zip(outs, want):
            if ref.new_logprobs is None:
                continue
            # generate() returns the last step's output; its logprobs are that step's tokens'.
            assert got.new_logprobs is not None and len(got.new_logprobs) == len(got.new_token_ids)
            last = ref.new_logprobs[-1]
            mine = got.new_logprobs[-1]
            assert mine.token_id == last.token_id
            assert mine.logprob == pytest.approx(last.logprob, abs=1e-4)
            assert [t for t, _ in mine.top] == [t for t, _ in last.top]
            assert [v for _, v in mine.top] == pytest.approx([v for _, v in last.top], abs=1e-4)
    assert engine.speculator.stats.steps > 0 and engine.speculator.stats.mean_accepted_length > 1.2


@pytest.mark.parametrize("k", [1, 3])
def test_every_logprob_of_a_streamed_run_equals_plain(k: int, prompts, plain) -> None:
    """All steps' log-probabilities (several per speculative step) against the plain run's."""

    def stream(engine: Engine, params: SamplingParams) -> list:
        rid = engine.add_request(prompts[1], params)
        got = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    assert out.new_logprobs is not None and len(out.new_logprobs) == len(out.new_token_ids)
                    got += out.new_logprobs
        return got

    for params in (SEEDED[3], SEEDED[2]):
        want, got = stream(plain, params), stream(_engine(k), params)
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
        for a, b in zip(got, want):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


# --- grammars ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_json_schema_and_required_tool_call_equal_plain(k: int, prompts, plain) -> None:
    import jsonschema
    from transformers import AutoTokenizer

    params = [SamplingParams(max_tokens=200, grammar=JSON), SamplingParams(max_tokens=200, grammar=TOOL_CALL),
              SamplingParams(max_tokens=200, temperature=0.9, seed=5, grammar=JSON)]
    chats = [prompts[2], prompts[3], prompts[2]]
    want = plain.generate(chats, params)
    engine = _engine(k)
    outs = engine.generate(chats, params)
    assert _tokens(outs) == _tokens(want)
    assert all(o.finish_reason == "stop" for o in outs)
    tok = AutoTokenizer.from_pretrained(trained_model_path())
    jsonschema.validate(json.loads(tok.decode(outs[0].token_ids[:-1])), SCHEMA)
    assert tok.decode(outs[1].token_ids).startswith("<tool_call>")
    stats = engine.speculator.stats
    assert stats.steps > stats.plain_steps and stats.mean_accepted_length > 1.2
    # Alone (batch 1), the JSON request too.
    assert engine.generate([chats[0]], params[0])[0].token_ids == want[0].token_ids


# --- forks -------------------------------------------------------------------------------------


def test_fork_branches_equal_plain(prompts, plain) -> None:
    """Three branches continue one finished conversation (a session fork: each hits the turn-end
    checkpoint, its tail page copied), greedy and seeded, all at once."""
    engine = _engine(2, cache=CacheConfig(page_size=16, num_pages=256, num_state_slots=24))
    first = engine.generate([prompts[1]], SamplingParams(max_tokens=30))[0]
    conv = prompts[1] + first.token_ids
    branches = [conv + prompts[0][:n] for n in (3, 5, 7)]
    params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=30, temperature=0.7, seed=3),
              SamplingParams(max_tokens=30)]
    before = engine.speculator.stats.steps
    outs = engine.generate(branches, params)
    assert len(conv) % 16 and all(o.num_cached_tokens == len(conv) for o in outs)
    assert _tokens(outs) == _tokens(plain.generate(branches, params))
    assert engine.speculator.stats.steps > before

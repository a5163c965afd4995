"""The sampler's logits processing on known logits: penalties, bias, ``min_tokens``, grammar
masks and log-probabilities, checked against their formulas written out element by element."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from phloem.engine.request import Request
from phloem.engine.sampling.grammar import GrammarBackend, GrammarMatcher
from phloem.engine.sampling.logits_processors import StepProcessing
from phloem.engine.sampling.params import GrammarSpec, SamplingParams
from phloem.engine.sampling.sampler import sample
from phloem.runtime import ensure_default_model

V = 40
EOS = (7,)
CPU = torch.device("cpu")


def request(prompt: list[int], output: list[int], **params: object) -> Request:
    sampling = SamplingParams(max_tokens=50, **params)  # type: ignore[arg-type]
    return Request("r", prompt + output, sampling, arrival_idx=0, num_prompt_tokens=len(prompt))


def known_logits(rows: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(rows, V) * 3


def reference_penalties(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """The penalty formula (engine.sampling.logits_processors), one token at a time."""
    out = []
    for t, value in enumerate(logits):
        count = output.count(t)
        if t in output or (p.repetition_penalty != 1.0 and t in prompt):
            value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
        value -= count * p.frequency_penalty + (1.0 if count else 0.0) * p.presence_penalty
        out.append(value)
    return out


def test_requests_without_processing_build_nothing() -> None:
    reqs = [request([1, 2], [3]), request([4], [], temperature=0.7, seed=3)]
    assert StepProcessing.build(reqs, V, EOS, CPU) is None


@pytest.mark.parametrize("params", [
    dict(presence_penalty=1.5), dict(frequency_penalty=0.7), dict(frequency_penalty=-0.5, presence_penalty=-1.0),
    dict(repetition_penalty=1.8), dict(repetition_penalty=0.6, frequency_penalty=0.3, presence_penalty=0.2),
], ids=["presence", "frequency", "negative", "repetition", "all"])
def test_penalties_follow_their_formula(params: dict[str, float]) -> None:
    rows = [([1, 2, 3], [3, 3, 9, 12, 1]), ([30, 31], []), ([5], [5, 6, 6, 6])]
    reqs = [request(p, o, **params) for p, o in rows]
    # A plain request in the same step keeps its logits.
    reqs.append(request([1], [2, 2]))
    logits = known_logits(len(reqs))
    processing = StepProcessing.build(reqs, V, EOS, CPU)
    assert processing is not None
    out = processing.apply(logits)
    for i, (prompt, output) in enumerate(rows):
        expected = reference_penalties(logits[i].tolist(), prompt, output, reqs[i].params)
        assert out[i].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
    assert torch.equal(out[3], logits[3])


def test_penalty_counts_follow_the_output_across_steps() -> None:
    req = request([1, 2], [4], frequency_penalty=1.0)
    logits = known_logits(1)
    for new in ([4, 9], [9, 9, 1], []):
        for t in new:
            req.append_output(t)
        processing = StepProcessing.build([req], V, EOS, CPU)
        assert processing is not None
        out = processing.apply(logits)
        expected = reference_penalties(logits[0].tolist(), req.prompt_token_ids, req.output_token_ids, req.params)
        assert out[0].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_penalties_change_the_greedy_pick() -> None:
    logits = known_logits(1)
    best = int(logits[0].argmax())
    plain = request([0], [best])
    penalized = request([0], [best], presence_penalty=2.0, frequency_penalty=2.0)
    gap = float(logits[0].topk(2).values[0] - logits[0].topk(2).values[1])
    assert gap < 4.0, "the penalties (4 in all) must be able to overturn the top logit"
    picks = sample(logits.repeat(2, 1), [plain.params, penalized.params], [None, None],
                   processing=StepProcessing.build([plain, penalized], V, EOS, CPU))
    assert picks[0] == best and picks[1] != best


def test_logit_bias_adds_and_bans() -> None:
    logits = known_logits(2)
    worst = int(logits[0].argmin())
    best = int(logits[1].argmax())
    reqs = [request([1], [], logit_bias=((worst, 100.0),)), request([1], [], logit_bias=((best, -100.0), (3, 0.5)))]
    processing = StepProcessing.build(reqs, V, EOS, CPU)
    assert processing is not None
    out = processing.apply(logits)
    assert out[0, worst] == pytest.approx(float(logits[0, worst]) + 100.0)
    assert out[1, 3] == pytest.approx(float(logits[1, 3]) + 0.5)
    picks = sample(logits, [r.params for r in reqs], [None, None], processing=processing)
    assert picks[0] == worst and picks[1] != best


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(3, V)
    logits[:, EOS[0]] = 10.0
    logits[:, 11] = 9.0
    reqs = [request([1], [2], min_tokens=2, stop_token_ids=(11,)),  # one short: both banned
            request([1], [2, 3], min_tokens=2),                     # reached: EOS allowed
            request([1], [], min_tokens=3, ignore_eos=True)]        # EOS is not a stop here
    picks = sample(logits, [r.params for r in reqs], [None] * 3, processing=StepProcessing.build(reqs, V, EOS, CPU))
    assert picks[0] not in (EOS[0], 11) and picks[1] == EOS[0] and picks[2] == EOS[0]


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    logits = known_logits(2)
    reqs = [request([1], [], logprobs=3, presence_penalty=1.0), request([1], [], logprobs=0)]
    processing = StepProcessing.build(reqs, V, EOS, CPU)
    assert processing is not None
    tokens = sample(logits, [r.params for r in reqs], [None, None], processing=processing)
    step = processing.logprobs(logits, tokens)
    assert step is not None
    got = step.read(tokens.tolist())
    expected = logits.log_softmax(-1)
    for row in (0, 1):
        assert got[row].token_id == int(tokens[row])
        assert math.isclose(got[row].logprob, float(expected[row, tokens[row]]), abs_tol=1e-6)
    top = expected[0].topk(3)
    assert [t for t, _ in got[0].top] == top.indices.tolist()
    assert [v for _, v in got[0].top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert got[1].top == ()


class _Only:
    """A grammar stand-in that allows a fixed set of tokens (the bitmask's layout is xgrammar's)."""

    batch = None

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for t in self.allowed:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word


def test_grammar_masks_every_token_it_does_not_allow() -> None:
    logits = known_logits(2)
    allowed = {0, 31, 32, 39}  # both words' edges, the sign bit included
    req = request([1], [])
    req.grammar = _Only(allowed)  # type: ignore[assignment]
    plain = request([1], [])
    processing = StepProcessing.build([req, plain], V, EOS, CPU)
    assert processing is not None
    out = processing.apply(logits)
    assert {t for t in range(V) if out[0, t] != float("-inf")} == allowed
    assert torch.equal(out[1], logits[1])
    assert int(sample(logits, [req.params, plain.params], [None, None], processing=processing)[0]) in allowed


def test_compiled_grammars_are_cached(tmp_path: Path) -> None:
    backend = GrammarBackend(ensure_default_model(tmp_path), 1920, (2,))
    spec = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    first = backend.compile(spec)
    assert backend.compile(GrammarSpec(spec.kind, spec.source)) is first and backend.num_compiles == 1
    assert isinstance(backend.matcher(spec), GrammarMatcher) and backend.num_compiles == 1

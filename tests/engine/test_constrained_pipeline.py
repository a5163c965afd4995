"""Constrained decoding under async scheduling (``engine.step_pipeline``): a decode step holding
grammar requests is queued before the step ahead of it is read, and its masked sampling is
queued once those ids are applied to the matchers. The tokens are the synchronous engine's, bit
for bit, on the built-in model (random weights, the torch op table; the Triton op table under
the interpreter in ``test_constrained_pipeline_triton.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from grammars import HERMES, JSON, REGEX, SCHEMA, TOOL_CALL, TOOLS, WEATHER, XML, XML_CALL
from toy_model import assert_pools_empty

from phloem.engine import CacheConfig, Engine, SamplingParams, SchedulerConfig
from phloem.engine.model_runner import LaunchedStep
from phloem.engine.sampling.grammar import GrammarMatcher
from phloem.runtime import ensure_default_model
from phloem.sessions import Tokenizer
from phloem.sessions.text.output_parser import parse_output


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("constrained-pipeline"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(model_dir)


def make(model_dir: Path, async_scheduling: bool, caching: bool = True) -> Engine:
    return Engine.from_pretrained(
        model_dir, cache=CacheConfig(num_pages=256, num_state_slots=40, enable_prefix_caching=caching),
        scheduler=SchedulerConfig(async_scheduling=async_scheduling),
    )


def workload(tokenizer: Tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    """Constrained requests of every kind (greedy, seeded, with penalties, cut by ``max_tokens``
    mid-document) mixed with plain ones, each with its own prompt."""
    grammars = [JSON, REGEX, TOOL_CALL, XML_CALL]
    params = []
    for i, grammar in enumerate(grammars * 3):
        kind = i // len(grammars)
        sampling: dict[str, object] = {} if kind == 0 else {"temperature": 0.9, "seed": 100 + i}
        if kind == 2:
            sampling.update(top_k=30, top_p=0.9, presence_penalty=0.5, logprobs=2)
        params.append(SamplingParams(max_tokens=300 if i % 5 else 9, grammar=grammar, **sampling))  # type: ignore[arg-type]
    params += [SamplingParams(max_tokens=14, ignore_eos=True),
               SamplingParams(max_tokens=30, temperature=1.0, seed=3),
               SamplingParams(max_tokens=20, ignore_eos=True, logit_bias=((17, 3.0),), logprobs=1),
               SamplingParams(max_tokens=25, min_tokens=10, frequency_penalty=0.8, temperature=0.7, seed=9)]
    prompts = [tokenizer.encode(f"Request {i}: answer.") for i in range(len(params))]
    return prompts, params


def outcome(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[object, ...]]:
    outs = engine.generate(prompts, params)
    return [(o.token_ids, o.finish_reason, o.num_cached_tokens) for o in outs]


def check_grammar_outputs(tokenizer: Tokenizer, params: list[SamplingParams], results: list[tuple[object, ...]]) -> None:
    """Every constrained output that reached its end parses as its grammar says."""
    for p, (ids, reason, _) in zip(params, results):
        if p.grammar is None or reason != "stop":
            continue
        text = tokenizer.decode(ids)  # type: ignore[arg-type]
        if p.grammar == JSON:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif p.grammar == REGEX:
            words = text.rstrip(".").split(" ")
            assert words[0].isalpha() and all(w.isdigit() for w in words[1:]), text
        else:
            fmt = HERMES if p.grammar == TOOL_CALL else XML
            [call] = parse_output(text, fmt).tool_calls
            schema = WEATHER if call.name == "get_weather" else TOOLS[1]["function"]["parameters"]
            jsonschema.validate(json.loads(call.arguments), schema)


@pytest.mark.slow  # several engines, compared step by step
@pytest.mark.parametrize("caching", [True, False], ids=["cache", "no-cache"])
def test_mixed_constrained_batch_gives_the_synchronous_tokens(model_dir: Path, tokenizer: Tokenizer, caching: bool) -> None:
    """Without the prefix cache a request that its grammar ends at step N is a row of the queued
    step N+1 all the same (no finalize step covers it): sampled without its terminated matcher."""
    prompts, params = workload(tokenizer)
    sync, pipelined = make(model_dir, False, caching), make(model_dir, True, caching)
    want = outcome(sync, prompts, params)
    got = outcome(pipelined, prompts, params)
    assert got == want
    assert sync.num_pipelined_steps == 0
    # Nearly every decode step was queued ahead, the constrained ones included.
    longest = max(len(ids) for ids, _, _ in got)  # type: ignore[arg-type]
    assert pipelined.num_pipelined_steps >= longest // 2
    reasons = [reason for _, reason, _ in got]
    assert reasons.count("stop") >= 8 and reasons.count("length") >= 3
    check_grammar_outputs(tokenizer, params, got)
    for engine in (sync, pipelined):
        assert_pools_empty(engine)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_constrained_steps_under_cuda_graphs_give_the_synchronous_tokens(model_dir: Path, tokenizer: Tokenizer) -> None:
    """The queued step's logits are the graph's output buffer: its sampling is queued before the
    next replay rewrites them, and the masked tokens (not the graph's own argmax) feed the next
    replay. Both engines replay the same buckets on the same inputs (the prefix cache's finalize
    rows keep the batches equal), so the tokens are equal bit for bit."""
    prompts, params = workload(tokenizer)
    outs, deferred = {}, {}
    for pipelined in (False, True):
        engine = Engine.from_pretrained(model_dir, device="cuda", dtype="bfloat16",
                                        scheduler=SchedulerConfig(max_num_seqs=len(prompts), async_scheduling=pipelined))
        assert engine.runner.graphs is not None
        log = StepLog(engine)
        outs[pipelined] = outcome(engine, prompts, params)
        deferred[pipelined] = sum(kind == "launch-forward" for kind, _ in log.events)
    assert outs[True] == outs[False]
    assert deferred[False] == 0 and deferred[True] >= max(len(ids) for ids, _, _ in outs[True]) // 2  # type: ignore[arg-type]
    check_grammar_outputs(tokenizer, params, outs[True])


@pytest.mark.slow  # several engines, compared step by step
def test_logprobs_of_constrained_requests_match_the_synchronous_engine(model_dir: Path, tokenizer: Tokenizer) -> None:
    """Tokens and alternatives equal; the values to fp32 rounding: a step queued ahead still
    projects the row of a request the step before finished (its token is dropped), and the LM
    head's CPU matmul over one more row may round the other rows' logits differently."""
    prompts = [tokenizer.encode("Give JSON."), tokenizer.encode("Call a tool.")]
    params = [SamplingParams(max_tokens=60, grammar=JSON, logprobs=3, temperature=0.8, seed=5),
              SamplingParams(max_tokens=60, grammar=TOOL_CALL, logprobs=0)]

    def logprobs(engine: Engine) -> list[object]:
        per_request: dict[str, list[object]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(prompt, p, f"r{i}")
        while engine.has_unfinished_requests():
            for out in engine.step():
                per_request.setdefault(out.request_id, []).extend(out.new_logprobs or ())
        return [per_request[f"r{i}"] for i in range(len(prompts))]

    pipelined = make(model_dir, True)
    got, want = logprobs(pipelined), logprobs(make(model_dir, False))
    assert pipelined.num_pipelined_steps > 0
    assert [[(lp.token_id, [t for t, _ in lp.top]) for lp in r] for r in got] == [
        [(lp.token_id, [t for t, _ in lp.top]) for lp in r] for r in want]
    for g, w in zip(got, want):
        values = lambda lps: [v for lp in lps for v in (lp.logprob, *(x for _, x in lp.top))]  # noqa: E731
        assert values(g) == pytest.approx(values(w), rel=1e-5, abs=1e-5)


class StepLog:
    """Records, in order, the runner calls of an engine's steps: ``launch`` (and whether its
    sampling was left for later), ``sample_queued`` and ``collect``, each with the step's
    ``SchedulerOutput`` (kept, so that each step is told apart by identity)."""

    def __init__(self, engine: Engine) -> None:
        self.events: list[tuple[str, object]] = []
        runner = engine.runner
        launch, sample_queued, collect = runner.launch, runner.sample_queued, runner.collect

        def logged_launch(*args: object) -> LaunchedStep:
            step = launch(*args)  # type: ignore[arg-type]
            self.events.append(("launch-forward" if step.awaits_sampling else "launch", step.sched))
            return step

        def logged_sample(step: LaunchedStep) -> LaunchedStep:
            if step.awaits_sampling:
                self.events.append(("sample", step.sched))
            return sample_queued(step)

        def logged_collect(step: LaunchedStep) -> object:
            self.events.append(("collect", step.sched))
            return collect(step)

        runner.launch = logged_launch  # type: ignore[method-assign]
        runner.sample_queued = logged_sample  # type: ignore[method-assign]
        runner.collect = logged_collect  # type: ignore[method-assign]

    def find(self, kind: str, sched: object) -> int:
        return next(i for i, (k, s) in enumerate(self.events) if k == kind and s is sched)


@pytest.mark.slow  # several engines, compared step by step
def test_a_constrained_step_is_queued_before_the_step_ahead_is_read(model_dir: Path, tokenizer: Tokenizer) -> None:
    """For each constrained step S queued behind step P: S's forward is launched, then P's ids are
    read (the host sync), then S's sampling is queued, then S is read."""
    engine = make(model_dir, True)
    log = StepLog(engine)
    params = [SamplingParams(max_tokens=200, grammar=g) for g in (JSON, TOOL_CALL, REGEX)]
    outs = engine.generate([tokenizer.encode(f"Go {i}.") for i in range(3)], params)
    check_grammar_outputs(tokenizer, params, [(o.token_ids, o.finish_reason, 0) for o in outs])
    events = log.events
    deferred = [i for i, (kind, _) in enumerate(events) if kind == "launch-forward"]
    assert len(deferred) >= max(len(o.token_ids) for o in outs) - 3
    assert len(deferred) == engine.num_pipelined_steps
    for i in deferred:
        sched = events[i][1]
        # The step launched before this one is read next; no other launch comes between.
        prev = next(s for kind, s in reversed(events[:i]) if kind.startswith("launch"))
        assert events[i + 1][0] == "collect" and events[i + 1][1] is prev
        assert events[i + 2][0] == "sample" and events[i + 2][1] is sched
        assert log.find("collect", sched) > i + 2


@pytest.mark.slow  # several engines, compared step by step
def test_a_grammar_that_ends_inside_the_queued_step_stops_as_before(model_dir: Path, tokenizer: Tokenizer) -> None:
    """A stop token the grammar allows ends the request before its grammar does; a request whose
    grammar ends at step N while step N+1 is queued; both finish with the tokens and reasons of
    the synchronous engine, on an engine whose matchers are then used by the next requests."""
    prompt = tokenizer.encode("JSON please.")
    [free] = make(model_dir, False).generate([prompt], SamplingParams(max_tokens=300, grammar=JSON))
    stop = free.token_ids[4]
    params = [SamplingParams(max_tokens=300, grammar=JSON, stop_token_ids=(stop,)),
              SamplingParams(max_tokens=300, grammar=JSON),
              SamplingParams(max_tokens=len(free.token_ids) - 1, grammar=JSON),
              SamplingParams(max_tokens=40, ignore_eos=True)]
    results = {}
    for pipelined in (False, True):
        engine = make(model_dir, pipelined, caching=False)
        first = outcome(engine, [prompt] * 4, params)
        again = outcome(engine, [prompt] * 2, [params[1], params[3]])
        results[pipelined] = (first, again)
        assert_pools_empty(engine)
    assert results[True] == results[False]
    (stopped, _, _), (ended, reason, _), (cut, cut_reason, _), _ = results[True][0]
    assert stopped == free.token_ids[: stopped.index(stop) + 1]  # type: ignore[union-attr]
    assert ended == free.token_ids and reason == "stop"
    assert cut == free.token_ids[:-1] and cut_reason == "length"


class RejectingMatcher(GrammarMatcher):
    """A real matcher whose ``accept`` refuses its ``reject_at``-th token: the failure xgrammar
    would report for a token outside the grammar (the sampler's mask never lets one through, so
    only a broken step produces it)."""

    def __init__(self, inner: GrammarMatcher, reject_at: int) -> None:
        super().__init__(inner.handle, inner.batch)
        self.num_accepted, self.reject_at = 0, reject_at

    def accept(self, token_id: int) -> bool:
        if self.num_accepted == self.reject_at:
            return False
        self.num_accepted += 1
        return super().accept(token_id)


def run_until_rejected(engine: Engine, tokenizer: Tokenizer) -> tuple[int, list[int]]:
    """Three constrained requests, one of whose matchers refuses its 6th token: the step that
    samples it fails as it always has (an assertion naming the request); the rest are aborted, as
    the engine loop does after a failed step. Returns the tokens reported before the failure."""
    params = [SamplingParams(max_tokens=100, grammar=JSON), SamplingParams(max_tokens=100, grammar=TOOL_CALL),
              SamplingParams(max_tokens=40, ignore_eos=True)]
    ids = [engine.add_request(tokenizer.encode(f"Try {i}."), p, f"r{i}") for i, p in enumerate(params)]
    req = engine._requests["r1"]  # noqa: SLF001
    assert req.grammar is not None
    req.grammar = RejectingMatcher(req.grammar, reject_at=5)
    reported = 0
    with pytest.raises(AssertionError, match="request r1: sampled .* outside its grammar"):
        for _ in range(100):
            reported += sum(len(o.new_token_ids) for o in engine.step())
    for rid in ids:
        engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    return reported, req.output_token_ids


@pytest.mark.slow  # several engines, compared step by step
def test_a_token_the_grammar_rejects_fails_the_step_as_before(model_dir: Path, tokenizer: Tokenizer) -> None:
    results = {}
    for pipelined in (False, True):
        engine = make(model_dir, pipelined)
        results[pipelined] = run_until_rejected(engine, tokenizer)
        assert_pools_empty(engine)
        # The engine keeps serving constrained requests, with the same tokens as a fresh one.
        params = SamplingParams(max_tokens=300, grammar=JSON)
        prompt = tokenizer.encode("After.")
        assert outcome(engine, [prompt], [params]) == outcome(make(model_dir, pipelined), [prompt], [params])
    assert results[True] == results[False]
    reported, tokens = results[True]
    assert len(tokens) == 6  # the refused token was appended before its matcher refused it


@pytest.mark.slow  # several engines, compared step by step
def test_aborting_a_constrained_request_while_its_step_is_queued(model_dir: Path, tokenizer: Tokenizer) -> None:
    engine = make(model_dir, True)
    params = [SamplingParams(max_tokens=200, grammar=g) for g in (JSON, TOOL_CALL, REGEX)]
    prompts = [tokenizer.encode(f"Abort {i}.") for i in range(3)]
    alone = outcome(make(model_dir, True), prompts[1:], params[1:])
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(prompt, p, f"r{i}")
    done: dict[str, object] = {}
    for _ in range(6):
        for out in engine.step():
            done[out.request_id] = out
    assert engine._queued is not None and not engine._queued.awaits_sampling  # noqa: SLF001
    assert engine.abort_request("r0")
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert "r0" not in {k for k, o in done.items() if o.finished}  # type: ignore[attr-defined]
    finished = [(done[f"r{i}"].token_ids, done[f"r{i}"].finish_reason) for i in (1, 2)]  # type: ignore[attr-defined]
    assert finished == [(ids, reason) for ids, reason, _ in alone]
    assert_pools_empty(engine)


def test_the_decode_benchmark_times_the_queued_constrained_path(model_dir: Path) -> None:
    """``phloem bench decode --grammar`` steps the engine as served: its constrained steps are
    queued ahead like the plain ones."""
    from phloem.benchmarks.decode import BENCH_SCHEMA, run_decode

    engine = Engine.from_pretrained(model_dir, cache=CacheConfig(num_pages=64, num_state_slots=12))
    steps, warmup = 3, 3
    counts: list[int] = []
    original = engine.runner.sample_queued

    def counted(step: LaunchedStep) -> LaunchedStep:
        counts.append(int(step.awaits_sampling))
        return original(step)

    engine.runner.sample_queued = counted  # type: ignore[method-assign]
    result = run_decode(engine, 2, 64, bandwidth=1e9, steps=steps, warmup=warmup, compare_sync=False,
                        grammar=BENCH_SCHEMA)
    assert result.grammar_ms_per_step is not None
    # Each pass queues a step at every call (the first behind the step that lands the prompt-end
    # checkpoint): the plain pass's sampled at once, the constrained pass's awaiting the ids.
    assert engine.num_pipelined_steps == 2 * (steps + warmup)
    assert sum(counts) == steps + warmup


"""Every documented kernel switch (``KernelConfig``, the ``PHLOEM_*`` kernel variables) at the
real model shape on the GPU: the same requests give ids inside the vocabulary and logits within
the bf16 bound of the default configuration's, up to where the two greedy paths part; programmatic
dependent launch gives the default's tokens bit for bit.

The model is the Qwen3.5-35B-A3B shape (head_dim 256, 256 experts, its vocabulary; dummy weights)
cut to 8 layers, as in ``test_gpu_concurrency.py``, whose note on random logits holds here: two
numerically different paths part at near-ties within a few tokens, and a switch that computes
something else (a wrong page, slot, expert or id) moves the logits by ~1.4, not by rounding. The
requests reach each path a switch changes: a request decoding alone (the fused one-token path and
its CUDA graph), a batch of three with mixed lengths (the grouped paths), and their second turns
over the cached prefix, one a short chunk over a 5K-token history beside a decoding request (a
mixed step, whose decode rows run through the decode kernel: ``MixedPlan``). The same requests with
every row of a mixed step in the one prefill call follow the split too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from logits_recorder import LogitsRecorder, assert_logits_follow

from phloem.engine import Engine, SamplingParams
from phloem.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from phloem.kernels.config import KernelConfig
from phloem.runtime.model_shapes import SHAPES, ensure_shape_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = "qwen3.5-35b-a3b"
LAYERS = 8
REL_TOL = 0.5  # as test_gpu_concurrency.py: rounding and router near-ties stay under it

SWITCHES = {
    "PHLOEM_TRITON_GEMV=0": KernelConfig(triton_gemv=False),
    "PHLOEM_FUSED_DECODE=0": KernelConfig(fused_decode=False),
    "PHLOEM_KERNELS=torch": KernelConfig(backend="torch"),
    "PHLOEM_TRITON_DECODE_ATTENTION=0": KernelConfig(triton_decode_attention=False),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = ensure_shape_model(SHAPE, tmp_path_factory.mktemp("data"))
    (folder / "config.json").write_text(json.dumps(dict(SHAPES[SHAPE], num_hidden_layers=LAYERS)))
    return folder


def turns(engine: Engine, given: list[list[int]] | None = None) -> list[tuple[SamplingParams, list[int]]]:
    """Runs the requests; returns each one's params (the recorder's key) and tokens, in order.

    The second turns' prompts hold the first turns' outputs: ``given`` (another run's tokens, in
    the same order) puts that run's there, so both runs send the same prompts even where their
    greedy paths parted (the cache then holds a shorter prefix of them, another path it tests)."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    done: list[tuple[SamplingParams, list[int]]] = []
    kinds: list[str] = []  # of the steps collected

    def run(prompts: list[list[int]], max_tokens: list[int], after: list[int] | None = None) -> list[list[int]]:
        """Request i joins once ``after[i]`` steps have run (all at once by default)."""
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
        after = after or [0] * len(prompts)
        ids_of = {}
        finished: dict[str, list[int]] = {}
        steps = 0
        while len(finished) < len(prompts):
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                if after[i] == steps:
                    ids_of[i] = engine.add_request(prompt, p)
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.token_ids
            kinds.append(engine.last_step_kind)
            steps += 1
        outs = [finished[ids_of[i]] for i in range(len(prompts))]
        assert all(0 <= t < vocab for out in outs for t in out), "an id outside the vocabulary"
        done.extend(zip(params, outs))
        return outs

    alone = ids(300)
    (first,) = run([alone], [16])
    batch = [ids(5000), ids(40), ids(1200)]
    outs = run(batch, [12, 20, 8])
    if given is not None:
        first, outs = given[0], given[1:4]
    run([alone + first + ids(7)], [8])
    # The short request decodes while the long ones' second turns arrive: mixed steps.
    kinds.clear()
    run([ids(30), batch[0] + outs[0] + ids(64), batch[2] + outs[2] + ids(300)], [24, 10, 6], after=[0, 3, 6])
    assert kinds.count("mixed") >= 2, kinds
    return done


Run = tuple[list[list[int]], list[list[torch.Tensor]]]


def recorded(model_dir: Path, kernels: KernelConfig, monkeypatch: pytest.MonkeyPatch, split_mixed: bool = True,
             given: list[list[int]] | None = None) -> Run:
    """Each request's tokens and the logits rows it sampled from under ``kernels``, with async
    scheduling on and graphs where the op table allows them (the served defaults); ``given``:
    ``turns``'."""
    with monkeypatch.context() as m:
        recorder = LogitsRecorder(m)
        config = EngineConfig(cache=CacheConfig(num_pages=4096, num_state_slots=32),
                              scheduler=SchedulerConfig(max_num_seqs=4), kernels=kernels)
        engine = Engine.from_pretrained(model_dir, config, load_format="dummy", device="cuda", dtype="bfloat16")
        try:
            graphs = kernels.backend != "torch"  # the reference ops run eagerly (Engine)
            assert (engine.runner.graphs is not None) == graphs and engine.async_scheduling
            assert engine.runner.attn is not None
            engine.runner.attn.split_mixed = split_mixed
            seen = turns(engine, given)
        finally:
            engine.close()
    # A queued step may sample a request once past its end (the id is dropped): not compared.
    return [t for _, t in seen], [recorder.rows[id(p)][: len(t)] for p, t in seen]


@pytest.fixture(scope="module")
def default_run(model_dir: Path) -> Run:
    with pytest.MonkeyPatch.context() as m:
        return recorded(model_dir, KernelConfig(), m)


def test_pdl_off_gives_the_default_tokens_bitwise(model_dir: Path, default_run: Run,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch changes when kernels start, not what they compute."""
    want_tokens, _ = default_run
    got_tokens, _ = recorded(model_dir, KernelConfig(pdl=False), monkeypatch, given=want_tokens)
    assert got_tokens == want_tokens


@pytest.mark.parametrize("switch", ["mixed steps in one prefill call", *SWITCHES])
def test_each_switch_follows_the_default(model_dir: Path, default_run: Run, switch: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    want_tokens, want_rows = default_run
    if switch in SWITCHES:
        got_tokens, got_rows = recorded(model_dir, SWITCHES[switch], monkeypatch, given=want_tokens)
    else:
        got_tokens, got_rows = recorded(model_dir, KernelConfig(), monkeypatch, split_mixed=False, given=want_tokens)
    compared = assert_logits_follow(got_tokens, want_tokens, got_rows, want_rows, REL_TOL, f"the default's ({switch})")
    assert compared >= len(want_tokens)

"""Tensor parallelism at TP=4 and TP=8 on CPU over gloo: the same greedy tokens as TP=1.

The tiny checkpoints of the three architectures are built ``wide`` (``tests/conftest.py``,
``WIDE_HEADS``): 8 attention heads and 4 KV heads (split one per rank at TP=4, each replicated on
two ranks at TP=8), 8 GDN key and 16 value heads, FFN sizes that divide by 8. For each
(architecture, size) one TP engine is spawned per module (rank 0 here, the others child
processes; pytest runs the cases one after the other, so at most 8 ranks live at once) beside a
TP=1 engine given the same calls: batched and chunked prefill, batched and one-token decode (the
fused one-token path, its all-reduces inside the chain), multi-turn prefix hits, a fork, and a
spill/resume of exported state across the two sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from phloem.engine import Engine, SamplingParams
from phloem.kernels.dispatch import KernelOps
from phloem.engine.config import CacheConfig, ParallelConfig, SchedulerConfig
from tp_pairs import assert_stopped, both, clear, spill_and_resume, tokens

ARCHS = ["Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"]
# A 32-token budget chunks every longer prefill; no periodic checkpoints (turn ends only).
OPTIONS: dict[str, Any] = dict(
    cache=CacheConfig(page_size=16, num_pages=64, num_state_slots=16, checkpoint_interval=0),
    scheduler=SchedulerConfig(max_num_batched_tokens=32),
)
CASES = [(arch, size) for size in (4, 8) for arch in ARCHS]

pytestmark = pytest.mark.slow  # four- and eight-rank tensor-parallel process groups


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-tp{n}" for a, n in CASES])
def pair(request: pytest.FixtureRequest, tiny_checkpoint: Callable[..., Path]) -> Iterator[tuple[Engine, Engine]]:
    """(TP=1 engine, TP=N engine) of one architecture; the N-1 workers must exit cleanly at teardown."""
    arch, size = request.param
    path = tiny_checkpoint(arch, wide=True)
    tp = Engine.from_pretrained(path, parallel=ParallelConfig(tensor_parallel_size=size), **OPTIONS)
    try:
        assert tp.workers is not None and len(tp.workers.processes) == size - 1
        yield Engine.from_pretrained(path, **OPTIONS), tp
    finally:
        tp.close()
    assert_stopped(tp)


def test_batched_and_chunked_prefill_batched_and_one_token_decode(pair: tuple[Engine, Engine]) -> None:
    lengths = [1, 7, 17, 45]  # 45 is prefilled in chunks of 32
    both(pair, [tokens(n, 40 + n) for n in lengths], SamplingParams(max_tokens=6))
    both(pair, [tokens(11, 3)], SamplingParams(max_tokens=8))  # one-token decode steps


def test_prefix_hit_multi_turn_then_fork(pair: tuple[Engine, Engine]) -> None:
    history = tokens(37, 1)
    for turn in range(3):
        outs = [engine.generate([history], SamplingParams(max_tokens=5))[0] for engine in pair]
        assert outs[1].token_ids == outs[0].token_ids
        # Later turns hit the previous turn's end (its prompt and output).
        assert [o.num_cached_tokens for o in outs] == [0 if turn == 0 else len(history) - 3] * 2
        history = history + outs[0].token_ids + tokens(3, 10 + turn)
    # Fork: two continuations of the finished conversation; its partial last page is copied.
    conv = history[:-3]
    assert len(conv) % 16, "the fork point must be mid-page to exercise the tail-page copy"
    forks = both(pair, [conv + tokens(2, 20), conv + tokens(5, 21)], SamplingParams(max_tokens=5))
    assert len(forks) == 2
    clear(pair)


def test_spill_and_resume_move_between_tp_sizes(pair: tuple[Engine, Engine]) -> None:
    """The TP=N export equals the TP=1 one (the TP=1 layout; replicated KV heads exported once),
    and each engine resumes from the other's export with the tokens of a fresh recompute."""
    spill_and_resume(pair, max_tokens=5)


# The fused one-token ops of the path under TP, and those of the router folded into the projection
# before it (``kernels/moe/route_partial.py``), which needs the whole residual sum: TP=1 only.
FUSED_OPS = ("add_rms_norm_linear", "add_rms_norm_conv_linear", "gated_rms_norm_linear", "sigmoid_gate_linear",
             "add_rms_norm_router", "fused_moe_routed")  # fmt: skip
ROUTE_PARTIAL_OPS = ("gated_rms_norm_linear_route", "sigmoid_gate_linear_route", "fused_moe_route_partial")


def count_ops(model: nn.Module, names: tuple[str, ...]) -> tuple[dict[str, int], Callable[[], None]]:
    """Count the calls of the op table's ``names`` by ``model``'s modules; returns the counts and
    a function that puts the original tables back."""
    calls = dict.fromkeys(names, 0)

    def counted(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return op(*args, **kwargs)

        return call

    saved = [(m, m.ops) for m in model.modules() if isinstance(getattr(m, "ops", None), KernelOps)]
    for module, ops in saved:
        module.ops = replace(ops, **{n: counted(n, getattr(ops, n)) for n in names})  # type: ignore[assignment]

    def restore() -> None:
        for module, ops in saved:
            module.ops = ops  # type: ignore[assignment]

    return calls, restore


def test_one_token_decode_takes_the_fused_projections(pair: tuple[Engine, Engine]) -> None:
    """Rank 0's one-token steps (every rank runs the same code) call each fused projection once a
    layer of its kind, the all-reduce in front of the norm prologue; never the route-partial ops."""
    model = pair[1].runner.model
    config = model.config  # type: ignore[union-attr]
    assert model.tp.size > 1 and model.ops.fused_decode  # type: ignore[union-attr]
    calls, restore = count_ops(model, FUSED_OPS + ROUTE_PARTIAL_OPS)  # type: ignore[arg-type]
    try:
        both(pair, [tokens(13, 5)], SamplingParams(max_tokens=5))
    finally:
        restore()
    layers = config.num_hidden_layers
    attention = len(config.full_attention_layers)
    moe = sum(config.is_moe_layer(i) for i in range(layers))
    steps = calls["sigmoid_gate_linear"] // attention
    assert steps >= 4, calls  # the request's five tokens: four one-token steps at least
    per_step = {"add_rms_norm_linear": attention, "sigmoid_gate_linear": attention,
                "add_rms_norm_conv_linear": layers - attention, "gated_rms_norm_linear": layers - attention,
                "add_rms_norm_router": moe, "fused_moe_routed": moe} | dict.fromkeys(ROUTE_PARTIAL_OPS, 0)  # fmt: skip
    assert calls == {name: steps * n for name, n in per_step.items()}

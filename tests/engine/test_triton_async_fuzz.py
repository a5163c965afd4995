"""Concurrent requests on the real model's Triton op table (Triton's interpreter, CPU): async
scheduling gives the synchronous engine's tokens bit for bit.

A seeded script of operations between engine steps runs on an engine with async scheduling:
requests of different lengths and ``max_tokens`` arrive while others decode (some continue an
earlier conversation: prefix hits, turn-end and prompt-end checkpoints), some are aborted
mid-flight, and the pools are small enough that the radix cache evicts (and requests may be
preempted). Each arrival and abort is logged with the number of forwards launched before it.
A synchronous engine then replays the log at the same forward boundaries, so both engines run
the same forwards on the same batches, and every request's tokens and finish reason must be
equal; the pools must come back empty. (An async engine's ``step`` has the next decode forward
queued when it returns, so at the same call a synchronous engine is a forward behind: the log,
not the call count, lines them up.)
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from toy_model import assert_pools_empty

from phloem.engine import CacheConfig, Engine, RequestOutput, SamplingParams, SchedulerConfig
from phloem.engine.request import FinishReason, Request
from phloem.kernels.config import KernelConfig

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter (CPU machines)"),
]

Outcome = dict[str, tuple[list[int], str | None]]
# A script that arrives, aborts, decodes, preempts and evicts, in few forwards (the interpreter
# takes seconds per forward): checked against the torch op table over many seeds while writing it.
SEED, NUM_OPS = 50, 18


def make_script(seed: int, vocab: int, num_ops: int) -> list[tuple[object, ...]]:
    """Operations decided up front, so that neither engine's timing can steer them."""
    rng = random.Random(seed)
    ops: list[tuple[object, ...]] = []
    added: list[str] = []
    for i in range(num_ops):
        op = rng.random()
        if op < 0.3:
            base = rng.choice(added) if added and rng.random() < 0.5 else None
            fresh = [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 24))]
            ops.append(("add", f"r{i}", base, fresh, rng.randrange(1, 5)))
            added.append(f"r{i}")
        elif op < 0.37 and added:
            ops.append(("abort", rng.choice(added)))
        else:
            ops.append(("step",))
    return ops


class ForwardCounter:
    """Counts the forwards an engine launches."""

    def __init__(self, engine: Engine) -> None:
        self.count = 0
        launch = engine.runner.launch

        def counted(*args: object) -> object:
            self.count += 1
            return launch(*args)  # type: ignore[arg-type]

        engine.runner.launch = counted  # type: ignore[method-assign]


def collect(done: Outcome, outputs: list[RequestOutput]) -> None:
    for out in outputs:
        if out.finished:
            done[out.request_id] = (out.token_ids, out.finish_reason)


def finish(engine: Engine, done: Outcome) -> Outcome:
    while engine.has_unfinished_requests():
        collect(done, engine.step())
    return done


def run_async(engine: Engine, script: list[tuple[object, ...]]) -> tuple[Outcome, list[tuple[object, ...]]]:
    """Run ``script`` on an async engine; returns the outcome and the log of its arrivals and aborts.

    A continuation of a finished request extends its whole conversation (a prefix hit), else it
    starts from its fresh tokens."""
    forwards = ForwardCounter(engine)
    done: Outcome = {}
    log: list[tuple[object, ...]] = []
    requests: dict[str, Request] = {}
    for op in script:
        if op[0] == "add":
            _, rid, base, fresh, max_tokens = op
            engine.drain()
            prompt = list(fresh)  # type: ignore[call-overload]
            req = requests.get(base)  # type: ignore[arg-type]
            if req is not None and req.is_finished and req.finish_reason is not FinishReason.ABORT:
                prompt = req.all_token_ids + prompt
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid)  # type: ignore[arg-type]
            requests[rid] = engine._requests[rid]  # type: ignore[index]  # noqa: SLF001
            log.append(("add", forwards.count, rid, prompt, max_tokens))
        elif op[0] == "abort":
            aborted = engine.abort_request(op[1])  # type: ignore[arg-type]
            log.append(("abort", forwards.count, op[1], aborted))
            if aborted:
                done[op[1]] = ([], "abort")  # type: ignore[index]
        else:
            collect(done, engine.step())
    return finish(engine, done), log


def replay_sync(engine: Engine, log: list[tuple[object, ...]]) -> Outcome:
    forwards = ForwardCounter(engine)
    done: Outcome = {}
    for kind, at, rid, *rest in log:
        while forwards.count < at:  # type: ignore[operator]
            collect(done, engine.step())
        assert forwards.count == at, "the synchronous engine launched past the logged boundary"
        if kind == "add":
            prompt, max_tokens = rest
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid)  # type: ignore[arg-type]
        else:
            assert engine.abort_request(rid) == rest[0], f"{rid}: abort found another state"  # type: ignore[arg-type]
            if rest[0]:
                done[rid] = ([], "abort")  # type: ignore[index]
    return finish(engine, done)


@pytest.fixture(scope="module")
def two_layer_checkpoint(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5-MoE checkpoint cut to one GDN layer and one attention layer (its layers
    0 and 3): every kernel of the model runs, at half the interpreter's time per forward."""
    source = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    folder = tmp_path_factory.mktemp("two_layers")
    config = json.loads((source / "config.json").read_text())
    config.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {}
    for file in source.glob("*.safetensors"):
        for name, tensor in load_file(file).items():
            if ".layers.1." in name or ".layers.2." in name:
                continue
            tensors[name.replace(".layers.3.", ".layers.1.")] = tensor
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    return folder


def test_async_scheduling_gives_the_synchronous_tokens(two_layer_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    options = dict(dtype="float32", cache=CacheConfig(num_pages=8, num_state_slots=6, checkpoint_interval=32),
                   kernels=KernelConfig(backend="triton"))
    pipelined = Engine.from_pretrained(two_layer_checkpoint, scheduler=SchedulerConfig(max_num_batched_tokens=16, async_scheduling=True), **options)
    sync = Engine.from_pretrained(two_layer_checkpoint, scheduler=SchedulerConfig(max_num_batched_tokens=16, async_scheduling=False), **options)
    assert pipelined.runner.model.model.layers[0].mlp.ops.backend == "triton"
    outcome, log = run_async(pipelined, make_script(SEED, pipelined.model_config.vocab_size, NUM_OPS))
    assert replay_sync(sync, log) == outcome
    assert pipelined.num_pipelined_steps > 0 and sync.num_pipelined_steps == 0
    assert sum(reason == "length" for _, reason in outcome.values()) >= 3
    for engine in (pipelined, sync):
        assert_pools_empty(engine)

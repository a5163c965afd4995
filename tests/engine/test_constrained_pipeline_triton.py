"""Constrained requests on the Triton op table (Triton's interpreter, CPU): async scheduling, with
each constrained step's sampling queued after its forward, gives the synchronous engine's tokens
bit for bit (the torch op table's counterpart: ``test_constrained_pipeline.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from grammars import JSON, REGEX, TOOL_CALL
from safetensors.torch import load_file, save_file
from toy_model import assert_pools_empty

from phloem.engine import CacheConfig, Engine, SamplingParams, SchedulerConfig
from phloem.kernels.config import KernelConfig
from phloem.runtime import ensure_default_model

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton interpreter (CPU machines)"),
]


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in model (with its tokenizer, for the grammars) cut to one GDN layer and one
    attention layer (its layers 0 and 3): every kernel runs, at half the interpreter's time."""
    source = ensure_default_model(tmp_path_factory.mktemp("default-model"))
    folder = tmp_path_factory.mktemp("two-layer-default")
    for file in source.iterdir():
        if file.name.startswith("tokenizer"):
            shutil.copy(file, folder / file.name)
    config = json.loads((source / "config.json").read_text())
    assert config["layer_types"][0] == "linear_attention" and config["layer_types"][3] == "full_attention"
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


def test_constrained_steps_give_the_synchronous_tokens(two_layer_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Few forwards (the interpreter takes seconds each): a prefill, then four decode steps, the
    # last three queued ahead with their sampling waiting for the ids before.
    params = [SamplingParams(max_tokens=5, grammar=JSON),
              SamplingParams(max_tokens=5, grammar=TOOL_CALL, temperature=0.9, seed=2),
              SamplingParams(max_tokens=4, grammar=REGEX, temperature=1.0, seed=3, presence_penalty=0.5),
              SamplingParams(max_tokens=5, ignore_eos=True)]
    prompts = [[11 + i, 40, 7 * i + 3] for i in range(len(params))]
    outs = {}
    for pipelined in (True, False):
        engine = Engine.from_pretrained(two_layer_model, dtype="float32", cache=CacheConfig(num_pages=16, num_state_slots=12),
                                        scheduler=SchedulerConfig(async_scheduling=pipelined), kernels=KernelConfig(backend="triton"))
        assert engine.runner.model.model.layers[0].mlp.ops.backend == "triton"
        outs[pipelined] = [(o.token_ids, o.finish_reason) for o in engine.generate(prompts, params)]
        assert (engine.num_pipelined_steps > 0) == pipelined
        assert_pools_empty(engine)
    assert outs[True] == outs[False]

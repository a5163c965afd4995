"""``Engine.from_pretrained(path, config, **overrides)``: one typed ``EngineConfig`` of frozen
sections; ``load_format`` / ``device`` / ``dtype`` as plain keywords; the flat options of the
previous release mapped onto their sections with a ``DeprecationWarning``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from phloem.engine import (
    CacheConfig,
    Engine,
    EngineConfig,
    KernelConfig,
    LoadConfig,
    ParallelConfig,
    RunnerConfig,
    SamplingParams,
    SchedulerConfig,
)
from phloem.engine.overrides import apply_overrides

SMALL = CacheConfig(num_pages=64, num_state_slots=8)


def test_sections_are_frozen_slotted_and_typed() -> None:
    config = EngineConfig()
    assert (config.load, config.cache, config.scheduler) == (LoadConfig(), CacheConfig(), SchedulerConfig())
    assert (config.runner, config.parallel, config.kernels) == (RunnerConfig(), ParallelConfig(), KernelConfig())
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache = SMALL  # type: ignore[misc]
    assert not hasattr(config, "__dict__")
    with pytest.raises(ValueError, match="^cache: expected a CacheConfig, got dict"):
        EngineConfig(cache={"num_pages": 64})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        (LoadConfig, "load_format", "gguf"),
        (LoadConfig, "device", "mps"),
        (LoadConfig, "device", "cuda:x"),
        (LoadConfig, "dtype", "fp8"),
        (LoadConfig, "seed", -1),
        (CacheConfig, "page_size", 0),
        (CacheConfig, "num_pages", True),
        (CacheConfig, "cpu_pool_bytes", 0),
        (CacheConfig, "checkpoint_interval", -16),
        (SchedulerConfig, "max_num_seqs", -3),
        (SchedulerConfig, "max_num_batched_tokens", 0),
        (ParallelConfig, "tensor_parallel_size", 16),
    ],
)
def test_sections_reject_bad_values_naming_the_field(section: type, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        section(**{field: value})


def test_the_step_budget_is_decided_by_the_device() -> None:
    assert SchedulerConfig().for_device("cuda:1").max_num_batched_tokens == 8192
    assert SchedulerConfig().for_device("cpu").max_num_batched_tokens == 512
    assert SchedulerConfig(max_num_batched_tokens=96).for_device("cuda").max_num_batched_tokens == 96


def test_overrides_replace_sections_and_load_keywords_override_load() -> None:
    base = EngineConfig(load=LoadConfig(dtype="float32", seed=3), cache=SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither sections nor the load keywords warn
        config = apply_overrides(base, {"scheduler": SchedulerConfig(max_num_seqs=2)},
                                 {"load_format": "dummy", "device": None, "dtype": "bfloat16"})
    assert config.load == LoadConfig(load_format="dummy", dtype="bfloat16", seed=3)
    assert (config.cache, config.scheduler.max_num_seqs) == (SMALL, 2)
    assert apply_overrides(None, {}, {}) == EngineConfig()


def test_flat_options_map_onto_their_sections_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"config=EngineConfig\(cache=CacheConfig\(num_pages=\.\.\.") as caught:
        config = apply_overrides(None, {"num_pages": 64, "max_num_seqs": 4, "show_progress": False,
                                        "tensor_parallel_size": 2, "pdl": False}, {})
    assert config.cache.num_pages == 64 and config.scheduler.max_num_seqs == 4
    assert config.load.show_progress is False and config.parallel.tensor_parallel_size == 2
    assert config.kernels.pdl is False
    assert len(caught) == 5  # one warning per section, each naming its new spelling
    assert any("scheduler=SchedulerConfig(max_num_seqs=...)" in str(w.message) for w in caught)


def test_unknown_options_and_ambiguous_ones_are_type_errors() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['max_batch'\]"):
        apply_overrides(None, {"max_batch": 8}, {})
    with pytest.raises(TypeError, match=r"\['num_pages'\] and cache= both given"), warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_overrides(None, {"num_pages": 8, "cache": SMALL}, {})
    with pytest.raises(TypeError, match="config: expected an EngineConfig, got dict"):
        apply_overrides({"cache": SMALL}, {}, {})  # type: ignore[arg-type]


def test_from_pretrained_takes_a_config(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5ForCausalLM")
    config = EngineConfig(load=LoadConfig(load_format="dummy", seed=1), cache=SMALL,
                          scheduler=SchedulerConfig(max_num_batched_tokens=96, max_num_seqs=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = Engine.from_pretrained(path, config)
        plain = Engine.from_pretrained(path, load_format="dummy", device="cpu", dtype="auto", cache=SMALL)
    assert engine.page_pool.num_pages == 64 and engine.slot_pool.num_slots == 8
    assert (engine.scheduler.config.max_num_batched_tokens, engine.scheduler.config.max_num_seqs) == (96, 3)
    assert engine.config.load.device == "cpu" and engine.config.kernels == KernelConfig()
    # The load keywords override only the fields they name; the budget is the CPU's default.
    assert plain.config.load.seed == 0 and plain.scheduler.config.max_num_batched_tokens == 512


def test_old_flat_keywords_build_the_same_engine(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5ForCausalLM")
    new = Engine.from_pretrained(path, EngineConfig(cache=SMALL, scheduler=SchedulerConfig(max_num_batched_tokens=32)))
    with pytest.warns(DeprecationWarning, match="Engine.from_pretrained"):
        old = Engine.from_pretrained(path, num_pages=64, num_state_slots=8, max_num_batched_tokens=32)
    assert old.config == new.config
    prompt = [(i * 5) % 200 for i in range(70)]  # three chunks of 32
    params = SamplingParams(max_tokens=4)
    assert old.generate([prompt], params)[0].token_ids == new.generate([prompt], params)[0].token_ids
    with pytest.raises(TypeError, match="unknown option"):
        Engine.from_pretrained(path, max_batch=8)


def test_the_config_imports_without_torch() -> None:
    check = "import sys; from phloem.engine import EngineConfig; EngineConfig(); assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", check], timeout=60).returncode == 0

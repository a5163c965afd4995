"""``Engine.from_pretrained(path, config, **sections)``: one typed ``EngineConfig`` of frozen
sections; ``load_format`` / ``device`` / ``dtype`` as plain keywords; whole sections by keyword
(``EngineConfig.with_sections``); a section's option on its own (``num_pages=64``, the flat
keywords of earlier releases) a ``TypeError`` naming the section."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import phloem.engine.engine as engine_module
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


class _Built(Exception):
    """Raised by the stub loader with the configuration ``from_pretrained`` would build from."""


def built_config(monkeypatch: pytest.MonkeyPatch, *args: Any, **kwargs: Any) -> EngineConfig:
    """The ``EngineConfig`` that ``Engine.from_pretrained(*args, **kwargs)`` hands the loader."""

    def load_parts(path: Any, config: EngineConfig) -> None:
        raise _Built(config)

    monkeypatch.setattr(engine_module, "load_parts", load_parts)
    with pytest.raises(_Built) as built:
        Engine.from_pretrained("unused", *args, **kwargs)
    return built.value.args[0]


def test_sections_replace_the_config_and_load_keywords_override_load(monkeypatch: pytest.MonkeyPatch) -> None:
    base = EngineConfig(load=LoadConfig(dtype="float32", seed=3), cache=SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither sections nor the load keywords warn
        config = built_config(monkeypatch, base, scheduler=SchedulerConfig(max_num_seqs=2),
                              load_format="dummy", device=None, dtype="bfloat16")
    assert config.load == LoadConfig(load_format="dummy", dtype="bfloat16", seed=3)
    assert (config.cache, config.scheduler.max_num_seqs) == (SMALL, 2)
    assert built_config(monkeypatch) == EngineConfig()
    assert base.with_sections(scheduler=SchedulerConfig(max_num_seqs=2)) == config.with_sections(load=base.load)
    assert base.with_sections() == base


@pytest.mark.parametrize(
    ("option", "spelling"),
    [
        ("num_pages", "cache=CacheConfig(num_pages=...)"),
        ("max_num_seqs", "scheduler=SchedulerConfig(max_num_seqs=...)"),
        ("show_progress", "load=LoadConfig(show_progress=...)"),
        ("tensor_parallel_size", "parallel=ParallelConfig(tensor_parallel_size=...)"),
        ("pdl", "kernels=KernelConfig(pdl=...)"),
    ],
)
def test_a_flat_option_is_a_type_error_naming_its_section(
    option: str, spelling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(TypeError, match=f"^{option}= is an option of the {spelling.split('=')[0]} section: pass "
                                        + re.escape(spelling) + "$"):
        built_config(monkeypatch, **{option: 2})
    with pytest.raises(TypeError, match=re.escape(spelling)):
        EngineConfig().with_sections(**{option: 2})


def test_unknown_options_and_a_config_of_the_wrong_type_are_type_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match=r"unknown option 'max_batch': expected a section \(load, cache, "):
        built_config(monkeypatch, max_batch=8)
    with pytest.raises(TypeError, match="num_pages= is an option of the cache section"):
        built_config(monkeypatch, num_pages=8, cache=SMALL)
    with pytest.raises(TypeError, match="config: expected an EngineConfig, got dict"):
        built_config(monkeypatch, {"cache": SMALL})
    with pytest.raises(ValueError, match="^cache: expected a CacheConfig, got dict"):
        EngineConfig().with_sections(cache={"num_pages": 64})


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


def test_sections_by_keyword_build_the_config_s_engine(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5ForCausalLM")
    new = Engine.from_pretrained(path, EngineConfig(cache=SMALL, scheduler=SchedulerConfig(max_num_batched_tokens=32)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keywords = Engine.from_pretrained(path, cache=SMALL, scheduler=SchedulerConfig(max_num_batched_tokens=32))
    assert keywords.config == new.config
    prompt = [(i * 5) % 200 for i in range(70)]  # three chunks of 32
    params = SamplingParams(max_tokens=4)
    assert keywords.generate([prompt], params)[0].token_ids == new.generate([prompt], params)[0].token_ids
    with pytest.raises(TypeError, match="unknown option"):
        Engine.from_pretrained(path, max_batch=8)
    with pytest.raises(TypeError, match=re.escape("pass cache=CacheConfig(num_pages=...)")):
        Engine.from_pretrained(path, num_pages=64, num_state_slots=8, max_num_batched_tokens=32)


def test_the_config_imports_without_torch() -> None:
    check = "import sys; from phloem.engine import EngineConfig; EngineConfig(); assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", check], timeout=60).returncode == 0

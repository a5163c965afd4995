"""ServerConfig / EngineConfig validation and the PHLOEM_* environment."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from phloem.engine.config import CacheConfig, LoadConfig, ParallelConfig, SchedulerConfig
from phloem.runtime.config import EngineConfig, ServerConfig
from phloem.runtime.env import EnvSettings, default_data_dir, read_env


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("host", ""),
        ("port", 70000),
        ("port", -1),
        ("model", ""),
        ("data_dir", "/tmp/not-a-path-object"),
        ("redis_url", "localhost:6379"),
        ("device", "tpu"),
        ("device", "cuda:x"),
        ("dtype", "int8"),
        ("default_ttl_s", -1.0),
        ("max_body_bytes", 0),
        ("tensor_parallel_size", 0),
        ("tensor_parallel_size", 9),
    ],
)
def test_server_config_rejects_bad_values_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        ServerConfig(**{field: value})


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        (LoadConfig, "load_format", "gguf"),
        (LoadConfig, "device", "mps"),
        (LoadConfig, "dtype", "fp8"),
        (LoadConfig, "seed", -1),
        (CacheConfig, "page_size", 0),
        (CacheConfig, "num_pages", True),
        (SchedulerConfig, "max_num_seqs", -3),
        (CacheConfig, "checkpoint_interval", -16),
        (ParallelConfig, "tensor_parallel_size", 16),
    ],
)
def test_engine_config_sections_reject_bad_values_naming_the_field(section: type, field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        section(**{field: value})


def test_configs_are_frozen_and_slotted() -> None:
    config = ServerConfig(data_dir=Path("/tmp/x"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]
    assert not hasattr(config, "__dict__") and not hasattr(EngineConfig(), "__dict__")


def test_the_default_engine_config_leaves_engine_defaults_alone() -> None:
    assert ServerConfig().engine_config == EngineConfig()
    tuned = ServerConfig(engine=EngineConfig(cache=CacheConfig(num_pages=8)), max_context_len=256).engine_config
    assert (tuned.cache.num_pages, tuned.scheduler.max_model_len) == (8, 256)


def test_server_engine_config_follows_device_and_dtype() -> None:
    config = ServerConfig(device="cuda:1", dtype="bfloat16", data_dir=Path("/d"))
    assert config.engine_config == EngineConfig(load=LoadConfig(device="cuda:1", dtype="bfloat16"))
    assert config.models_dir == Path("/d/models")
    tuned = EngineConfig(load=LoadConfig(device="cuda:1", dtype="bfloat16"), scheduler=SchedulerConfig(max_num_seqs=4))
    assert ServerConfig(device="cuda:1", dtype="bfloat16", engine=tuned).engine_config is tuned
    with pytest.raises(ValueError, match="^engine: "):
        ServerConfig(device="cpu", engine=tuned)
    with pytest.raises(ValueError, match="^engine: expected an EngineConfig"):
        ServerConfig(engine={"load": LoadConfig()})  # type: ignore[arg-type]


def test_tensor_parallel_size_is_a_server_flag_the_engine_config_follows() -> None:
    assert ServerConfig(tensor_parallel_size=2).engine_config.parallel.tensor_parallel_size == 2
    assert ServerConfig().engine_config.parallel == ParallelConfig()
    with pytest.raises(ValueError, match="^engine: its tensor_parallel_size"):
        ServerConfig(tensor_parallel_size=2, engine=EngineConfig())


def test_read_env_reads_only_the_prefix() -> None:
    env = read_env({"PHLOEM_DATA_DIR": "~/phd", "PHLOEM_PORT": "9001", "PHLOEM_MODEL": "", "PORT": "1"})
    assert env == EnvSettings(data_dir=Path("~/phd").expanduser(), port=9001)
    with pytest.raises(ValueError, match="PHLOEM_PORT"):
        read_env({"PHLOEM_PORT": "eighty"})


def test_data_dir_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PHLOEM_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path == ServerConfig().data_dir
    monkeypatch.delenv("PHLOEM_DATA_DIR")
    assert ServerConfig().data_dir == Path("~/.phloem").expanduser()

"""ServerConfig and its sections (EngineConfig, SessionConfig, HttpConfig, PDConfig): validation,
each option declared once, and the PHLOEM_* environment."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from phloem.api.server.config import HttpConfig
from phloem.cli.config import SECTIONS, ServerConfig
from phloem.engine.config import CacheConfig, EngineConfig, LoadConfig, ParallelConfig, SchedulerConfig
from phloem.runtime.env import VARIABLES, EnvSettings, default_data_dir, read_env
from phloem.runtime.pd.roles import PDConfig
from phloem.sessions.config import SessionConfig


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        (HttpConfig, "host", ""),
        (HttpConfig, "port", 70000),
        (HttpConfig, "port", -1),
        (ServerConfig, "model", ""),
        (SessionConfig, "data_dir", "/tmp/not-a-path-object"),
        (SessionConfig, "redis_url", "localhost:6379"),
        (LoadConfig, "device", "tpu"),
        (LoadConfig, "device", "cuda:x"),
        (LoadConfig, "dtype", "int8"),
        (SessionConfig, "default_ttl_s", -1.0),
        (HttpConfig, "max_body_bytes", 0),
        (ParallelConfig, "tensor_parallel_size", 0),
        (ParallelConfig, "tensor_parallel_size", 9),
    ],
)
def test_server_config_rejects_bad_values_naming_the_field(section: type, field: str, value: Any) -> None:
    """Each option is validated in its section; the message starts with the field's name."""
    with pytest.raises(ValueError, match=f"^{field}: "):
        section(**{field: value})


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
    config = ServerConfig(sessions=SessionConfig(data_dir=Path("/tmp/x")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.model = "m"  # type: ignore[misc]
    for value in (config, config.http, config.sessions, EngineConfig()):
        assert not hasattr(value, "__dict__")


def test_sections_are_always_there_and_of_their_type() -> None:
    config = ServerConfig()
    assert (config.engine, config.sessions.default_ttl_s, config.http, config.pd) == (
        EngineConfig(), 300.0, HttpConfig(), PDConfig())
    with pytest.raises(ValueError, match="^engine: expected an EngineConfig"):
        ServerConfig(engine={"load": LoadConfig()})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^sessions: expected a SessionConfig"):
        ServerConfig(sessions=None)  # type: ignore[arg-type]


def test_the_server_paths_follow_the_sessions_data_dir() -> None:
    config = ServerConfig(sessions=SessionConfig(data_dir=Path("/d")))
    assert (config.data_dir, config.models_dir) == (Path("/d"), Path("/d/models"))


def test_a_disaggregated_instance_needs_the_prefix_cache() -> None:
    no_cache = EngineConfig(cache=CacheConfig(enable_prefix_caching=False))
    with pytest.raises(ValueError, match="^pd: --role decode needs the prefix cache"):
        ServerConfig(engine=no_cache, pd=PDConfig(role="decode", peer="h:1"))
    assert ServerConfig(engine=no_cache).pd.role == "both"


def test_the_session_ttl_is_bounded_by_the_largest_ttl() -> None:
    assert SessionConfig(default_ttl_s=86_400.0).default_ttl_s == 86_400.0
    with pytest.raises(ValueError, match="^default_ttl_s: "):
        SessionConfig(default_ttl_s=86_401.0)


def _fields(cls: type, where: str) -> list[tuple[str, str]]:
    """``(field name, dotted path)`` of every leaf field of ``cls``, sections walked recursively."""
    found: list[tuple[str, str]] = []
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            found += _fields(factory, f"{where}.{f.name}")
        else:
            found.append((f.name, f"{where}.{f.name}"))
    return found


# Names that may appear in two sections, each with why. Keep it empty unless an option truly
# must repeat (two sections that each need their own value under the same name).
ALLOWED_REPEATS: dict[str, str] = {}


def test_every_option_is_declared_in_one_section_only() -> None:
    """Walks ``ServerConfig`` and every section dataclass in it: a field name declared in two
    sections is one option spelled twice (two defaults, two validations that drift apart)."""
    leaves = _fields(ServerConfig, "ServerConfig")
    assert {path.split(".")[1] for _, path in leaves if path.count(".") > 1} == set(SECTIONS)
    by_name: dict[str, list[str]] = {}
    for name, path in leaves:
        by_name.setdefault(name, []).append(path)
    repeated = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in ALLOWED_REPEATS}
    assert not repeated, f"options declared in more than one section: {repeated}"


def test_read_env_reads_only_the_prefix() -> None:
    env = read_env({"PHLOEM_DATA_DIR": "~/phd", "PHLOEM_PORT": "9001", "PHLOEM_MODEL": "", "PORT": "1"})
    assert env == EnvSettings(data_dir=Path("~/phd").expanduser(), port=9001)
    with pytest.raises(ValueError, match="PHLOEM_PORT"):
        read_env({"PHLOEM_PORT": "eighty"})


def test_env_settings_are_generated_from_the_table() -> None:
    """One ``EnvSettings`` field per ``VARIABLES`` row without a kernel field, named after it."""
    assert [f.name for f in dataclasses.fields(EnvSettings)] == [
        v.name.removeprefix("PHLOEM_").lower() for v in VARIABLES if v.kernel_field is None]
    assert "secret-value" not in repr(read_env({"PHLOEM_API_KEY": "secret-value"}))
    assert read_env({"PHLOEM_MODEL": "~/m"}).model == "~/m"  # a folder name, as given


def test_data_dir_default_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PHLOEM_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path == ServerConfig().data_dir
    monkeypatch.delenv("PHLOEM_DATA_DIR")
    assert ServerConfig().data_dir == Path("~/.phloem").expanduser()

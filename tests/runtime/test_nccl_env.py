"""NCCL's process settings: the runtime sets them before it builds an engine, and the
tensor-parallel workers inherit them. The engine reads and writes no environment variable
(``runtime.env.use_nccl_defaults``; docs/decisions.md)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from phloem.engine import Engine
from phloem.engine.config import CacheConfig, EngineConfig, ParallelConfig
from phloem.runtime.engine_client import EngineClient
from phloem.runtime.env import NCCL_DEFAULTS, use_nccl_defaults
from phloem.runtime.pd.decode import engine_client_for
from phloem.runtime.pd.prefill import run_prefill_worker
from phloem.runtime.pd.roles import PDConfig

NVLS = "NCCL_NVLS_ENABLE"


def test_nccl_defaults_turn_nvlink_multicast_off() -> None:
    assert NCCL_DEFAULTS == {NVLS: "0"}


def test_use_nccl_defaults_sets_only_what_is_unset() -> None:
    env: dict[str, str] = {}
    assert use_nccl_defaults(env) == {NVLS: "0"}
    assert env == {NVLS: "0"}
    env = {NVLS: "1", "OTHER": "x"}
    assert use_nccl_defaults(env) == {NVLS: "1"}
    assert env == {NVLS: "1", "OTHER": "x"}


class _Built(Exception):
    """Raised by the stub loader: the engine would be built now."""


@pytest.mark.parametrize(
    "build",
    [
        lambda: EngineClient.from_pretrained("model"),
        lambda: engine_client_for("model", EngineConfig(), PDConfig()),
        lambda: run_prefill_worker("model", EngineConfig(), PDConfig()),
    ],
    ids=["engine-client", "serve", "pd-prefill"],
)
def test_the_runtime_sets_nccl_defaults_before_it_builds_an_engine(
    build: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(NVLS, raising=False)
    seen: list[str | None] = []

    def from_pretrained(*args: Any, **kwargs: Any) -> Engine:
        seen.append(os.environ.get(NVLS))
        raise _Built

    monkeypatch.setattr(Engine, "from_pretrained", from_pretrained)
    with pytest.raises(_Built):
        build()
    assert seen == ["0"]


@pytest.mark.slow  # two-rank tensor-parallel process group
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/environ")
def test_tensor_parallel_workers_start_with_this_process_nccl_settings(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers are spawned processes: the environment they started with (``/proc``) holds
    what the runtime set in rank 0's process before the engine was built."""
    monkeypatch.delenv(NVLS, raising=False)
    use_nccl_defaults()
    config = EngineConfig(cache=CacheConfig(num_pages=32, num_state_slots=4),
                          parallel=ParallelConfig(tensor_parallel_size=2))
    engine = Engine.from_pretrained(tiny_checkpoint("Qwen3_5ForCausalLM"), config)
    try:
        assert engine.workers is not None and len(engine.workers.processes) == 1
        for proc in engine.workers.processes:
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            assert f"{NVLS}=0".encode() in environ
    finally:
        engine.close()

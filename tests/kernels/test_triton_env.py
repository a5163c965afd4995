"""Launch configurations from the environment (``kernels.triton._env.env_config``)."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from phloem.kernels.triton._env import env_config


class _Config(NamedTuple):
    block_n: int
    num_warps: int
    prefetch: bool


def test_reads_one_integer_per_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHLOEM_TEST_CONFIG", " 4,8,1 ")
    assert env_config("PHLOEM_TEST_CONFIG", _Config) == _Config(4, 8, True)


@pytest.mark.parametrize("text", [None, "", "  "])
def test_unset_or_empty_is_none(monkeypatch: pytest.MonkeyPatch, text: str | None) -> None:
    if text is None:
        monkeypatch.delenv("PHLOEM_TEST_CONFIG", raising=False)
    else:
        monkeypatch.setenv("PHLOEM_TEST_CONFIG", text)
    assert env_config("PHLOEM_TEST_CONFIG", _Config) is None


@pytest.mark.parametrize("text", ["4,8", "4,8,1,2", "4,x,1", "4.0,8,1"])
def test_anything_else_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("PHLOEM_TEST_CONFIG", text)
    with pytest.raises(ValueError, match=r"PHLOEM_TEST_CONFIG: expected 3 comma-separated integers \(block_n, num_warps, prefetch\)"):
        env_config("PHLOEM_TEST_CONFIG", _Config)


class _WithDefault(NamedTuple):
    block_n: int
    num_warps: int
    maxnreg: int = 0


def test_trailing_defaults_may_be_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHLOEM_TEST_CONFIG", "2,4")
    assert env_config("PHLOEM_TEST_CONFIG", _WithDefault) == _WithDefault(2, 4, 0)
    monkeypatch.setenv("PHLOEM_TEST_CONFIG", "2,4,96")
    assert env_config("PHLOEM_TEST_CONFIG", _WithDefault) == _WithDefault(2, 4, 96)
    for text in ("2", "2,4,96,1"):
        monkeypatch.setenv("PHLOEM_TEST_CONFIG", text)
        with pytest.raises(ValueError, match=r"expected 2 to 3 comma-separated integers \(block_n, num_warps, maxnreg\)"):
            env_config("PHLOEM_TEST_CONFIG", _WithDefault)

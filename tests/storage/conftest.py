"""Fixtures for the storage tests: tiny segments, both index backends, an unprivileged runner."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from redis_support import random_prefix, require_redis

from phloem.storage import RedisIndex, Segment, SessionIndex, SQLiteIndex

# Tiny hybrid model: 2 attention layers, 3 GDN layers; 10 tokens = 3 pages of 4 (last partial).
NUM_ATTN_LAYERS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 2, 2, 8, 4
NUM_GDN_LAYERS, CONV_DIM, CONV_KERNEL, NUM_V_HEADS, KEY_DIM, VALUE_DIM = 3, 12, 4, 2, 8, 6
FINGERPRINT = "tiny-hybrid@sha256:0123abcd"


def segment_tensors(num_tokens: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors of the tiny layout; ``dtype`` is the model (KV and conv) dtype."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-num_tokens // PAGE_SIZE)
    kv_shape = (NUM_ATTN_LAYERS, num_pages, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return {
        "kv": torch.randn(kv_shape, generator=gen).to(dtype),
        "conv": torch.randn(NUM_GDN_LAYERS, CONV_DIM, CONV_KERNEL - 1, generator=gen).to(dtype),
        "ssm": torch.randn(NUM_GDN_LAYERS, NUM_V_HEADS, KEY_DIM, VALUE_DIM, generator=gen),
        "token_ids": torch.randint(0, 151_000, (num_tokens,), generator=gen, dtype=torch.int64),
    }


@pytest.fixture
def make_segment() -> Callable[..., Segment]:
    """Factory for consistent segments of the tiny layout."""

    def make(
        session_id: str = "sess-A",
        segment_id: str = "seg-1",
        *,
        dtype: torch.dtype = torch.bfloat16,
        num_tokens: int = 10,
        seed: int = 0,
        fingerprint: str = FINGERPRINT,
        created_at: float | None = None,
    ) -> Segment:
        return Segment.from_tensors(
            session_id=session_id,
            segment_id=segment_id,
            model_fingerprint=fingerprint,
            tensors=segment_tensors(num_tokens, dtype, seed),
            created_at=created_at,
        )

    return make


def _assert_bit_exact(actual: Segment, expected: Segment) -> None:
    """Same header, same tensor names, dtypes, shapes and bytes (NaN-safe, -0.0-safe)."""
    assert actual.meta == expected.meta
    assert sorted(actual.tensors) == sorted(expected.tensors)
    for name, want in expected.tensors.items():
        got = actual.tensors[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
        assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits)), name


@pytest.fixture
def make_tensors() -> Callable[[int, torch.dtype, int], dict[str, torch.Tensor]]:
    """`segment_tensors`: random tensors of the tiny layout."""
    return segment_tensors


@pytest.fixture
def assert_bit_exact() -> Callable[[Segment, Segment], None]:
    """Assert two segments have equal headers and bit-identical tensors."""
    return _assert_bit_exact


@pytest.fixture
def fingerprint() -> str:
    """The tiny model's fingerprint used by `make_segment`."""
    return FINGERPRINT


@pytest.fixture
def redis_server_url() -> str:
    """URL of a Redis server that answers; fails (never skips) when none does.

    CI guarantees a server; ``PHLOEM_TEST_REDIS_URL=''`` opts out, and only then do the Redis
    cases skip.
    """
    return require_redis()


@pytest.fixture(params=["sqlite", "redis"])
def index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SessionIndex]:
    """Each backend, empty; Redis under a random prefix that is deleted afterwards."""
    idx: SessionIndex
    if request.param == "sqlite":
        idx = SQLiteIndex(tmp_path / "index.sqlite")
    else:
        idx = RedisIndex(request.getfixturevalue("redis_server_url"), prefix=random_prefix())
    yield idx
    if idx.health():
        idx.clear()
    idx.close()


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _drop_dac_capabilities() -> None:
    # Capabilities are per thread on Linux: clearing CAP_DAC_OVERRIDE (1) and
    # CAP_DAC_READ_SEARCH (2) here makes this thread obey file modes like a normal user.
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget failed")
    data[0].effective &= ~((1 << 1) | (1 << 2))
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")


@pytest.fixture
def unprivileged() -> Callable[[Callable[[], Any]], Any]:
    """Run a callable so that file permissions apply to it, even when the tests run as root."""

    def run(fn: Callable[[], Any]) -> Any:
        if os.geteuid() != 0:
            return fn()
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                _drop_dac_capabilities()
                outcome["value"] = fn()
            except BaseException as e:  # re-raised in the calling thread below
                outcome["error"] = e

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    return run

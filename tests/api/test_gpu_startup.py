"""On a GPU, ``phloem serve`` is ready when it says so: the kernel warm-up runs before ``/health``
answers, so the first requests after it compile nothing (the first chat request within 2 s of
ready), and the compiled kernels are cached under ``<data-dir>/kernel-cache``, so a second start
on the same data directory warms up much faster.

Run by hand on the GPU machine (a fresh data directory each time, so the caches start empty)::

    python3 -m pytest -m gpu tests/api/test_gpu_startup.py -q -s
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import torch
from live_servers import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FIRST_REQUEST_S = 2.0
SHAPES = [pytest.param("tiny", id="tiny"),
          pytest.param("qwen3.5-35b-a3b", id="35b-a3b", marks=pytest.mark.slow)]


def phase_seconds(log: str, phase: str) -> float:
    """The last ``startup.phase phase=<phase> seconds=<s>`` of a text log."""
    return float(re.findall(rf"startup\.phase phase={phase} seconds=([0-9.]+)", log)[-1])


def chat(base_url: str, model: str, text: str, max_tokens: int) -> float:
    """Seconds for one non-streamed chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True}
    t0 = time.monotonic()
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return time.monotonic() - t0


@pytest.mark.parametrize("shape", SHAPES)
def test_ready_means_warm_and_the_second_start_reuses_the_kernel_cache(
        shape: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The caches go under the data dir only when these are unset (runtime.env.use_kernel_caches).
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("FLASHINFER_WORKSPACE_BASE", raising=False)
    args = ["--shape", shape, "--device", "cuda", "--dtype", "bfloat16"]
    warm_up = []
    for start in range(2):
        server = ServerProcess(tmp_path, args, log=tmp_path / f"server-{start}.log").start(timeout_s=1800)
        try:
            first = chat(server.base_url, shape, "Hello there, how are you today?", 16)
            assert first < FIRST_REQUEST_S, f"start {start}: the first chat request took {first:.2f} s"
            # A long prompt (several prefill chunks, then decode) as fast the first time as the second.
            long_text = " ".join(f"word{i}" for i in range(3000))
            cold, hot = chat(server.base_url, shape, long_text, 32), chat(server.base_url, shape, long_text + " x", 32)
            assert cold < 2 * hot + 0.5, f"start {start}: long prompt {cold:.2f} s cold vs {hot:.2f} s warm"
        finally:
            server.stop()
        assert server.log is not None
        log = server.log.read_text()
        warm_up.append(phase_seconds(log, "warm_up"))
        print(f"\n{shape} start {start}: warm-up {warm_up[-1]:.1f} s, first chat {first:.3f} s, "
              f"long prompt {cold:.2f} s then {hot:.2f} s; {re.findall(r'startup.ready .*', log)[-1]}")
    cache = tmp_path / "kernel-cache"
    assert any((cache / "triton").rglob("*")), "Triton's kernels are cached in the data dir"
    assert warm_up[1] < 0.5 * warm_up[0] or warm_up[0] < 5, f"the second start recompiled: warm-ups {warm_up}"

"""``GET /metrics`` of a real ``phloem serve`` process after a known session workload.

Token expectations come from the cache's contract, not from the counters: every generated turn
ends with a checkpoint at its very end, so a generation's ``cached_tokens`` is the length of the
history committed by the last generated turn it continues (0 on a fresh server), whatever was
appended since (turn 0 and appends without generation are computed by the next generation). The
counters must then be the sums of the usages the API returned. Segment bytes follow from the
model's config (KV pages of the full-attention layers, conv and SSM state of the GDN layers, the
token ids). The second half restarts the server on the same data directory, so the session
spilled to disk is resumed by importing its segment.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from live_servers import ServerProcess
from prometheus_client.parser import text_string_to_metric_families
import pytest
import torch

from phloem.api import Client
from phloem.runtime.builtin_model import trained_model_path

pytestmark = pytest.mark.slow  # phloem serve processes of its own

GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
KEY = "metrics-test-key-0123456789"
ADMIN = "metrics-admin-key-0123456789"
PAGE_SIZE = 16  # the engine's default page size (CacheConfig)


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics`` (with API keys, the route needs an admin key)."""
    response = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    assert response.headers["x-request-id"].startswith("req_")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def documented_metrics() -> set[str]:
    """The metric names docs/api.md's metrics table spells out (labels dropped)."""
    doc = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
    return {re.sub(r"\{.*\}", "", name) for line in doc.splitlines() if line.startswith("| `phloem_")
            for name in re.findall(r"`(phloem_[^`]+)`", line.split(" | ")[0])}


def segment_bytes(model_dir: Path, num_tokens: int) -> int:
    """Payload of a spilled head: fp32 KV pages of every full-attention layer, fp32 conv and
    SSM state of every GDN layer, int64 token ids (storage.segment)."""
    c = json.loads((model_dir / "config.json").read_text())
    num_attn = c["layer_types"].count("full_attention")
    num_gdn = c["layer_types"].count("linear_attention")
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    conv_dim = 2 * key_dim + c["linear_num_value_heads"] * c["linear_value_head_dim"]
    kv = num_attn * math.ceil(num_tokens / PAGE_SIZE) * 2 * PAGE_SIZE * c["num_key_value_heads"] * c["head_dim"]
    conv = num_gdn * conv_dim * (c["linear_conv_kernel_dim"] - 1)
    ssm = num_gdn * c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"]
    return 4 * (kv + conv + ssm) + 8 * num_tokens


def test_metrics_after_a_session_workload_are_exact(tmp_path: Path) -> None:
    model_dir = trained_model_path()  # what the server below serves: no --model
    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 1900) for _ in range(n)]

    server = ServerProcess(tmp_path, args=("--api-key", KEY, "--api-key", f"{ADMIN}:admin")).start()
    try:
        with Client(server.base_url, api_key=KEY, timeout=60) as client:
            usages = run_workload(client, server.base_url, tokens)
            rss_before = server.rss_kib() * 1024
            samples = scrape(server.base_url)
            rss_after = server.rss_kib() * 1024
    finally:
        server.stop()

    assert value(samples, "phloem_prompt_tokens_total") == sum(u[0] for u in usages) == 40 + 64 + 78 + 73
    assert value(samples, "phloem_cached_tokens_total") == sum(u[1] for u in usages) == 0 + 44 + 68 + 68
    assert value(samples, "phloem_completion_tokens_total") == sum(u[2] for u in usages) == 16
    assert value(samples, "phloem_prefix_cache_hit_ratio") == 180 / 255
    assert value(samples, "phloem_generations_total", finish_reason="length") == 4
    assert value(samples, "phloem_generations_total", finish_reason="stop") == 0
    # Server-side time to first token: every generation that produced one, by kind.
    assert value(samples, "phloem_generation_first_token_seconds_count", kind="session") == 3
    assert value(samples, "phloem_generation_first_token_seconds_count", kind="stateless") == 1
    assert value(samples, "phloem_generation_first_token_seconds_sum", kind="session") > 0
    assert value(samples, "phloem_generation_prepare_seconds_count", kind="session") == 3
    assert (value(samples, "phloem_sessions_created_total"), value(samples, "phloem_sessions_forked_total"),
            value(samples, "phloem_sessions_deleted_total")) == (1, 1, 1)
    assert {status: value(samples, "phloem_sessions", status=status)
            for status in ("active", "idle", "host", "disk")} == {"active": 0, "idle": 0, "host": 0, "disk": 1}
    assert value(samples, "phloem_session_spills_total", tier="disk") == 1
    assert value(samples, "phloem_session_spill_bytes_total", tier="disk") == segment_bytes(model_dir, 68)
    assert value(samples, "phloem_session_spills_total", tier="host") == 0
    assert value(samples, "phloem_session_resumes_total", tier="disk") == 0
    # Already-sent tokens: the second turn's 44 and the fork's 68, all from the GPU cache (the
    # first turn's 40 were sent with the create and never computed: new, not history).
    assert {source: value(samples, "phloem_session_served_tokens_total", source=source)
            for source in ("gpu", "host", "disk", "recomputed")} == {"gpu": 112, "host": 0, "disk": 0, "recomputed": 0}
    assert value(samples, "phloem_session_tier_bytes", tier="disk") == segment_bytes(model_dir, 68)
    assert value(samples, "phloem_session_tier_bytes", tier="host") == 0
    # The one spill to disk is the one file written, its seconds split by part; nothing dropped.
    assert value(samples, "phloem_segment_writes_total") == 1
    assert value(samples, "phloem_segment_write_bytes_total") == segment_bytes(model_dir, 68)
    assert value(samples, "phloem_segment_write_seconds_total", part="writing") > 0
    assert value(samples, "phloem_segments_dropped_total") == value(samples, "phloem_host_backlog_bytes") == 0
    # No CUDA: nothing pinned, no arena to fall back from.
    assert value(samples, "phloem_host_arena_bytes") == value(samples, "phloem_host_arena_fallbacks_total") == 0
    assert value(samples, "phloem_prefix_cache_bytes") > 0
    appends = value(samples, "phloem_http_requests_total", method="POST",
                    route="/v1/sessions/{session_id}/append", status="200")
    assert appends == 3
    assert value(samples, "phloem_http_requests_total", method="POST", route="/v1/completions", status="200") == 1
    assert value(samples, "phloem_http_requests_total", method="GET", route="unmatched", status="404") == 1
    assert value(samples, "phloem_engine_up") == 1
    # Every metric the server exports is in the documented table.
    documented = documented_metrics()
    exported = {re.sub(r"_(bucket|count|sum|created)$", "", name) for name, _ in samples}
    assert {name for name in exported if name not in documented and f"{name}_total" not in documented} == set()
    # The process's own resident set, read during the scrape (the kernel's count of the same pages
    # just before and after it; the scrape itself may touch a few MiB).
    assert 0.9 * rss_before < value(samples, "phloem_process_resident_bytes") < 1.1 * rss_after
    # Pinned memory exists only with CUDA; without it there is no sample rather than a made-up 0.
    pinned = sorted(name for name, _ in samples if name.startswith("phloem_process_pinned"))
    assert pinned == (["phloem_process_pinned_active_bytes", "phloem_process_pinned_bytes"]
                      if torch.cuda.is_available() else [])
    assert value(samples, "phloem_engine_requests", state="waiting") == 0
    assert value(samples, "phloem_engine_requests", state="running") == 0
    assert value(samples, "phloem_generations_in_flight") == 0
    assert 0 < value(samples, "phloem_kv_pages_used") <= value(samples, "phloem_kv_pages_total")
    assert 0 < value(samples, "phloem_state_slots_used") <= value(samples, "phloem_state_slots_total")
    assert value(samples, "phloem_prefix_checkpoints_evicted_total") == 0
    assert value(samples, "phloem_engine_memory_blocked") == 0
    assert value(samples, "phloem_engine_preemptions_total") == 0  # the pools hold this workload
    assert value(samples, "phloem_engine_step_seconds_count") == value(samples, "phloem_engine_steps_total") > 0
    assert value(samples, "phloem_engine_step_seconds_bucket", le="+Inf") == value(samples, "phloem_engine_steps_total")
    by_kind = {kind: value(samples, "phloem_engine_step_kind_seconds_count", kind=kind)
               for kind in ("decode", "mixed", "prefill")}
    assert sum(by_kind.values()) == value(samples, "phloem_engine_steps_total")
    assert by_kind["prefill"] >= 4 and by_kind["decode"] >= 1  # four prompts, 16 tokens sampled
    assert value(samples, "phloem_engine_between_steps_seconds_total") > 0
    # Of that, the commands' own time, by command: the one spill's export among them.
    for command in ("ExportPrefix", "AddRequest", "PinPrefix"):
        assert value(samples, "phloem_engine_command_seconds_total", command=command) > 0, command
    # Queued-ahead steps are decode steps (every one of them can be, the first behind the prefill).
    assert 0 < value(samples, "phloem_engine_pipelined_steps_total") <= by_kind["decode"]

    # A new process on the same data directory: the session spilled to disk resumes from its file.
    server = ServerProcess(tmp_path, args=("--api-key", KEY, "--api-key", f"{ADMIN}:admin")).start()
    try:
        with Client(server.base_url, api_key=KEY, timeout=60) as client:
            (session,) = client.sessions.list()
            result = session.append(input_ids=tokens(6), generate=GREEDY)
            assert (result.usage.prompt_tokens, result.usage.cached_tokens) == (74, 68)
        samples = scrape(server.base_url)
    finally:
        server.stop()
    assert value(samples, "phloem_session_resumes_total", tier="disk") == 1
    assert value(samples, "phloem_session_resume_bytes_total", tier="disk") == segment_bytes(model_dir, 68)
    assert value(samples, "phloem_session_resume_failures_total") == 0
    assert value(samples, "phloem_session_resume_tokens_total", tier="disk") == 68
    assert value(samples, "phloem_session_resume_seconds_count", tier="disk") == 1
    # The disk read happened before the request: part of the turn's first-token time.
    prepare = value(samples, "phloem_generation_prepare_seconds_sum", kind="session")
    assert 0 < prepare < value(samples, "phloem_generation_first_token_seconds_sum", kind="session")
    assert value(samples, "phloem_session_served_tokens_total", source="disk") == 68
    assert (value(samples, "phloem_prompt_tokens_total"), value(samples, "phloem_cached_tokens_total"),
            value(samples, "phloem_completion_tokens_total")) == (74, 68, 4)
    assert value(samples, "phloem_sessions", status="active") == 1


def run_workload(client: Client, base_url: str, new: Callable[[int], list[int]]) -> list[tuple[int, int, int]]:
    """Create, generate, append + generate, fork + generate, a stateless completion, delete,
    offload to disk. Returns each generation's (prompt, cached, completion) tokens."""
    usages: list[tuple[int, int, int]] = []

    def record(usage: Any) -> None:
        usages.append((usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens))

    root = client.sessions.create(input_ids=new(40))
    first = root.append(generate=GREEDY)
    record(first.usage)
    assert (first.usage.prompt_tokens, first.usage.cached_tokens, first.num_tokens) == (40, 0, 44)
    second = root.append(input_ids=new(20), generate=GREEDY)
    record(second.usage)
    assert (second.usage.prompt_tokens, second.usage.cached_tokens, second.num_tokens) == (64, 44, 68)
    (child,) = root.fork(1)
    branch = child.append(input_ids=new(10), generate=GREEDY)
    record(branch.usage)
    assert (branch.usage.prompt_tokens, branch.usage.cached_tokens) == (78, 68)

    history = [t for turn in root.turns(include_tokens=True) for t in (turn.token_ids or ())]
    stateless = httpx.post(f"{base_url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "phloem-tiny-qwen3.5", "prompt": history + new(5), **GREEDY})
    assert stateless.status_code == 200, stateless.text
    usage = stateless.json()["usage"]
    usages.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                   usage["completion_tokens"]))
    assert usages[-1] == (73, 68, 4), "a stateless request reuses the session's cached prefix"

    assert httpx.get(f"{base_url}/no/such/route", timeout=30).status_code == 404
    child.delete()
    root.offload("disk")
    deadline = time.monotonic() + 30
    while root.refresh().status != "disk":
        assert time.monotonic() < deadline, "the offload to disk did not finish"
        time.sleep(0.05)
    return usages

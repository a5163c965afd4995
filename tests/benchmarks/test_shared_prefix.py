"""`phloem bench agentic --shared-prefix`, scaled down: real servers on loopback, the openai client
on /v1/chat/completions and the session API on the same messages; issue 48's guarantee that the
third agent sharing a system prompt resumes at the page-aligned branch point."""

from __future__ import annotations

from pathlib import Path

import pytest

from phloem.benchmarks.agentic import AgenticWorkload
from phloem.benchmarks.shared_prefix import PAGE, run_shared_prefix

pytestmark = pytest.mark.slow  # two phloem serve processes

AGENTS, TURNS, SHARED = 3, 2, 400


def test_third_agent_sharing_a_system_prompt_hits_it_on_both_paths(tmp_path: Path) -> None:
    wl = AgenticWorkload(agents=AGENTS, turns=TURNS, append=24, output=4)
    table, data = run_shared_prefix(wl, SHARED, ("sessions", "stateless"), out_dir=str(tmp_path),
                                    show_progress=False)  # fmt: skip
    shared = data["shared_prefix_tokens"]
    assert isinstance(shared, int) and abs(shared - SHARED) < 40, shared
    floor = shared // PAGE * PAGE
    requests: dict[str, list[dict[str, object]]] = data["requests"]  # type: ignore[assignment]
    assert set(requests) == {"sessions", "stateless"}
    for mode, records in requests.items():
        assert [(r["agent"], r["turn"]) for r in records] == [(a, t) for a in range(AGENTS) for t in (1, 2)], mode
        for r in records:
            assert r["error"] == "" and r["completion_tokens"] == 4, r
            assert r["prompt_tokens"] > shared and r["ttft_s"] > 0, r  # type: ignore[operator]
        first = {r["agent"]: r for r in records if r["turn"] == 1}
        assert first[0]["cached_tokens"] == 0  # nothing cached yet
        # The third agent resumes at the branch-point checkpoint the second one published.
        assert first[2]["cached_tokens"] >= floor, (mode, first[2])  # type: ignore[operator]
        s = data["summary"][mode]  # type: ignore[index]
        assert s["failed_requests"] == 0 and s["requests"] == AGENTS * TURNS, s
        by_index = s["first_request_by_index"]
        assert set(by_index) == {"1st", "2nd", "3rd+"}
        assert by_index["3rd+"]["min_cached_tokens"] >= floor and by_index["3rd+"]["shared_prefix_served"] >= 0.96
        assert 0 < by_index["3rd+"]["ttft_p50_s"] <= by_index["3rd+"]["ttft_p99_s"]
        assert s["hit_rate_turns_2plus"] > 0.8, s  # later turns resend the conversation: mostly hits
        m = s["metrics"]
        assert m["available"] and m["samples"] >= 1, m
        assert m["failed_steps"] == 0 and m["http_errors"] == 0, m
        assert 0 < m["state_slots_used_peak"] <= m["state_slots_total"], m
    assert (tmp_path / "shared_prefix.json").stat().st_size > 1000
    assert "| stateless | 3rd+ |" in table and "| sessions | 3rd+ |" in table

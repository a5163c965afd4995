"""`phloem bench agentic`, scaled down: real servers on loopback, exact cached-token counts, plots."""

from __future__ import annotations

from pathlib import Path

import pytest

from phloem.benchmarks.agentic import AgenticWorkload, run_agentic

pytestmark = pytest.mark.slow  # real servers on loopback, scaled-down agentic load

APPEND = 24


def test_scaled_down_agentic_run(tmp_path: Path) -> None:
    wl = AgenticWorkload(agents=2, first_turn=200, append=APPEND, turns=4, output=6, fork_at=2, forks=2, vocab_hi=1000)
    table, data = run_agentic(wl, out_dir=str(tmp_path))
    turns = data["turns"]
    assert set(turns) == {"sessions", "stateless", "nocache"}
    for mode, records in turns.items():
        # 2 agents × (turns 1-2 on the trunk + 2 branches × turns 3-4)
        assert len(records) == 2 * (2 + 2 * 2)
        for r in records:
            assert r["completion_tokens"] == 6
            assert r["new_tokens"] == (200 if r["turn"] == 1 else APPEND), r
            if mode == "nocache" or r["turn"] == 1:
                assert r["cached_tokens"] == 0, r
            else:
                # Every later turn (forks included) reuses the whole previous conversation.
                assert r["cached_tokens"] == r["prompt_tokens"] - APPEND, r
    prompts = {m: sorted((r["agent"], r["branch"], r["turn"], r["prompt_tokens"]) for r in recs) for m, recs in turns.items()}
    assert prompts["sessions"] == prompts["stateless"] == prompts["nocache"]
    for name in ("ttft_by_turn.png", "cached_tokens_by_turn.png", "decode_speed_by_turn.png", "agentic.json"):
        assert (tmp_path / name).stat().st_size > 1000
    assert "| sessions |" in table
    for mode in ("sessions", "stateless"):
        summary = data["summary"][mode]  # type: ignore[index]
        assert summary["hit_rate_of_seen"] == 1.0, summary  # every token sent before was a hit
        assert summary["hit_rate"] == summary["hit_rate_ceiling"] < 1.0, summary
    assert data["summary"]["nocache"]["hit_rate_of_seen"] == 0.0  # type: ignore[index]


def test_agents_spread_over_client_processes(tmp_path: Path) -> None:
    """Three agents over two spawned client processes: every agent's turns come back, each with
    its own seeded tokens (prompt lengths and exact hits as in one process), sorted by agent."""
    wl = AgenticWorkload(agents=3, first_turn=120, append=APPEND, turns=3, output=4, vocab_hi=1000, client_processes=2)
    _, data = run_agentic(wl, ("sessions",), out_dir=str(tmp_path))
    records = data["turns"]["sessions"]  # type: ignore[index]
    assert [(r["agent"], r["turn"]) for r in records] == [(a, t) for a in range(3) for t in (1, 2, 3)]
    for r in records:
        assert r["prompt_tokens"] == 120 + (r["turn"] - 1) * (APPEND + 4), r
        assert r["cached_tokens"] == (0 if r["turn"] == 1 else r["prompt_tokens"] - APPEND), r
    assert data["workload"]["client_processes"] == 2  # type: ignore[index]
    assert data["summary"]["sessions"]["wall_s"] > 0  # type: ignore[index]


def test_a_duration_stops_new_turns_and_counts_them(tmp_path: Path) -> None:
    """With ``duration_s`` shorter than the first tool wait, every agent runs its first turn (it
    starts at once) and no later one; the turns not started are counted, not reported lost."""
    wl = AgenticWorkload(agents=2, first_turn=60, append=APPEND, turns=3, output=2, vocab_hi=1000,
                         tool_pause_s=1.5, duration_s=0.5)
    _, data = run_agentic(wl, ("sessions",), out_dir=str(tmp_path))
    records = data["turns"]["sessions"]  # type: ignore[index]
    assert sorted((r["agent"], r["turn"]) for r in records) == [(0, 1), (1, 1)]
    summary = data["summary"]["sessions"]  # type: ignore[index]
    assert summary["turns_not_started"] == 2 * 2
    assert summary["fleet"]["lost_turns"] == 0


@pytest.mark.parametrize("mode", ["sessions", "stateless"])
def test_a_drain_cuts_the_turns_still_running_and_counts_them(mode: str, tmp_path: Path) -> None:
    """A first turn of 1,000 output tokens is still streaming when ``drain_s`` after the
    duration runs out: it is cancelled, it and the rest of its agent's turns count as not
    started (not lost), and the mode reports instead of waiting for it."""
    wl = AgenticWorkload(agents=2, first_turn=60, append=APPEND, turns=2, output=1000, vocab_hi=1000,
                         duration_s=0.2, drain_s=0.5)
    _, data = run_agentic(wl, (mode,), out_dir=str(tmp_path))
    summary = data["summary"][mode]  # type: ignore[index]
    assert data["turns"][mode] == [], data["turns"][mode]  # type: ignore[index]
    assert summary["turns_not_started"] == 2 * 2, summary
    assert summary["fleet"]["lost_turns"] == 0, summary

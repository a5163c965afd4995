"""``--tool-wait``: parsing, seeded lognormal draws, and the fleet report's arithmetic."""

from __future__ import annotations

import math
import statistics

import pytest

from phloem.benchmarks.agentic import AgenticWorkload, TurnRecord, _waits
from phloem.benchmarks.fleet_report import TierSampler, fleet_markdown, fleet_summary
from phloem.benchmarks.tool_wait import ToolWait


def test_parse_fixed_and_lognormal() -> None:
    assert ToolWait.parse("2.5") == ToolWait(2.5)
    assert ToolWait.parse("lognormal:2:1.5") == ToolWait(2.0, 1.5)
    assert ToolWait.parse("lognormal:2:1.5:120") == ToolWait(2.0, 1.5, 120.0)
    for bad in ("lognormal:2", "gamma:1:2", "x", "lognormal:-1:1", "lognormal:1:1:-3"):
        with pytest.raises(ValueError, match="tool wait"):
            ToolWait.parse(bad)


def test_lognormal_draws_have_the_stated_median_and_tail_and_are_seeded() -> None:
    wait = ToolWait(2.0, 1.5)
    rng = wait.rng(7, 3, 0)
    many = [wait.draw(rng) for _ in range(20_000)]
    assert statistics.median(many) == pytest.approx(2.0, rel=0.05)
    p99 = sorted(many)[int(0.99 * len(many))]
    assert p99 == pytest.approx(2.0 * math.exp(1.5 * 2.326), rel=0.15)
    assert wait.draw(wait.rng(0, 0, 0)) == wait.draw(wait.rng(0, 0, 0)) != wait.draw(wait.rng(0, 1, 0))
    capped = ToolWait(2.0, 1.5, 5.0)
    assert max(capped.draw(rng) for _ in range(1000)) == 5.0


def test_waits_default_to_the_fixed_pause_and_differ_per_agent() -> None:
    assert _waits(AgenticWorkload(tool_pause_s=0.5), 0, 0)() == 0.5
    wl = AgenticWorkload(tool_wait=ToolWait(1.0, 1.0))
    assert _waits(wl, 0, 0)() == _waits(wl, 0, 0)() != _waits(wl, 1, 0)()


def test_fleet_summary_shares_resumes_and_per_agent_decode() -> None:
    sampler = TierSampler("http://unused")
    sampler.before = {'phloem_session_served_tokens_total{source="gpu"}': 100.0}
    sampler.after = {
        'phloem_session_served_tokens_total{source="gpu"}': 400.0,
        'phloem_session_served_tokens_total{source="host"}': 400.0,
        'phloem_session_served_tokens_total{source="recomputed"}': 100.0,
        'phloem_session_resume_seconds_count{tier="host"}': 2.0,
        'phloem_session_resume_seconds_sum{tier="host"}': 0.02,
        'phloem_session_resume_tokens_total{tier="host"}': 500.0,
    }
    # Turn 1 prefills 1000 tokens in 1 s (1 ms a token); 4 decode tokens after the first per turn.
    records = [TurnRecord("sessions", 0, 0, 1, 1000, 1000, 0, 5, 1.0, 0.01, 1.1),
               TurnRecord("sessions", 0, 0, 2, 1100, 100, 1000, 5, 0.05, 0.02, 0.2)]
    f = fleet_summary(records, sampler, expected_turns=3)
    assert f["served_shares"] == {"gpu": 0.375, "host": 0.5, "disk": 0.0, "recomputed": 0.125}
    assert f["served_from_cache_or_tier"] == 0.875
    host = f["resumes"]["host"]  # type: ignore[index]
    assert (host["count"], host["mean_tokens"], host["mean_s"]) == (2, 250, 0.01)
    assert host["recompute_s_est"] == pytest.approx(0.25) and host["speedup"] == pytest.approx(25)
    assert f["per_agent_decode_tok_s"]["p50"] == pytest.approx(8 / 0.12)  # type: ignore[index]
    assert f["lost_turns"] == 1
    assert "| sessions | 37.5% / 50.0% / 0.0% / 12.5% | 87.5% |" in fleet_markdown({"sessions": {"fleet": f}})


def test_the_engine_queue_is_averaged_over_the_samples_taken_during_the_run() -> None:
    """The first and last points are the before and after scrapes: left out of the means. Three
    samples during the run: 2, 4, 6 running; 0, 3, 6 waiting, blocked on memory in two of them;
    4 s of steps and 1.2 s of spills' exports over an 8 s run; 3 arena fallbacks, 5 preemptions
    and 30 steps, 21 of them queued, 6 of them mixed, 4 of those queued, between the scrapes; the
    pools as the first scrape read them."""
    sampler = TierSampler("http://unused")
    points = [(0.0, 0, 9, 1), (1.0, 2, 0, 0), (4.0, 4, 3, 1), (6.0, 6, 6, 1), (8.0, 0, 9, 1)]
    sampler.series = [{"t": t, "gpu": 0.0, "host": 0.0, "disk": 0.0, "running": r, "waiting": w, "blocked": b}
                      for t, r, w, b in points]
    sampler.before = {'phloem_engine_step_kind_seconds_sum{kind="decode"}': 1.0,
                      "phloem_kv_pages_total": 40000.0, "phloem_state_slots_total": 6.0,
                      "phloem_engine_preemptions_total": 2.0, "phloem_host_arena_fallbacks_total": 1.0,
                      'phloem_engine_command_seconds_total{command="ExportPrefix"}': 0.4,
                      'phloem_engine_step_kind_seconds_count{kind="mixed"}': 10.0,
                      "phloem_engine_pipelined_mixed_steps_total": 7.0,
                      "phloem_engine_steps_total": 50.0, "phloem_engine_pipelined_steps_total": 20.0}
    sampler.after = {'phloem_engine_step_kind_seconds_sum{kind="decode"}': 3.0,
                     "phloem_engine_preemptions_total": 7.0, "phloem_host_arena_fallbacks_total": 4.0,
                     'phloem_engine_command_seconds_total{command="ExportPrefix"}': 1.6,
                     'phloem_engine_command_seconds_total{command="AddRequest"}': 0.3,
                     'phloem_engine_step_kind_seconds_sum{kind="mixed"}': 1.5,
                     'phloem_engine_step_kind_seconds_sum{kind="prefill"}': 0.5,
                     'phloem_engine_step_kind_seconds_count{kind="mixed"}': 16.0,
                     "phloem_engine_pipelined_mixed_steps_total": 11.0,
                     "phloem_engine_steps_total": 80.0, "phloem_engine_pipelined_steps_total": 41.0}
    f = fleet_summary([TurnRecord("sessions", 0, 0, 1, 10, 10, 0, 5, 0.1, 0.01, 0.2)], sampler, expected_turns=1)
    engine = f["engine"]
    assert engine == {"running_mean": 4.0, "waiting_mean": 3.0, "memory_blocked_share": pytest.approx(2 / 3),
                      "stepping_share": 0.5, "exporting_share": pytest.approx(0.15), "arena_fallbacks": 3,
                      "preemptions": 5, "steps": 30, "steps_queued": 21, "mixed_steps": 6, "mixed_steps_queued": 4,
                      "kv_pages": 40000, "state_slots": 6}
    assert "| 0 | 4.0 / 3.0, 67%, 50%, 15%, 5; 21 / 30, 4 / 6; 40000 / 6 |" in fleet_markdown({"sessions": {"fleet": f}})


def test_the_server_host_memory_peaks_beside_the_host_tier() -> None:
    """Each scrape's resident set and pinned bytes land in the series next to the tier bytes; the
    summary keeps their peaks (before and after scrapes included: memory is not a rate)."""
    sampler = TierSampler("http://unused")
    sampler._t0 = 0.0
    gib = 2**30
    for resident, pinned, host in ((2, 0, 0), (5, 3, 1), (4, 4, 2), (3, 4, 0)):
        sampler._sample({"phloem_process_resident_bytes": resident * gib, "phloem_process_pinned_bytes": pinned * gib,
                         'phloem_session_tier_bytes{tier="host"}': host * gib})
    assert [(p["resident"], p["pinned"], p["host"]) for p in sampler.series] == [
        (2 * gib, 0, 0), (5 * gib, 3 * gib, gib), (4 * gib, 4 * gib, 2 * gib), (3 * gib, 4 * gib, 0)]
    f = fleet_summary([TurnRecord("sessions", 0, 0, 1, 10, 10, 0, 5, 0.1, 0.01, 0.2)], sampler, expected_turns=1)
    assert f["host_memory_peak"] == {"resident": 5 * gib, "pinned": 4 * gib, "host": 2 * gib}
    assert "| 5.00 / 4.00 / 2.00 |" in fleet_markdown({"sessions": {"fleet": f}})
    # A server without CUDA reports no pinned bytes: the column says so rather than 0.
    sampler.series = [{k: v for k, v in p.items() if k != "pinned"} for p in sampler.series]
    f = fleet_summary([TurnRecord("sessions", 0, 0, 1, 10, 10, 0, 5, 0.1, 0.01, 0.2)], sampler, expected_turns=1)
    assert f["host_memory_peak"]["pinned"] is None  # type: ignore[index]
    assert "| 5.00 / n/a / 2.00 |" in fleet_markdown({"sessions": {"fleet": f}})


def test_the_disk_writes_say_where_their_seconds_went() -> None:
    """Four segment files, 2 GB, 4 s in the writes (0.5 GB/s), 2 s queued for a worker and 0.4 s
    waiting for the event loop in all; one host segment dropped; the backlog sampled beside the
    tiers."""
    sampler = TierSampler("http://unused")
    sampler._t0 = 0.0
    sampler.before = {"phloem_segment_writes_total": 1.0, "phloem_segment_write_bytes_total": 1e9}
    sampler.after = {"phloem_segment_writes_total": 5.0, "phloem_segment_write_bytes_total": 3e9,
                     'phloem_segment_write_seconds_total{part="queued"}': 2.0,
                     'phloem_segment_write_seconds_total{part="writing"}': 4.0,
                     'phloem_segment_write_seconds_total{part="resumed"}': 0.4,
                     "phloem_segments_dropped_total": 1.0}
    sampler._sample({"phloem_host_backlog_bytes": 7.0})
    assert sampler.series[0]["backlog"] == 7.0
    f = fleet_summary([TurnRecord("sessions", 0, 0, 1, 10, 10, 0, 5, 0.1, 0.01, 0.2)], sampler, expected_turns=1)
    assert f["disk_writes"] == {"count": 4, "gb": 2.0, "gb_per_s_writing": 0.5, "mean_queued_s": 0.5,
                                "mean_writing_s": 1.0, "mean_resumed_s": pytest.approx(0.1), "dropped": 1}
    assert "| sessions | 4 | 2.0 | 0.50 | 0.500 / 1.000 / 0.100 | 1 |" in fleet_markdown({"sessions": {"fleet": f}})


def test_a_stateless_mode_is_served_from_its_records() -> None:
    sampler = TierSampler("http://unused")
    sampler.before = sampler.after = {"phloem_engine_up": 1.0}
    records = [TurnRecord("stateless", 0, 0, 1, 100, 100, 0, 5, 0.1, 0.01, 0.2),
               TurnRecord("stateless", 0, 0, 2, 120, 15, 90, 5, 0.1, 0.01, 0.2)]
    f = fleet_summary(records, sampler, expected_turns=2)
    assert f["served_tokens"] == {"gpu": 90, "host": 0, "disk": 0, "recomputed": 15}

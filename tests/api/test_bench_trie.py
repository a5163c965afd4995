"""`phloem bench trie`: the external harness tokenspeed-trie against a real server, scaled down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trie.types import Workload

from phloem.benchmarks.agentic import AgenticWorkload
from phloem.benchmarks.trie import ideal_hit_rates, parse_trie_output, run_trie_bench, trie_workload_rows

WL = AgenticWorkload(agents=2, first_turn=128, append=16, turns=4, output=4)


def test_workload_file_is_read_by_trie_as_our_workload() -> None:
    rows = trie_workload_rows(WL)
    assert len(rows) == WL.agents
    for row in rows:
        trace = Workload.from_jsonl_row(json.loads(json.dumps(row)))
        # Trie's request r carries our turn r+1: first_turn, then append + output more each turn.
        assert [trace.cumulative_prompt_tokens(r) for r in range(WL.turns)] == [128, 148, 168, 188]
        assert [t.assistant_response_length for t in trace.turns] + [trace.final_assistant_response_length] == [4] * 4
    hit, eligible = ideal_hit_rates(WL)
    assert hit == pytest.approx((132 + 152 + 172) / (128 + 148 + 168 + 188)) and eligible == 1.0


def test_bad_input_is_refused_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="forks"):
        trie_workload_rows(AgenticWorkload(forks=2, fork_at=1))
    with pytest.raises(ValueError, match="benchmark complete"):
        parse_trie_output("Traceback (most recent call last): ...")


@pytest.mark.slow  # a phloem serve process
def test_trie_against_a_real_server(tmp_path: Path) -> None:
    # The exact counts below hold while the cache evicts nothing. Trie cycles its traces for the
    # whole duration and leaves ~6 checkpoints a request (text drift sends each cycle down new
    # paths): ~200 for 20 requests fill the CPU default's 163 state slots, and the cost-aware
    # eviction then drops the cheapest first -- a turn end 4 tokens past its prompt end, which our
    # next turn would have hit (cached 148 for 152). 2048 slots hold a fast machine's 3 s of it.
    report, data = run_trie_bench(WL, duration_s=3.0, out_dir=str(tmp_path), server_args=("--num-state-slots", "2048"))
    m = data["trie"]["metrics"]  # type: ignore[index]
    assert m["failed_requests"] == 0 and m["completed_requests"] >= 2, m
    assert m["latency_s_min"] >= m["ttft_s_min"] > 0 and m["mean_turn_decode_tps_tok_s_min"] > 0
    hit, _ = ideal_hit_rates(WL)
    # Trie's own accounting comes from our workload file: it also counts the finished requests of
    # traces cancelled at the deadline, whose early turns reuse less, so it is at most the ideal.
    # (Both are rates over the same window: their ratio can exceed the ideal by float rounding.)
    assert 0.5 * hit < m["cached_prompt_tok_per_s"] / m["prompt_tok_per_s"] <= hit + 1e-6
    # Server-reported hits: prefixes are reused, never beyond what the trace could reuse (trie's
    # synthesized texts may miss their length by a token or two: 2 points of slack).
    assert 0 < m["cache_hit_rate_pct_max"] <= 100 * hit + 2
    assert 0 < m["eligible_cache_hit_rate_pct_max"] <= 100.0
    # Trie sends text; the random model's output often does not re-tokenize to the generated ids,
    # and then only the prompt-end checkpoint serves the history (without it trie measured 64.9%
    # eligible hits; with it ~98%: docs/benchmarks.md, "External harness").
    assert m["eligible_cache_hit_rate_pct_mean"] >= 85.0, m
    # Our own client on the same workload and server: exact counts.
    stateless = data["ours"]["turns"]["stateless"]  # type: ignore[index]
    assert len(stateless) == WL.agents * WL.turns
    for r in stateless:
        assert r["prompt_tokens"] == 128 + (r["turn"] - 1) * 20 and r["completion_tokens"] == 4, r
        if r["turn"] == 1:
            # Trie sent the same first prompts before us: a resent prompt is a full hit (all but
            # its last token, where the prompt-end checkpoint sits), unless trie never got to it.
            assert r["cached_tokens"] in (0, r["prompt_tokens"] - 1), r
        else:
            assert r["cached_tokens"] == r["prompt_tokens"] - WL.append, r
    assert "| tokenspeed-trie | text |" in report and "Per-trace metrics" in report
    for name in ("trie_workload.jsonl", "trie.json", "trie_report.md"):
        assert (tmp_path / name).stat().st_size > 100


@pytest.mark.slow  # a phloem serve process
def test_trie_alone_runs_no_client_of_ours(tmp_path: Path) -> None:
    """``--trie-only``: trie's row and the ideal, no row or records of our client."""
    report, data = run_trie_bench(WL, duration_s=2.0, out_dir=str(tmp_path), ours=False,
                                  server_args=("--num-state-slots", "2048"))
    assert data["ours"] is None
    assert data["trie"]["metrics"]["completed_requests"] >= 1  # type: ignore[index]
    assert "| tokenspeed-trie | text |" in report and "| ideal (from the workload) |" in report
    assert "phloem stateless" not in report and "phloem sessions" not in report

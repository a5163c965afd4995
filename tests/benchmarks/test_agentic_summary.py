"""`phloem bench agentic`'s summary of turn records: which turns each figure is over."""

from __future__ import annotations

from phloem.benchmarks.agentic import TurnRecord, _markdown, summarize


def record(agent: int, turn: int, ttft: float, tpot: float) -> TurnRecord:
    new = 100 if turn == 1 else 10
    return TurnRecord("sessions", agent, 0, turn, 100 + 10 * (turn - 1), new, 100 + 10 * (turn - 1) - new, 5,
                      ttft, tpot, 1.0)


def test_turns_2plus_figures_leave_turn_1_out() -> None:
    # Turn 1 decodes beside the other agents' long first turns: slow, and not in the turns-2+ figures.
    records = [record(a, 1, 3.0, 0.050) for a in range(4)]
    records += [record(a, t, 0.1 * t, 0.010 + 0.001 * a) for a in range(4) for t in (2, 3)]
    s = summarize(records, wall_s=10.0)
    assert s["per_user_decode_tok_s_turns_2plus"] == 1.0 / 0.0115  # median of 0.010 .. 0.013, twice each
    assert s["per_user_decode_tok_s"] == 80.0  # all 12 turns: the four 0.050 lift the median to 0.0125
    assert s["ttft_turns_2plus_s"] == 0.25 and s["ttft_turns_2plus_p99_s"] == 0.30000000000000004
    table = _markdown({"sessions": s})
    assert "| 80.0 (87.0) |" in table and "| 0.250 / 0.300 |" in table


def test_one_turn_runs_report_zero_for_later_turns() -> None:
    s = summarize([record(0, 1, 2.0, 0.02)], wall_s=1.0)
    assert s["per_user_decode_tok_s_turns_2plus"] == 0.0 and s["ttft_turns_2plus_p99_s"] == 0.0
    assert s["per_user_decode_tok_s"] == 50.0

"""The fleet harness of issue 53 at tiny scale (built-in model, CPU, real servers on loopback).

(a) Nothing evicted: every already-sent token is served from the GPU cache, so the hit rate
measured equals the workload's ceiling, and ``/metrics`` attributes exactly the tokens seen
before to ``gpu``. (b) Oversubscribed (few KV pages, no TTL pin, a 1 MB host budget, tool waits
longer than the spill sweep): sessions spill to host and disk and resume, with the same greedy
tokens as the run that kept everything, and the accounting shows host and disk sources.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from phloem.benchmarks.agentic import AgenticWorkload, run_agentic
from phloem.benchmarks.tool_wait import ToolWait

WL = AgenticWorkload(agents=4, first_turn=120, append=24, turns=4, output=6, vocab_hi=1000,
                     tool_wait=ToolWait(0.3, 0.5, 1.0))
OVERSUBSCRIBED = ("--num-pages", "40", "--default-ttl", "0", "--idle-to-host", "0",
                  "--host-budget-bytes", "1000000", "--spill-sweep-interval", "0.1")


@pytest.fixture(scope="module")
def kept() -> dict[str, Any]:
    """The workload on a default server: every session fits and stays on the GPU."""
    return run_agentic(WL, ("sessions",), show_progress=False)[1]


def outputs(data: dict[str, Any], mode: str) -> list[tuple[int, int, str]]:
    return sorted((r["agent"], r["turn"], r["output_hash"]) for r in data["turns"][mode])


def test_with_nothing_evicted_the_measured_hits_are_the_ceiling(kept: dict[str, Any]) -> None:
    summary = kept["summary"]["sessions"]
    assert summary["hit_rate"] == summary["hit_rate_ceiling"] < 1.0
    seen = sum(r["prompt_tokens"] - r["new_tokens"] for r in kept["turns"]["sessions"])
    fleet = summary["fleet"]
    assert fleet["served_tokens"] == {"gpu": seen, "host": 0, "disk": 0, "recomputed": 0}
    assert fleet["served_from_cache_or_tier"] == 1.0 and fleet["lost_turns"] == 0
    assert sorted(fleet["ttft_by_turn"]) == [1, 2, 3, 4]


@pytest.mark.slow  # two servers, one oversubscribed with tool waits (~20 s on 2 cores)
def test_an_oversubscribed_fleet_spills_and_resumes_with_the_same_tokens(kept: dict[str, Any]) -> None:
    _, over = run_agentic(WL, ("sessions",), server_args=OVERSUBSCRIBED, show_progress=False)
    assert outputs(over, "sessions") == outputs(kept, "sessions")
    fleet = over["summary"]["sessions"]["fleet"]
    served = fleet["served_tokens"]
    assert served["host"] + served["disk"] > 0 and served["disk"] > 0, served
    assert sum(served.values()) == sum(kept["summary"]["sessions"]["fleet"]["served_tokens"].values())
    assert fleet["resumes"]["disk"]["count"] > 0 and fleet["lost_turns"] == 0
    assert max(p["disk"] for p in fleet["tier_bytes"]) > 0
    writes = fleet["disk_writes"]  # the files behind the disk tier, timed by part
    assert writes["count"] > 0 and writes["gb"] > 0 and writes["mean_writing_s"] > 0, writes


@pytest.mark.slow  # a server
def test_a_mode_is_saved_before_its_server_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A timeout that strikes while the server stops or its data directory is deleted (GBs of
    segment files after a GPU fleet run) no longer loses the mode's measurements."""
    from phloem.benchmarks import agentic

    stop = agentic.LocalServer.stop

    def interrupted(self: agentic.LocalServer) -> None:
        stop(self)
        raise RuntimeError("the mode's timeout")

    monkeypatch.setattr(agentic.LocalServer, "stop", interrupted)
    wl = AgenticWorkload(agents=2, first_turn=40, append=8, turns=2, output=2, vocab_hi=1000)
    with pytest.raises(RuntimeError, match="timeout"):
        run_agentic(wl, ("sessions",), out_dir=str(tmp_path), show_progress=False)
    saved = json.loads((tmp_path / "agentic.json").read_text())
    assert saved["summary"]["sessions"]["turns"] == len(saved["turns"]["sessions"]) == 4
    # The server's log is kept beside it: a line per turn, with its first-token time.
    finished = [line for line in (tmp_path / "server-sessions.log").read_text().splitlines()
                if "generation.finished" in line]
    assert len(finished) == 4 and all(" first_token_ms=" in line for line in finished)

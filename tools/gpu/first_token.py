"""Where a fleet's time to first token went, from a server log (`bench agentic` keeps each mode's
as ``server-MODE.log``): per session turn, the first-token time and its ``prepare`` part (reading
spilled state back before the engine request; the rest is the engine's queue and the prefill),
and the slowest turns with when they started. From the repository root:

    python3 tools/gpu/first_token.py OUT/fleet-128-sessions/server-sessions.log [N_SLOWEST]
"""

from __future__ import annotations

import sys
from datetime import datetime

from phloem.benchmarks.fleet_report import _quantile  # the fleet report's TTFT quantiles
from phloem.benchmarks.server_log import finished_generations


def main(path: str, num_slowest: int = 12) -> None:
    rows = []
    for stamp, f in finished_generations(path):
        if "first_token_ms" not in f or "turn" not in f:
            continue
        end = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        rows.append((int(f["turn"]), end - float(f["duration_ms"]) / 1000, float(f["prepare_ms"]),
                     float(f["first_token_ms"]), int(f["cached_tokens"]), int(f["prompt_tokens"])))
    if not rows:
        print("no generation.finished lines with first_token_ms")
        return
    t0 = min(r[1] for r in rows)
    print("| turn | n | first token p50 / p99 ms | prepare p50 / p99 / max ms |\n|---|---|---|---|")
    for turn in sorted({r[0] for r in rows}):
        sel = [r for r in rows if r[0] == turn]
        first, prep = [r[3] for r in sel], [r[2] for r in sel]
        print(f"| {turn} | {len(sel)} | {_quantile(first, 0.5):.0f} / {_quantile(first, 0.99):.0f} | "
              f"{_quantile(prep, 0.5):.1f} / {_quantile(prep, 0.99):.1f} / {max(prep):.1f} |")
    print(f"\nslowest {num_slowest} later turns (start s after the first turn started):")
    for turn, start, prep, first, cached, prompt in sorted((r for r in rows if r[0] > 0), key=lambda r: -r[3])[:num_slowest]:
        print(f"  turn {turn} start {start - t0:6.1f} s  prepare {prep:8.1f} ms  first token {first:8.1f} ms  "
              f"cached {cached}/{prompt}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))

"""Per-turn decode rate and time to first token of a served run, read from its server log's
``generation.finished`` events (``benchmarks.server_log``), so two runs cut at different points (a
device call's deadline) compare over the turns both finished.

    python3 tools/gpu/turn_rates.py A.log[.gz] [B.log[.gz] ...]

For each log and turn (0: the first), over the requests that generated their whole ``max_tokens``
(``finish_reason=length``): how many, the mean decode rate (``completion_tokens - 1`` over
``duration - first_token``, seconds) and the median first-token time in ms. Prints one Markdown
table, a column pair per log, a row per turn.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from phloem.benchmarks.server_log import finished_generations


def turn_rates(path: Path) -> dict[int, tuple[int, float, float]]:
    """``{turn: (requests, mean decode tok/s, median first-token ms)}`` of one server log."""
    by_turn: dict[int, list[tuple[float, float]]] = {}
    for _, fields in finished_generations(path):
        if fields.get("finish_reason") != "length" or fields.get("turn", "None") == "None":
            continue
        n, total = int(fields["completion_tokens"]), float(fields["duration_ms"])
        first = float(fields["first_token_ms"])
        if n < 2 or total <= first:
            continue
        by_turn.setdefault(int(fields["turn"]), []).append(((n - 1) / ((total - first) / 1000), first))
    return {t: (len(v), statistics.fmean(r for r, _ in v), statistics.median(f for _, f in v))
            for t, v in sorted(by_turn.items())}  # fmt: skip


def table(paths: list[Path]) -> str:
    runs = [turn_rates(p) for p in paths]
    turns = sorted(set().union(*runs))
    head = "| turn | " + " | ".join(f"{p.name}: n, decode tok/s, TTFT p50 ms" for p in paths) + " |"
    lines = [head, "|---|" + "---|" * len(paths)]
    for t in turns:
        cells = [f"{r[t][0]}, {r[t][1]:.1f}, {r[t][2]:.0f}" if t in r else "-" for r in runs]
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(table([Path(a) for a in sys.argv[1:]]))

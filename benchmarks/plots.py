"""PNG plots of an agentic benchmark run (matplotlib, headless).

matplotlib comes with the ``bench`` extra (``pip install 'phloem[bench]'``), not with the serve
install: it is imported when a plot is drawn, and ``phloem bench agentic`` checks for it first.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phloem.benchmarks.agentic import TurnRecord

__all__ = ["plot_agentic"]


def _by_turn(records: list[TurnRecord], value: str) -> tuple[list[int], list[float]]:
    groups: dict[int, list[float]] = defaultdict(list)
    for r in records:
        groups[r.turn].append(float(getattr(r, value)))
    turns = sorted(groups)
    return turns, [sum(groups[t]) / len(groups[t]) for t in turns]


def plot_agentic(runs: dict[str, list[TurnRecord]], out_dir: Path) -> list[Path]:
    """TTFT by turn, cached vs prompt tokens by turn, and decode speed by turn, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    out_dir.mkdir(parents=True, exist_ok=True)
    charts = [
        ("ttft_by_turn.png", "ttft_s", "time to first token (s)", 1.0),
        ("cached_tokens_by_turn.png", "cached_tokens", "cached prompt tokens (mean per agent)", 1.0),
        ("decode_speed_by_turn.png", "tpot_s", "per-user decode speed (tok/s)", -1.0),
    ]
    paths = []
    for name, field, label, power in charts:
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, records in runs.items():
            turns, values = _by_turn(records, field)
            ys = [v**power if v else 0.0 for v in values]
            ax.plot(turns, ys, marker="o", label=mode)
        if field == "cached_tokens":
            for mode, records in runs.items():
                turns, prompts = _by_turn(records, "prompt_tokens")
                ax.plot(turns, prompts, linestyle="--", color="grey", label="prompt tokens" if mode == next(iter(runs)) else None)
                break
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths

"""The eight-GPU script's dry mode (``python3 -m phloem.benchmarks.eight_gpu --dry``): every section
runs end to end on CPU over gloo with the tiny shape, and its table and JSON hold every row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from phloem.benchmarks.eight_gpu import main

pytestmark = pytest.mark.slow  # ~1.5 min: seven TP engines over gloo on two cores


def test_the_dry_run_fills_every_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert table == (tmp_path / "eight_gpu.md").read_text()
    assert table.startswith("eight-GPU run on cpu (dry: tiny shape over gloo)")
    rows = json.loads((tmp_path / "eight_gpu.json").read_text())["rows"]
    got = {(r["section"], r["variant"], r["tp"], r["batch"]) for r in rows}
    want = {("flagship", "bf16", 2, 1), ("flagship", "bf16", 2, 16), ("flagship", "bf16+ep", 2, 1),
            ("flagship", "bf16+ep", 2, 16), ("fp8", "fp8", 2, 1), ("fp8", "fp8+mtp:1", 2, 1),
            ("simulate", "bf16", 2, 1), ("simulate", "bf16", 2, 16), ("simulate", "bf16+ep", 2, 1),
            ("simulate", "bf16+ep", 2, 16)}
    want |= {("scaling", v, n, b) for v, n in (("tp1", 1), ("tp2", 2), ("tp2+one-shot", 2)) for b in (1, 16)}
    assert got == want
    for r in rows:
        tokens = r["extra"].get("accepted_length", 1.0)
        assert r["ms_per_step"] > 0 and r["tok_per_s"] == pytest.approx(1000 * tokens / r["ms_per_step"])
        if r["section"] == "simulate":
            assert 0 <= r["extra"]["allreduce_share"] < 1
        if r["variant"].startswith("fp8+mtp"):
            assert 1.0 <= r["extra"]["accepted_length"] <= 2.0
        if r["section"] == "scaling":
            assert r["extra"]["vs_tp1"] == pytest.approx(1.0) if r["tp"] == 1 else r["extra"]["vs_tp1"] > 0
    assert sum(line.startswith("| ") for line in table.splitlines()) == len(rows) + 1


def test_an_unknown_section_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--dry", "--sections", "flagship,warp"])
    assert "--sections: unknown ['warp']" in capsys.readouterr().err

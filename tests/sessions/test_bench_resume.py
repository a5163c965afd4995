"""The session-resume benchmark runs end to end (tiny sizes) and its paths agree."""

from __future__ import annotations

from pathlib import Path

from phloem.benchmarks.resume import run_resume_bench


def test_resume_bench_paths_reuse_the_spilled_prefix(model_dir: Path, tmp_path: Path) -> None:
    report = run_resume_bench(model_dir, tmp_path, prompt_len=80, append_len=4, reps=1)
    rows = {row.path: row for row in report.rows}
    assert list(rows) == ["cached", "host", "disk", "recompute"]
    assert rows["recompute"].cached_tokens == 0 and rows["host"].load_s is not None
    for path in ("cached", "host", "disk"):
        assert rows[path].cached_tokens == 82, path  # the whole history before the new input
    assert report.segment_bytes > 0 and "| disk |" in report.table()
    assert all(row.same_as_cached for row in report.rows)  # fp32 on the CPU: the recompute agrees too

"""The scripts under docs/bench/ that CI cannot run to the end (they need GPUs) still parse, and
the CPU ones run."""

from __future__ import annotations

import runpy
import subprocess
from pathlib import Path

BENCH = Path(__file__).parents[2] / "docs" / "bench"


def test_gpu_scripts_parse() -> None:
    for script in ("gpu_checks.sh", "gpu_lease.sh"):
        subprocess.run(["bash", "-n", str(BENCH / script)], check=True)


def test_allreduce_bench_imports() -> None:
    module = runpy.run_path(str(BENCH / "allreduce_bench.py"), run_name="allreduce_bench")
    assert callable(module["main"]) and module["ROWS"][-1] == 256


def test_pd_check_imports() -> None:
    module = runpy.run_path(str(BENCH / "pd_check.py"), run_name="pd_check")
    assert callable(module["main"]) and module["PROMPTS"]


def test_radix_evict_bench_builds_and_clears_its_tree() -> None:
    module = runpy.run_path(str(BENCH / "radix_evict.py"), run_name="radix_evict")
    tree, freed = module["build"](8, 3)
    pages, before = tree.num_pages, len(freed)
    tree.clear()
    # Every edge page and every checkpoint's tail page goes back.
    assert pages > 0 and tree.num_pages == 0 and len(freed) - before >= pages


def test_step_trace_imports() -> None:
    module = runpy.run_path(str(BENCH / "step_trace.py"), run_name="step_trace")
    assert callable(module["main"])

"""``phloem bench decode --speculative mtp:K`` on CPU at the tiny shape: the speculative step's
split (draft, verify, rollback, rest) adds up to the step, the accepted length is measured, and a
projection is printed only when asked for, labelled as one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from phloem.benchmarks.speculative_decode import PHASES, SpeculativeSplit, speculative_table
from phloem.cli.main import main
from phloem.runtime.builtin_model import trained_model_path


@pytest.mark.slow  # times decode steps of two models
def test_bench_decode_splits_the_speculative_step(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "decode.json"
    argv = ["bench", "decode", "--shape", "tiny", "--device", "cpu", "--speculative", "mtp:2", "--batches", "1,3",
            "--contexts", "64", "--prefill-tokens", "0", "--steps", "4", "--accept-length", "2.5", "--no-progress",
            "--out", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "speculative decoding mtp:2" in out and "at accepted length 2.5 (projection)" in out
    assert "| batch | context | ms/step |" not in out  # the plain grid's table gives way to the split
    points = json.loads(out_json.read_text())["speculative"]
    assert [(p["batch"], p["context"]) for p in points] == [(1, 64), (3, 64)]
    for p in points:
        assert p["steps"] == 4 and p["plain_steps"] == 0 and p["num_drafts"] == 2
        assert all(p["phase_ms"][phase] > 0 for phase in PHASES)  # dummy drafts are rejected: rollbacks run
        assert sum(p["phase_ms"].values()) + p["rest_ms"] == pytest.approx(p["ms_per_step"])
        assert 0 <= p["rest_ms"] < p["ms_per_step"] and p["plain_ms_per_step"] > 0
        assert 1.0 <= p["accepted_length"] <= 3.0 and p["rollback_share"] > 0.5
    # The trained model's MTP layer is accepted: a measured length well above 1, no projection asked.
    argv = ["bench", "decode", "--model", str(trained_model_path()), "--device", "cpu", "--speculative", "mtp:3",
            "--batches", "1", "--contexts", "64", "--prefill-tokens", "0", "--steps", "6", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1 | 64 |"))
    assert float(row.split("|")[11]) > 1.3 and "projection" not in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_decode_splits_the_speculative_step_on_cuda(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The same split on CUDA (bf16, FlashInfer, graphs for the plain pass, eager speculative
    steps; phases timed with the device synchronized around each call)."""
    out_json = tmp_path / "decode.json"
    argv = ["bench", "decode", "--shape", "tiny", "--device", "cuda", "--speculative", "mtp:3", "--batches", "1,4",
            "--contexts", "256", "--prefill-tokens", "0", "--steps", "6", "--accept-length", "3.1", "--no-progress",
            "--out", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "speculative decoding mtp:3" in out and "at accepted length 3.1 (projection)" in out
    points = json.loads(out_json.read_text())["speculative"]
    assert [(p["batch"], p["context"]) for p in points] == [(1, 256), (4, 256)]
    for p in points:
        assert p["steps"] == 6 and p["plain_steps"] == 0 and p["num_drafts"] == 3
        assert all(p["phase_ms"][phase] > 0 for phase in PHASES)
        assert sum(p["phase_ms"].values()) + p["rest_ms"] == pytest.approx(p["ms_per_step"])
        assert 0 <= p["rest_ms"] < p["ms_per_step"] and p["plain_ms_per_step"] > 0
        assert 1.0 <= p["accepted_length"] <= 4.0
    argv = ["bench", "decode", "--model", str(trained_model_path()), "--device", "cuda", "--speculative", "mtp:3",
            "--batches", "1", "--contexts", "64", "--prefill-tokens", "0", "--steps", "6", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1 | 64 |"))
    assert float(row.split("|")[11]) > 1.3


def test_accept_length_needs_speculation(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "decode", "--shape", "tiny", "--device", "cpu", "--accept-length", "3"]
    assert main(argv) != 0
    assert "--accept-length: needs --speculative mtp:K" in capsys.readouterr().err


def test_projection_is_the_accepted_length_at_the_measured_step() -> None:
    split = SpeculativeSplit(1, 64, 3, 4.0, 10.0, {"draft": 3.0, "verify": 5.0, "rollback": 1.5}, 8, 0, 1.2, 0.9)
    assert split.rest_ms == pytest.approx(0.5)
    assert split.tok_per_s_per_user() == pytest.approx(120.0)
    assert split.tok_per_s_per_user(3.1) == pytest.approx(310.0)
    lines = speculative_table([split], 3.1)
    assert lines[-1].startswith("projection: 3.1 tokens a step") and "| 120 | 310 |" in lines[4]
    assert all(line.count("|") == lines[2].count("|") for line in lines[2:5])

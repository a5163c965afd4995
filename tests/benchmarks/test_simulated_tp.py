"""Rank simulation (``phloem bench decode --simulate-tp N``) on CPU: the simulated rank issues,
step for step, the collectives that the config's arithmetic (``benchmarks.shard_bytes``) says and
that real gloo ranks of the same checkpoint issue; its bytes are the bench's roofline bytes; the
report labels its projection."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phloem.benchmarks.decode import run_decode, step_bytes
from phloem.benchmarks.shard_bytes import mtp_rank_step, rank_step
from phloem.benchmarks.simulated_tp import count_step, simulated_engine
from phloem.cli.main import main
from phloem.engine import Engine, EngineConfig, LoadConfig
from phloem.engine.config import CacheConfig, ModelConfig, ParallelConfig
from phloem.engine.parallel.group import TPGroup
from phloem.engine.parallel.simulated import CollectiveTally, CountingCollectives
from phloem.runtime.model_shapes import SHAPES

ARCH = "Qwen3_5MoeForCausalLM"
CACHE = CacheConfig(page_size=16, num_pages=64, num_state_slots=16, checkpoint_interval=0)
CONTEXT = 40


def one_step(engine: Engine, tally: CollectiveTally, batch: int) -> dict[str, tuple[int, int]]:
    """The collectives of one decode step of ``batch`` requests of ``CONTEXT`` tokens."""
    counted: list[dict[str, tuple[int, int]]] = []
    run_decode(engine, batch, CONTEXT, 1.0, steps=1, warmup=1, compare_sync=False,
               before_timing=lambda: counted.append(count_step(engine, tally)))
    return counted[0]


def arithmetic(engine: Engine, tp: int, batch: int, ep: bool = False) -> dict[str, tuple[int, int]]:
    s = rank_step(engine.model_config, tp, batch, CONTEXT, expert_parallel=ep, element_size=engine.dtype.itemsize)
    return {"all_reduce": (s.all_reduces, s.all_reduce_bytes), "gather": (s.gathers, s.gather_bytes)}


@pytest.mark.parametrize("tp,ep", [(2, False), (4, False), (4, True)])
def test_the_simulated_rank_issues_the_configs_collectives(tiny_checkpoint: Callable[..., Path], tp: int,
                                                           ep: bool) -> None:
    path = tiny_checkpoint(ARCH, wide=True)
    engine = simulated_engine(path, EngineConfig(load=LoadConfig(device="cpu"), cache=CACHE), tp, ep)
    tally = engine.workers.group.pg.tally  # type: ignore[union-attr]
    assert engine.runner.model.model.embed_tokens.weight.shape[0] == -(-engine.model_config.vocab_size // tp)
    for batch in (1, 3):
        counted = one_step(engine, tally, batch)
        assert counted["all_reduce"][0] == 2 * engine.model_config.num_hidden_layers + 1
        assert counted == arithmetic(engine, tp, batch, ep)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_real_gloo_ranks_issue_the_same_collectives(tiny_checkpoint: Callable[..., Path],
                                                   monkeypatch: pytest.MonkeyPatch, tp: int) -> None:
    tally = CollectiveTally()
    backend = TPGroup._backend
    monkeypatch.setattr(TPGroup, "_backend", lambda self: CountingCollectives(backend(self), tally))
    path = tiny_checkpoint(ARCH, wide=True)
    with Engine.from_pretrained(path, parallel=ParallelConfig(tensor_parallel_size=tp), cache=CACHE) as engine:
        for batch in (1, 3):
            assert one_step(engine, tally, batch) == arithmetic(engine, tp, batch)


def test_rank_bytes_are_the_benchs_roofline_bytes(tiny_checkpoint: Callable[..., Path]) -> None:
    """``rank_step``'s bytes (config only) equal ``step_bytes`` of the loaded rank 0 shard."""
    path = tiny_checkpoint(ARCH, wide=True)
    for tp, ep in ((2, False), (4, True)):
        engine = simulated_engine(path, EngineConfig(load=LoadConfig(device="cpu", dtype="bfloat16"), cache=CACHE),
                                  tp, ep)
        for batch, context in ((1, 1024), (16, 1024)):
            loaded = step_bytes(engine, batch, context)
            s = rank_step(engine.model_config, tp, batch, context, expert_parallel=ep)
            assert (s.kv, s.state) == (loaded.kv, loaded.state)
            assert s.weights == pytest.approx(loaded.weights, rel=0.02)


def test_the_flagship_at_tp8_reads_about_4_gb_per_rank() -> None:
    """Issue 52's arithmetic: ~34 GB of active bf16 weights at batch 1, ~4.3 GB per GPU at TP8."""
    mc = ModelConfig.from_dict(SHAPES["qwen3.5-397b-a17b"])
    one, eight = rank_step(mc, 1, 1, 1024), rank_step(mc, 8, 1, 1024)
    assert 30e9 < one.weights < 40e9 and 3.8e9 < eight.weights < 5e9
    assert eight.all_reduces == 121 and eight.gathers == 1 and one.collectives == 0
    assert rank_step(mc, 8, 1, 1024, "fp8").weights < 0.6 * eight.weights
    # docs/benchmarks.md's FP8 + MTP row: the verify over 4 tokens and 3 drafts of 5 collectives each.
    mtp = mtp_rank_step(mc, 8, 1, 1024, 3, "fp8")
    assert mtp.collectives == 122 + 3 * 5 and round(mtp.total / 1e9, 2) == 6.10
    assert mtp_rank_step(mc, 1, 1, 1024, 3).collectives == 0


def test_bench_decode_simulate_tp_prints_a_labelled_projection(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    out_json = tmp_path / "sim.json"
    argv = ["bench", "decode", "--shape", "tiny", "--device", "cpu", "--simulate-tp", "2", "--batches", "1,2",
            "--contexts", "64", "--steps", "2", "--allreduce-us", "20", "--no-progress", "--out", str(out_json)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "rank 0 of TP=2" in out and "PROJECTION = rank step + collectives × 20 µs" in out
    points = json.loads(out_json.read_text())["points"]
    layers = SHAPES["tiny"]["num_hidden_layers"]
    for p in points:
        assert p["collectives"]["all_reduce"][0] == 2 * layers + 1 and p["collectives"]["gather"][0] == 1
        assert p["projection_ms"] == pytest.approx(p["decode"]["ms_per_step"] + (2 * layers + 2) * 0.020)


@pytest.mark.parametrize("extra,message", [(["--tp", "2"], "--simulate-tp: runs one rank alone"),
                                           (["--simulate-tp", "1"], "--simulate-tp: expected 2 to 8 ranks"),
                                           ([], "--allreduce-us: needs --simulate-tp N")])
def test_bad_simulation_flags_are_one_line(capsys: pytest.CaptureFixture[str], extra: list[str],
                                           message: str) -> None:
    argv = ["bench", "decode", "--shape", "tiny", "--device", "cpu", "--allreduce-us", "5"]
    if extra[:1] != ["--simulate-tp"] and extra:
        argv += ["--simulate-tp", "2"]
    assert main(argv + extra) != 0
    assert message in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_simulated_rank_replays_its_cuda_graph_alone(tmp_path: Path) -> None:
    """On a GPU the rank's decode graphs hold the local copies in place of NCCL: rank 0's graph
    replays without peers, and the eager counting step still sees every collective."""
    out_json = tmp_path / "sim.json"
    argv = ["bench", "decode", "--shape", "tiny", "--device", "cuda", "--simulate-tp", "2", "--batches", "1,4",
            "--contexts", "1024", "--steps", "5", "--no-progress", "--out", str(out_json)]
    assert main(argv) == 0
    layers = SHAPES["tiny"]["num_hidden_layers"]
    for p in json.loads(out_json.read_text())["points"]:
        assert p["decode"]["gpu_ms_per_step"] > 0
        assert p["collectives"]["all_reduce"][0] == 2 * layers + 1 and p["collectives"]["gather"][0] == 1

"""``phloem estimate``: per-GPU memory of a model by dtype and TP size, on CPU, without weights,
by the engine's own arithmetic (``engine.cache.sizing``, which ``plan_pools`` uses too)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from phloem.cli.main import main
from phloem.engine.cache.memory import plan_pools
from phloem.engine.cache.sizing import estimate_memory, weight_bytes
from phloem.engine.config import CacheConfig, ModelConfig
from phloem.runtime.model_shapes import SHAPES

GIB = 1 << 30
ROW = re.compile(r"^(bf16|fp8) +(\d) +([\d.]+) +([\d.]+) +(\d+) +(\d+) +([\d.]+) +(\d+) +([\d.]+)(?: |$)")


def rows(out: str) -> dict[tuple[str, int], list[str]]:
    return {(m[1], int(m[2])): list(m.groups()[2:]) for m in map(ROW.match, out.splitlines()) if m}


@pytest.mark.parametrize("shape", ["qwen3.5-35b-a3b", "qwen3.5-397b-a17b"])
def test_estimate_prints_bf16_and_fp8_per_gpu_at_tp_1_2_4_8(shape: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--shape", shape]) == 0
    out = capsys.readouterr().out
    table = rows(out)
    assert set(table) == {(d, tp) for d in ("bf16", "fp8") for tp in (1, 2, 4, 8)}, out
    for dtype in ("bf16", "fp8"):  # weights per GPU halve with each doubling of TP (replicated parts aside)
        weights = [float(table[dtype, tp][0]) for tp in (1, 2, 4, 8)]
        assert all(0.49 < b / a < 0.51 for a, b in zip(weights, weights[1:])), weights
    assert "FP8 as published; served on the reference path" in out


def test_the_35b_figures_are_the_published_ones() -> None:
    """34.66 B parameters (transformers' config defaults), 20 KiB of KV a token, ~61 MiB a slot."""
    mc = ModelConfig.from_dict(SHAPES["qwen3.5-35b-a3b"])
    assert abs(weight_bytes(mc).total / 2 - 34.66e9) < 0.01e9
    e = estimate_memory(mc, CacheConfig(), gpu_bytes=140 * GIB)
    assert e.page_bytes // 16 == 20 * 1024 and 60 < e.slot_bytes / (1 << 20) < 62
    fp8 = weight_bytes(mc, weight_format="fp8")
    assert fp8.other == weight_bytes(mc).other and 0.49 < fp8.projections / weight_bytes(mc).projections < 0.51


def test_the_397b_fits_only_at_tp8_in_bf16(capsys: pytest.CaptureFixture[str]) -> None:
    main(["estimate", "--shape", "qwen3.5-397b-a17b", "--dtype", "bf16"])
    notes = {int(line.split()[1]): "does not fit" in line for line in capsys.readouterr().out.splitlines()
             if line.startswith("bf16")}
    assert notes == {1: True, 2: True, 4: True, 8: False}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_the_estimate_sizes_pools_as_plan_pools_does(tp: int, kv_cache_dtype: str) -> None:
    """Same page and slot bytes as the engine's sizing of a loaded model, and the same split of a
    budget (on CPU ``plan_pools`` takes ``cpu_pool_bytes`` as the budget)."""
    mc = ModelConfig.from_dict(SHAPES["qwen3.5-35b-a3b"])
    budget = 8 * GIB
    cc = CacheConfig(cpu_pool_bytes=budget, kv_cache_dtype=kv_cache_dtype)
    plan = plan_pools(mc, cc, torch.bfloat16, torch.device("cpu"), tp)
    weights = weight_bytes(mc, tp).total
    e = estimate_memory(mc, CacheConfig(memory_fraction=1.0, kv_cache_dtype=kv_cache_dtype), tp_size=tp,
                        reserve_bytes=GIB, gpu_bytes=budget + GIB + weights)
    assert (e.page_bytes, e.slot_bytes, e.num_pages, e.num_slots) == (
        plan.page_bytes, plan.slot_bytes, plan.num_pages, plan.num_slots)


def test_fp8_weights_and_fp8_kv_of_the_397b_at_tp4_and_tp8(capsys: pytest.CaptureFixture[str]) -> None:
    """``--quantization fp8`` is the fp8 weight row alone; ``--kv-cache-dtype fp8_e4m3`` halves a
    page, so the same KV budget holds twice the tokens; the weights and states do not change."""
    argv = ["estimate", "--shape", "qwen3.5-397b-a17b", "--quantization", "fp8", "--tp", "4", "8"]
    assert main(argv) == 0
    bf16_kv = rows(capsys.readouterr().out)
    assert main([*argv, "--kv-cache-dtype", "fp8_e4m3"]) == 0
    out = capsys.readouterr().out
    fp8_kv = rows(out)
    assert set(fp8_kv) == {("fp8", 4), ("fp8", 8)} and "KV fp8 e4m3" in out
    for tp in (4, 8):
        weights, kv_gib, pages, tokens, states, slots, _total = fp8_kv["fp8", tp]
        assert (weights, kv_gib, states, slots) == tuple(bf16_kv["fp8", tp][i] for i in (0, 1, 4, 5))
        assert int(pages) in (2 * int(bf16_kv["fp8", tp][2]), 2 * int(bf16_kv["fp8", tp][2]) + 1)
    with pytest.raises(SystemExit):
        main(["estimate", "--quantization", "fp8", "--dtype", "bf16"])
    assert "--quantization fp8: the weights are fp8" in capsys.readouterr().err


def test_estimate_takes_the_memory_flags(capsys: pytest.CaptureFixture[str]) -> None:
    main(["estimate", "--tp", "1", "--dtype", "bf16", "--gpu-memory-utilization", "0.5"])
    half = rows(capsys.readouterr().out)["bf16", 1]
    main(["estimate", "--tp", "1", "--dtype", "bf16", "--num-pages", "1000", "--num-state-slots", "10"])
    fixed = rows(capsys.readouterr().out)["bf16", 1]
    main(["estimate", "--tp", "1", "--dtype", "bf16"])
    full = rows(capsys.readouterr().out)["bf16", 1]
    assert 0.58 < int(half[2]) / int(full[2]) < 0.6  # 0.5 / 0.85 of the pages
    assert (int(fixed[2]), int(fixed[5])) == (1000, 10)


def test_estimate_of_a_model_folder_reads_only_its_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["qwen3-next-80b-a3b"]))
    assert main(["estimate", "--model", str(tmp_path), "--tp", "4", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3NextForCausalLM, 79.67 B parameters" in out and ("bf16", 4) in rows(out)


def test_a_tp_that_does_not_divide_the_heads_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    main(["estimate", "--shape", "qwen3.5-27b", "--tp", "16", "--dtype", "bf16"])
    assert "tp: 16 does not divide the model's num_attention_heads=24" in capsys.readouterr().out


def test_docs_models_pastes_the_current_output(capsys: pytest.CaptureFixture[str]) -> None:
    """Each ``$ phloem estimate ...`` block of docs/models.md is what the command prints now."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```console\n\$ phloem (estimate[^\n]*)\n(.*?)```", page, re.S)
    assert len(blocks) == 4
    for argv, printed in blocks:
        assert main(argv.split()) == 0
        assert capsys.readouterr().out == printed, f"docs/models.md: rerun `phloem {argv}` and paste its output"

"""The sweep scripts (benchmarks/sweeps/) and GPU run scripts (tools/gpu/) that CI cannot run to
the end (they need GPUs) still parse, and the CPU ones run."""

from __future__ import annotations

import runpy
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
BENCH = ROOT / "benchmarks" / "sweeps"
GPU_TOOLS = ROOT / "tools" / "gpu"


def test_gpu_scripts_parse() -> None:
    for script in sorted(p.name for p in GPU_TOOLS.glob("*.sh")):
        subprocess.run(["bash", "-n", str(GPU_TOOLS / script)], check=True)


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


def test_radix_namespaces_bench_keeps_tenants_apart() -> None:
    module = runpy.run_path(str(BENCH / "radix_namespaces.py"), run_name="radix_namespaces")
    tree, histories, _ = module["build"](6, 2, 3)
    assert module["lookups"](tree, histories, 1) > 0
    # A tenant's next turn hits its own conversation, another tenant only the shared prompt.
    (mine, a), (theirs, b) = histories[0], histories[1]
    assert tree.match(mine + [1], len(mine), a).num_tokens == len(mine)
    assert tree.match(mine + [1], len(mine), b).num_tokens == 64


def test_step_trace_imports() -> None:
    module = runpy.run_path(str(BENCH / "step_trace.py"), run_name="step_trace")
    assert callable(module["main"])


def test_step_roles_charges_each_launch_from_the_previous_end() -> None:
    """A synthetic step: embedding, one GDN layer, one attention layer, the tail. Under PDL the
    intervals overlap; each launch is charged from the previous launch's end to its own."""
    module = runpy.run_path(str(BENCH / "step_roles.py"), run_name="step_roles")
    gdn = ["gemv_kernel", "recurrent_gated_delta_rule_kernel", "gemv_kernel", "gemv_kernel",
           "_gate_up_token_kernel", "_down_sum_kernel"]  # fmt: skip
    attn = ["gemv_kernel", "decode_attention_split_kernel", "decode_attention_merge_kernel", "gemv_kernel",
            "gemv_kernel", "_gate_up_token_kernel", "_down_sum_kernel"]  # fmt: skip
    names = ["indexSelect", *gdn, *attn, "add_rms_norm_kernel", "gemv_kernel", "argmax_partial_kernel", "argmax_final_kernel"]
    # Launch i starts at i (inside the one before) and ends at (i + 1) ** 2 / 2: ends grow, intervals overlap.
    timeline = [[name, float(i), (i + 1) ** 2 / 2 - i] for i, name in enumerate(names)]
    roles = module["roles"]({"kernels": {"timeline": timeline}})
    ends = [(i + 1) ** 2 / 2 for i in range(len(names))]
    cost = [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]
    assert roles["embedding"] == [cost[0]]
    assert roles["gdn_step"] == [cost[2]] and roles["attn_merge"] == [cost[9]]
    assert roles["router"] == [cost[4], cost[11]] and roles["down"] == [cost[6], cost[13]]
    assert roles["tail"] == cost[14:]
    assert sum(sum(v) for v in roles.values()) == ends[-1]  # the step's span, nothing counted twice


def test_step_roles_reads_layers_without_a_router_launch() -> None:
    """With the router in the projection before the experts (kernels/moe/route_partial.py) a GDN layer is
    five launches and an attention layer six; both patterns may follow each other."""
    module = runpy.run_path(str(BENCH / "step_roles.py"), run_name="step_roles")
    gdn = ["gemv_kernel", "recurrent_gated_delta_rule_kernel", "gemv_kernel", "_gate_up_token_kernel", "_down_sum_kernel"]
    attn = ["gemv_kernel", "decode_attention_split_kernel", "decode_attention_merge_kernel", "gemv_kernel",
            "_gate_up_token_kernel", "_down_sum_kernel"]  # fmt: skip
    with_router = ["gemv_kernel", "recurrent_gated_delta_rule_kernel", "gemv_kernel", "gemv_kernel",
                   "_gate_up_token_kernel", "_down_sum_kernel"]  # fmt: skip
    names = ["indexSelect", *gdn, *attn, *with_router, "add_rms_norm_kernel", "gemv_kernel", "argmax_partial_kernel"]
    timeline = [[name, float(i), 1.0] for i, name in enumerate(names)]  # launch i ends at i + 1
    roles = module["roles"]({"kernels": {"timeline": timeline}})
    assert len(roles["out_proj_route"]) == 1 and len(roles["o_proj_route"]) == 1
    assert len(roles["router"]) == len(roles["out_proj"]) == 1
    assert len(roles["gate_up"]) == len(roles["down"]) == 3 and len(roles["tail"]) == 3


@pytest.mark.slow  # runs the sweep's model steps
def test_mixed_step_sweep_runs_mixed_steps_on_cpu() -> None:
    """The tiny shape on CPU: turn 2's appends arrive while others decode, so some steps are mixed."""
    out = subprocess.run(
        ["python3", str(BENCH / "mixed_step.py"), "--shape", "tiny", "--device", "cpu", "--dtype", "float32",
         "--agents", "3", "--context", "96", "--append", "24", "--output", "8", "--stagger", "2", "--no-profile"],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    kinds = {line.split()[0]: int(line.split()[1]) for line in out.splitlines() if line.startswith(("decode ", "mixed "))}
    assert kinds.get("mixed", 0) > 0 and kinds.get("decode", 0) > 0, out


def test_prefill_attention_bench_counts_causal_flops() -> None:
    module = runpy.run_path(str(BENCH / "prefill_attention_bench.py"), run_name="prefill_attention_bench")
    # One chunk of 2 tokens over 3 earlier ones: the two queries see 4 and 5 keys.
    assert module["flops"]([2], [5]) == 4 * module["HQ"] * module["D"] * 9


def test_gdn_host_sweep_builds_a_mixed_steps_inputs() -> None:
    module = runpy.run_path(str(BENCH / "gdn_host.py"), run_name="gdn_host")
    args = module["inputs"](3, 10, __import__("torch").device("cpu"))
    assert args["query_start_loc"].tolist() == [0, 1, 2, 3, 13] and args["q"].shape == (13, 16, 128)
    assert callable(module["public"])


def test_gemv_fp8_bench_imports() -> None:
    module = runpy.run_path(str(BENCH / "gemv_fp8_bench.py"), run_name="gemv_fp8_bench")
    assert callable(module["main"]) and module["SHAPES"]["qkv_proj"] == (9216, 2048)


def test_w8a8_bench_imports_and_flags_a_path_off_its_reference() -> None:
    module = runpy.run_path(str(BENCH / "w8a8_bench.py"), run_name="w8a8_bench")
    assert callable(module["main"]) and all(k % 128 == 0 for _, k in module["SHAPES"].values())
    rows = [
        {"shape": "s", "tokens": 64, "path": "a", "us": 10.0, "tflops": 5.0, "rel_err": 3e-3, "flag": False},
        {"shape": "s", "tokens": 64, "path": "b", "us": 9.0, "tflops": 6.0, "rel_err": 0.2, "flag": True},
        {"shape": "s", "tokens": 64, "path": "c", "error": "RuntimeError: unsupported"},
    ]
    table = module["markdown"](rows).splitlines()
    assert len(table) == 5 and "(CHECK)" in table[3] and "(CHECK)" not in table[2] and "unsupported" in table[4]


def test_turn_rates_reads_finished_turns_from_server_logs(tmp_path: Path) -> None:
    """Only turns that generated their whole length count (a cancelled turn, a stateless request
    and a one-token answer are left out); a gzipped log reads as a plain one."""
    import gzip

    module = runpy.run_path(str(GPU_TOOLS / "turn_rates.py"), run_name="turn_rates")

    def line(turn: object, reason: str, tokens: int, duration_ms: float, first_ms: float) -> str:
        return (f"2026-12-07T17:06:22.298Z INFO phloem.sessions.events [req_x] generation.finished "
                f"session_id=sess_1 turn={turn} finish_reason={reason} prompt_tokens=900 cached_tokens=800 "
                f"completion_tokens={tokens} duration_ms={duration_ms} prepare_ms=0.7 first_token_ms={first_ms}\n")  # fmt: skip

    plain = tmp_path / "a.log"
    plain.write_text("".join([
        line(0, "length", 101, 3000.0, 1000.0), line(1, "length", 501, 10_100.0, 100.0),
        line(1, "length", 501, 5_200.0, 200.0), line(1, "cancelled", 40, 900.0, 150.0),
        line(None, "length", 501, 5_000.0, 100.0), line(2, "length", 1, 300.0, 120.0),
    ]))  # fmt: skip
    zipped = tmp_path / "b.log.gz"
    with gzip.open(zipped, "wt") as f:
        f.write(line(0, "length", 101, 2000.0, 1000.0))
    rates = module["turn_rates"](plain)
    assert rates == {0: (1, 50.0, 1000.0), 1: (2, 75.0, 150.0)}
    assert module["turn_rates"](zipped) == {0: (1, 100.0, 1000.0)}
    table = module["table"]([plain, zipped]).splitlines()
    assert table[2] == "| 0 | 1, 50.0, 1000 | 1, 100.0, 1000 |" and table[3] == "| 1 | 2, 75.0, 150 | - |"


def test_prefill_attention_bench_gathers_pages_in_page_list_order() -> None:
    torch = __import__("torch")
    module = runpy.run_path(str(BENCH / "prefill_attention_bench.py"), run_name="prefill_attention_bench")
    page = module["PAGE"]
    kv = torch.randn(5, 2, page, 2, 4).to(torch.float8_e4m3fn)
    indices = torch.tensor([3, 0, 4], dtype=torch.int32)
    kv_len = 2 * page + 3
    k, v = module["gather_pages"](kv, indices, kv_len)
    assert k.shape == v.shape == (kv_len, 2, 4) and k.dtype == torch.bfloat16 and k.is_contiguous()
    for pos in (0, page - 1, page, 2 * page + 2):
        src = kv[indices[pos // page], :, pos % page].to(torch.bfloat16)
        assert torch.equal(k[pos], src[0]) and torch.equal(v[pos], src[1])

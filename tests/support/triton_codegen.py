"""Compile the Triton kernels for the H200 (sm_90) down to a cubin, without a GPU.

Run as a script (``python3 tests/support/triton_codegen.py``) in a process where
``TRITON_INTERPRET`` is unset: the kernels must import as compiled ``JITFunction``s, which the
interpreter tests of the same pytest session would prevent. Prints one JSON object: case name ->
"ok" or the error. Triton ships its own LLVM and ptxas, so an explicit target needs no driver.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import Any

H200 = ("cuda", 90, 32)


def _pdl() -> bool:
    """The launch's PDL choice from ``PHLOEM_PDL`` (``runtime.env.kernel_config``): ``1`` forces it;
    unset, on a machine without a GPU, it is off."""
    import torch

    from phloem.kernels.common.pdl import use_pdl
    from phloem.runtime.env import kernel_config

    return use_pdl(kernel_config().pdl, torch.device("cuda"))


def compile_for_h200(
    kernel: Any, pointers: dict[str, str], constexprs: dict[str, object], floats: frozenset[str] = frozenset({"eps"}),
    divisible: frozenset[str] = frozenset(), num_warps: int = 4,
) -> Any:
    """Compile ``kernel`` for sm_90: ``pointers`` give the pointer parameters' types, ``constexprs``
    the value of every ``tl.constexpr`` parameter (all must be given); ``floats`` are fp32 scalars
    and every other parameter an int64 scalar (strides, sizes). Pointers are taken as 16-byte
    aligned, as a launch with torch tensors specialises them (without it every load compiles to
    2-byte scalars, and ``ptxas -v`` register counts on the PTX mean nothing); so are the integer
    parameters named in ``divisible`` (multiples of 16, as a launch at the real shapes specialises them).
    ``num_warps`` as the launcher passes it. Returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    params = inspect.signature(kernel.fn).parameters
    pdl = _pdl()
    if "PDL" in params:  # a decode kernel that opts into programmatic dependent launch
        constexprs = constexprs | {"PDL": pdl}
    for name, param in params.items():
        if "constexpr" in str(param.annotation):
            assert name in constexprs, f"{kernel.fn.__name__}: no value for constexpr {name}"
            signature[name] = "constexpr"
        else:
            signature[name] = pointers.get(name) or ("fp32" if name in floats else "i64")
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature) if name in pointers or name in divisible}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget(*H200), options={"num_warps": num_warps})
    assert compiled.asm["cubin"], "no cubin"
    if "PDL" in params:
        for instruction in ("griddepcontrol.wait", "griddepcontrol.launch_dependents"):
            found = instruction in compiled.asm["ptx"]
            assert found == pdl, f"{kernel.fn.__name__}: {instruction} {found}"
    return compiled


def _all(names: str, dtype: str) -> dict[str, str]:
    return dict.fromkeys(names.split(), dtype)


def qk_norm_rope(store: bool) -> None:
    from phloem.kernels.attention.triton_qk_norm_rope import qk_norm_rope_gate_kernel

    bf16 = ("q_gate", "k", "q_norm_w", "k_norm_w", "o_q", "o_k", "o_gate", "v", "kv")
    pointers = {name: "*bf16" for name in bf16} | {"positions": "*i64", "slots": "*i64", "inv_freq": "*fp32"}
    compile_for_h200(qk_norm_rope_gate_kernel, pointers, {"BD": 256, "STORE": store})


def gdn_decode(from_gates: bool) -> None:
    from phloem.kernels.gdn.triton_decode import recurrent_gated_delta_rule_kernel

    pointers = {name: "*bf16" for name in ("q", "k", "v", "o")}
    pointers |= {"ssm_states": "*fp32", "read_slots": "*i64", "write_slots": "*i64", "a_log": "*fp32", "dt_bias": "*fp32"}
    # With the gates in the kernel, ``g`` and ``beta`` are the raw bf16 a/b projections.
    pointers |= {"g": "*bf16", "beta": "*bf16"} if from_gates else {"g": "*fp32", "beta": "*bf16"}
    constexprs = {"GROUP": 2, "DK": 128, "DV": 128, "BK": 128, "BV": 32, "FROM_GATES": from_gates}
    compile_for_h200(recurrent_gated_delta_rule_kernel, pointers, constexprs, frozenset({"q_divisor", "eps"}))


# The 35B-A3B decode shapes: hidden 2048, expert FFN 512, 256 experts + the shared one, top-8 + 1.
def conv1d_update() -> None:
    from phloem.kernels.gdn.triton_conv1d import causal_conv1d_update_kernel

    pointers = _all("x weight bias o", "*bf16") | _all("read_slots write_slots", "*i64") | {"conv_states": "*bf16"}
    compile_for_h200(causal_conv1d_update_kernel, pointers, {"K": 4, "BK": 4, "BD": 256, "HAS_BIAS": False})


def _experts(fp8: bool) -> dict[str, str]:
    """The expert weights' pointers: bf16 (the scales' pointer is the weights', unused) or block FP8
    (``kernels.moe.triton_fp8``: e4m3 bytes, fp32 scales)."""
    return {"p_w": "*fp8e4nv", "p_s": "*fp32"} if fp8 else {"p_w": "*bf16", "p_s": "*bf16"}


def fused_moe_decode(fp8: bool) -> None:
    from phloem.kernels.moe.triton_decode import _down_sum_kernel, _gate_up_kernel

    moe = {"H": 2048, "INTER": 512, "TOP_K": 9, "FP8": fp8}
    for route in (False, True):  # ids given / routed in the kernel from the router logits
        compile_for_h200(_gate_up_kernel, _all("p_x p_act p_logits p_tw", "*bf16") | {"p_ids": "*i64"} | _experts(fp8),
                         moe | {"BLOCK_N": 4, "BLOCK_K": 1024, "ROUTE": route, "BE": 256, "BR": 8, "RENORMALIZE": True})
    # the ids slot by slot, one tile at a time / the next tile in flight / and the router's accumulator zeroed
    for prefetch, zero in ((False, 0), (True, 0), (True, 4)):
        compile_for_h200(_down_sum_kernel, _all("p_act p_tw p_out", "*bf16") | _all("p_ids p_zero", "*i64") | _experts(fp8),
                         moe | {"K_BLOCKS": 2, "BLOCK_N": 32, "BLOCK_K": 256, "PREFETCH": prefetch, "ZERO_BLOCK": zero})
    if fp8:  # a down tile within one 128-column block (one scale a row)
        compile_for_h200(_down_sum_kernel, _all("p_act p_tw p_out", "*bf16") | _all("p_ids p_zero", "*i64") | _experts(fp8),
                         moe | {"K_BLOCKS": 8, "BLOCK_N": 4, "BLOCK_K": 64, "PREFETCH": True, "ZERO_BLOCK": 0})


def moe_grouped_prefill(fp8: bool) -> None:
    from phloem.kernels.moe.triton_grouped import _grouped_down_kernel, _grouped_gate_up_kernel

    tiles = {"E": 257, "H": 2048, "INTER": 512, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "PRECISION": "tf32", "FP8": fp8}
    compile_for_h200(_grouped_gate_up_kernel, _all("p_x p_act", "*bf16") | _all("p_rows p_block_e", "*i64") | _experts(fp8),
                     tiles | {"TOP_K": 9})
    compile_for_h200(_grouped_down_kernel, _all("p_act p_tw", "*bf16") | _all("p_rows p_block_e", "*i64")
                     | {"p_part": "*fp32"} | _experts(fp8), tiles)


def moe_sort() -> None:
    from phloem.kernels.moe.triton_sort import _sort_kernel

    compile_for_h200(_sort_kernel, _all("p_ids p_rows p_block_e", "*i64") | {"p_next": "*i32"},
                     {"E": 257, "E_PAD": 512, "BLOCK_M": 64, "CHUNK": 1024})


def moe_route(shared: bool) -> None:
    from phloem.kernels.moe.triton_route import moe_route_kernel

    pointers = {"logits": "*bf16", "topk_weights": "*bf16", "topk_ids": "*i64"}
    compile_for_h200(moe_route_kernel, pointers,
                     {"TOP_K": 8, "BE": 256, "BK": 16 if shared else 8, "RENORMALIZE": True, "HAS_SHARED": shared})


def gdn_gates() -> None:
    from phloem.kernels.gdn.triton_gates import gdn_gates_kernel

    pointers = _all("p_a p_b p_beta", "*bf16") | _all("p_alog p_dt p_g", "*fp32")
    compile_for_h200(gdn_gates_kernel, pointers, {"H": 32, "BLOCK_H": 32})


def norms() -> None:
    from phloem.kernels.norm.triton_norm import add_rms_norm_kernel, gated_rms_norm_kernel, rms_norm_kernel

    compile_for_h200(rms_norm_kernel, _all("x weight o", "*bf16"), {"BD": 2048})
    compile_for_h200(add_rms_norm_kernel, _all("x residual weight o o_residual", "*bf16"), {"BD": 2048})
    compile_for_h200(gated_rms_norm_kernel, _all("x gate weight o", "*bf16"), {"BD": 128, "ROUND_WEIGHTED": True})


def one_shot_norm(world: int) -> None:
    from phloem.kernels.norm.triton_allreduce import one_shot_add_rms_norm_kernel

    pointers = _all("x residual weight o o_residual", "*bf16") | _all("buffers flags epochs", "*i64")
    constexprs = {"WORLD": world, "MAX_ROWS": 256, "BD": 2048, "HAS_RESIDUAL": True}
    compile_for_h200(one_shot_add_rms_norm_kernel, pointers, constexprs)
    compile_for_h200(one_shot_add_rms_norm_kernel, pointers, constexprs | {"HAS_RESIDUAL": False})


def moe_token(fp8: bool) -> None:
    from phloem.kernels.moe.triton_token import _gate_up_token_kernel

    moe = {"S": 9, "H": 2048, "INTER": 512, "COPIES": 4, "FP8": fp8}
    pointers = _all("p_x p_act p_logits p_tw p_nw", "*bf16") | _all("p_ids p_acc", "*i64") | _experts(fp8)
    # ids given / routed from the router logits / from the router partial's accumulator
    for route, partial in ((False, False), (True, False), (True, True)):
        compile_for_h200(_gate_up_token_kernel, pointers,
                         moe | {"KP": 2048, "BLOCK_N": 4, "ROUTE": route, "BE": 256, "BR": 8, "RENORMALIZE": True,
                                "PARTIAL": partial},
                         floats=frozenset({"eps", "scale"}))  # fmt: skip


def argmax() -> None:
    from phloem.kernels.sampling.triton_argmax import argmax_final_kernel, argmax_partial_kernel

    compile_for_h200(argmax_partial_kernel, {"p_x": "*bf16", "p_key": "*i32", "p_idx": "*i32"}, {"BLOCK": 1024})
    for copy in (False, True):  # with the ids also written into the graph's input-id row
        compile_for_h200(argmax_final_kernel, _all("p_key p_idx", "*i32") | _all("p_out p_copy", "*i64"), {"BP": 128, "COPY": copy})


def decode_attention() -> None:
    from phloem.kernels.attention.triton_decode_kernel import decode_attention_merge_kernel, decode_attention_split_kernel

    common = {"GROUP": 8, "D": 256, "PAGE": 16, "MIN_SPLIT": 16}
    pointers = _all("q kv_cache out", "*bf16") | _all("kv_indptr kv_indices kv_last_page_len", "*i32") | _all("o_part lse_part", "*fp32")
    # The prologue's operands (unused without PROLOGUE, typed as a launch passes them with it).
    pointers |= _all("k_new v_new q_norm_w k_norm_w gate", "*bf16") | _all("positions slots", "*i64") | {"inv_freq": "*fp32"}
    modes = [(direct, prologue, False) for direct in (False, True) for prologue in (False, True)]
    # preload: the one-tile splits' tile in registers before the wait (off where MIN_SPLIT cannot be one tile).
    for direct, prologue, preload in modes + [(False, True, True), (False, False, True)]:
        compile_for_h200(decode_attention_split_kernel, pointers, common | {
            "BLOCK_G": 16, "BLOCK_T": 32, "DIRECT": direct, "NUM_STAGES": 2, "PRECISION": "tf32", "PROLOGUE": prologue,
            "PRELOAD": preload},
            floats=frozenset({"qk_scale", "eps"}))  # fmt: skip
    compile_for_h200(decode_attention_merge_kernel, pointers, common | {"BLOCK_S": 16, "BLOCK_D": 256})


def gemv(pro: int, conv: bool, prefetch: bool, route: bool = False, fp8: bool = False) -> Any:
    """The one-token GEMV in the mode of each fused projection, at its 35B-A3B weight shape (with
    ``conv`` and ``prefetch``, the conv operands preloaded and the update after the walk; ``route``:
    with the router partial's epilogue; ``fp8``: a block-FP8 weight, e4m3 with fp32 scales)."""
    from phloem.kernels.linear.triton_gemv_kernel import gemv_kernel

    pointers = _all("p_x p_w p_y p_a p_nw p_res p_normed p_cw p_cs p_h p_rt p_pw p_ws", "*bf16") | _all("p_read p_write p_acc", "*i64")
    if fp8:
        pointers |= {"p_w": "*fp8e4nv", "p_ws": "*fp32"}
    kp = 4096 if pro in (2, 3) else 2048
    constexprs = {
        "PRO": pro, "CONV": conv, "KP": kp, "BLOCK_N": 8192 // kp, "PREFETCH": prefetch,
        "HAS_A": pro != 0, "WRITE_NORMED": pro == 1 and not conv, "ROUND_WEIGHTED": True,
        "HEAD": 128 if pro == 2 else 1, "KC": 4 if conv else 1, "BKC": 4 if conv else 1, "CONV_BLOCKS": 8 if conv and prefetch else 0,
        "ROUTE": route, "BE": 512 if route else 1, "COPIES": 4, "FP8": fp8, "KS": 128 if fp8 else 1,
    }  # fmt: skip
    return compile_for_h200(gemv_kernel, pointers, constexprs, floats=frozenset({"eps", "scale"}))


def w8a8_gemm(block_m: int) -> None:
    """The block-FP8 GEMM at its prefill (128-row, two warpgroups) and decode-batch (64-row) tiles:
    every MMA is an e4m3 wgmma (Triton upcasts to an f16 mma.sync below 64 rows)."""
    from phloem.kernels.linear.triton_w8a8 import w8a8_block_matmul_kernel

    pointers = _all("p_a p_b", "*fp8e4nv") | _all("p_as p_bs", "*fp32") | {"p_c": "*bf16"}
    constexprs = {"BLOCK_M": block_m, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8}
    ptx = compile_for_h200(w8a8_block_matmul_kernel, pointers, constexprs, num_warps=8 if block_m == 128 else 4).asm["ptx"]
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line or "mma.sync" in line]
    assert mma and all("wgmma" in line and ".e4m3.e4m3" in line for line in mma), mma[:2] or "no MMA instruction"


def w8a8_grouped() -> None:
    """The grouped (MoE) block-FP8 GEMM at the 35B-A3B gate/up shape: e4m3 wgmma as the dense one."""
    from phloem.kernels.moe.triton_grouped_w8a8 import w8a8_grouped_matmul_kernel

    pointers = _all("p_a p_w", "*fp8e4nv") | _all("p_as p_ws", "*fp32") | _all("p_rows p_block_e", "*i64") | {"p_c": "*bf16"}
    constexprs = {"E": 257, "A_DIV": 9, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128}
    ptx = compile_for_h200(w8a8_grouped_matmul_kernel, pointers, constexprs).asm["ptx"]
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line or "mma.sync" in line]
    assert mma and all("wgmma" in line and ".e4m3.e4m3" in line for line in mma), mma[:2] or "no MMA instruction"


def fp8_act_quant() -> None:
    """The activation quantization: an IEEE division and the hardware's round-to-nearest-even,
    saturating e4m3 cast, so it equals the torch reference bit for bit."""
    from phloem.kernels.linear.triton_w8a8 import fp8_act_quant_kernel

    pointers = {"p_x": "*bf16", "p_q": "*fp8e4nv", "p_s": "*fp32"}
    ptx = compile_for_h200(fp8_act_quant_kernel, pointers, {"GROUP": 128, "BLOCK_G": 8, "FP8_MAX": 448.0}).asm["ptx"]
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx, "no RNE e4m3 cast"
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx, "division not IEEE"


CASES: dict[str, Callable[[], None]] = {
    "qk_norm_rope_gate[store_kv]": lambda: qk_norm_rope(True),
    "qk_norm_rope_gate[k_out]": lambda: qk_norm_rope(False),
    "recurrent_gated_delta_rule[gates_in_kernel]": lambda: gdn_decode(True),
    "recurrent_gated_delta_rule[gates_given]": lambda: gdn_decode(False),
    "causal_conv1d_update": conv1d_update,
    "fused_moe (decode: gate_up, routed gate_up, down_sum)": lambda: fused_moe_decode(False),
    "fused_moe (decode, block-FP8 experts)": lambda: fused_moe_decode(True),
    "fused_moe_grouped (prefill: gate_up, down)": lambda: moe_grouped_prefill(False),
    "fused_moe_grouped (prefill, block-FP8 experts)": lambda: moe_grouped_prefill(True),
    "sort_by_expert_triton (the grouped MoE's block layout)": moe_sort,
    "moe_token (one token's gate_up, ids given / routed / from the router partial)": lambda: moe_token(False),
    "moe_token (block-FP8 experts)": lambda: moe_token(True),
    "paged_decode_attention (split, direct, with the prologue, merge)": decode_attention,
    "argmax (partial, final)": argmax,
    "moe_route[shared]": lambda: moe_route(True),
    "moe_route[plain]": lambda: moe_route(False),
    "gdn_gates": gdn_gates,
    "rms_norm, add_rms_norm, gated_rms_norm": norms,
    "linear (one-token GEMV)": lambda: gemv(0, False, False),
    "linear (one-token GEMV, prefetch)": lambda: gemv(0, False, True),
    "add_rms_norm_linear / _router": lambda: gemv(1, False, True),
    "add_rms_norm_conv_linear": lambda: gemv(1, True, True),
    "add_rms_norm_conv_linear (conv per block, no prefetch)": lambda: gemv(1, True, False),
    "gated_rms_norm_linear": lambda: gemv(2, False, True),
    "sigmoid_gate_linear": lambda: gemv(3, False, True),
    "gated_rms_norm_linear_route (the router partial)": lambda: gemv(2, False, True, route=True),
    "sigmoid_gate_linear_route (the router partial, no prefetch)": lambda: gemv(3, False, False, route=True),
    "linear (FP8 weight)": lambda: gemv(0, False, False, fp8=True),
    "linear (FP8 weight, prefetch)": lambda: gemv(0, False, True, fp8=True),
    "add_rms_norm_linear / _router (FP8 weight)": lambda: gemv(1, False, True, fp8=True),
    "add_rms_norm_conv_linear (FP8 weight)": lambda: gemv(1, True, True, fp8=True),
    "add_rms_norm_conv_linear (FP8 weight, conv per block, no prefetch)": lambda: gemv(1, True, False, fp8=True),
    "gated_rms_norm_linear (FP8 weight)": lambda: gemv(2, False, True, fp8=True),
    "sigmoid_gate_linear (FP8 weight)": lambda: gemv(3, False, True, fp8=True),
    "gated_rms_norm_linear_route (FP8 weight)": lambda: gemv(2, False, True, route=True, fp8=True),
    "sigmoid_gate_linear_route (FP8 weight, no prefetch)": lambda: gemv(3, False, False, route=True, fp8=True),
    "one_shot_add_rms_norm[world=2]": lambda: one_shot_norm(2),
    "one_shot_add_rms_norm[world=8]": lambda: one_shot_norm(8),
    "w8a8_block_matmul[prefill tile] (fp8 wgmma)": lambda: w8a8_gemm(128),
    "w8a8_block_matmul[decode tile] (fp8 wgmma)": lambda: w8a8_gemm(64),
    "fp8_act_quant (RNE e4m3 cast)": fp8_act_quant,
    "w8a8_grouped_matmul (MoE experts, fp8 wgmma)": w8a8_grouped,
}


def main() -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET (see the module docstring)"
    results = {}
    for name, case in CASES.items():
        try:
            case()
            results[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[name] = f"{type(exc).__name__}: {exc}"[:2000]
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()

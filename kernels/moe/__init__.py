"""Mixture of experts: top-k routing and the SwiGLU experts.

Torch references::

    reference        moe_route(_shared), fused_moe, fused_moe_routed
    route_partial    the router folded into the projection before it (one-token decode):
                     the fixed-point accumulator and fused_moe_route_partial
    w8a8             one W8A8 block-FP8 expert projection over (token, slot) pairs

Triton versions of them::

    triton_route     moe_route(_shared) in one launch; the routing rows the experts' kernels reuse
    triton_decode    fused_moe(_routed) for small batches (grouped GEMV), and the one-token paths
                     (fused_moe_token*, fused_moe_token_route_partial)
    triton_token     one token's gate/up stage, with the routing in its programs
    triton_grouped   fused_moe for prefill-sized batches (grouped GEMM over tokens sorted by expert)
    triton_grouped_w8a8  the W8A8 expert projection as a grouped FP8 tensor-core GEMM (not yet
                     called by the model: the experts' FP8 path is ``fused_moe``'s)
    triton_fp8       block-FP8 expert weights in those kernels: the operand a launch passes and the
                     tiles dequantized in registers (``FP8`` constexpr; bf16 compiles as without it)

Every experts' op takes ``w_gate_up`` / ``w_down`` dense or as ``kernels.linear.fp8.Fp8Weight``
(``float8_e4m3fn [E, N, K]`` with fp32 ``[E, N, ceil(K / 128)]`` scales); the references dequantize
only the experts a batch selected, the Triton kernels only the tiles they read.

Importing this package imports no Triton code.
"""

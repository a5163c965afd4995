"""Dense projections, alone and fused with the row ops around them (the one-token decode GEMVs).

Torch references::

    reference            linear and the fused projections (add_rms_norm_linear, ...), each taking
                         a dense weight or an Fp8Weight (dequantized, then the dense op);
                         fp8_block_matmul_reference (block-FP8 weights dequantized, then linear)
    fp8                  block-FP8 quantize / dequantize (128x128 scales, partial edge blocks);
                         Fp8Weight, the FP8 operand (e4m3 [N, K], fp32 scales [N, ceil(K/128)])
    w8a8                 W8A8 block-FP8 linear: activations quantized per token and 128 columns

Triton versions of them::

    triton_gemv          the one-token GEMVs (launchers), on dense or Fp8Weight weights
    triton_gemv_kernel   the GEMV kernel with its prologues and epilogues; with FP8, the e4m3
                         weight dequantized in registers (one scale a row and 128 columns)
    triton_gemv_config   tiles by weight shape
    triton_w8a8          the activation quantization and the block-scaled FP8 tensor-core GEMM

Importing this package imports no Triton code.
"""

"""Attention: paged KV store and attention, RoPE and the query/key prologue.

Torch references::

    reference       paged_attention, store_kv (the KV layout every backend shares)
    rope            apply_partial_rope, rope_inv_freq
    qk_norm_rope    qk_norm_rope_gate(_store): QK RMSNorm + RoPE + gate split (+ KV write)

Faster versions of them::

    flashinfer               FlashInferAttention: FlashInfer's prefill/decode wrappers over the
                             same pages, and the plans the attention layers run (CUDA)
    triton_decode            paged_decode_attention(_prologue): split-KV decode attention
    triton_decode_kernel     its split and merge kernels
    triton_qk_norm_rope      qk_norm_rope_gate(_store) in one launch

Importing this package imports no Triton code.
"""

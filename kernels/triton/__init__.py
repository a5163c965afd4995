"""Triton kernels with exactly the signatures and semantics of the torch references in ``kernels/``.

Role: the GPU fast path of the decode step. Each module names the reference it replaces, the ops it
fuses and the bytes it moves at the Qwen3.5-35B-A3B decode shape; ``kernels.dispatch.get_ops`` picks
these or the references per device.

Modules (import them directly; importing this package imports no Triton code)::

    gdn_decode      recurrent_gated_delta_rule(_with_gates)   kernels.gdn
    conv1d_update   causal_conv1d_update              kernels.conv1d
    norm            rms_norm, add_rms_norm, gated_rms_norm   kernels.norm
    qk_norm_rope    qk_norm_rope_gate(_store)         kernels.qk_norm_rope
    moe_route       moe_route, moe_route_shared       kernels.moe
    moe_grouped     fused_moe (prefill batches)       kernels.moe
    fused_moe       fused_moe, fused_moe_routed       kernels.moe
    moe_token       one token's gate/up (+ routing)   kernels.moe (via fused_moe)
    decode_attention  paged_decode_attention          kernels.attention.paged_attention (decode steps)
    gemv            linear and the fused projections  kernels.linear, kernels.fused_linear
                    (one token; tiles in gemv_config)
    allreduce_norm  one_shot_add_rms_norm (TP)        kernels.norm.all_reduce_add_rms_norm

``_pdl`` resolves the programmatic-dependent-launch choice the launchers take (``pdl``; on for sm_90+),
``_device`` the SM count and the balanced grid of the kernels whose programs walk tiles,
``gemv_config`` the one-token GEMVs' tiles by weight shape.

NOTE: ``@triton.jit`` reads ``TRITON_INTERPRET`` when a module is imported, so on CPU set
``TRITON_INTERPRET=1`` before the first import of any of these modules.

May import: torch, triton. Nothing of ours outside ``phloem.kernels``.
"""

__all__: list[str] = []

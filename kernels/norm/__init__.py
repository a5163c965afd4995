"""RMS norms of Qwen3-Next / Qwen3.5.

Torch references::

    reference          rms_norm, add_rms_norm, gated_rms_norm, all_reduce_add_rms_norm

Triton versions of them::

    triton_norm        rms_norm, add_rms_norm, gated_rms_norm
    triton_allreduce   one_shot_add_rms_norm: the one-shot all-reduce of tensor parallelism fused
                       with the add + RMSNorm after it

Importing this package imports no Triton code.
"""

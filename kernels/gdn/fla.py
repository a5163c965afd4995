"""GDN chunked prefill on CUDA through ``fla-core``, behind the reference's slot-indexed signature.

fla's ``chunk_gated_delta_rule`` takes varlen sequences flattened with ``cu_seqlens`` and one
initial state per sequence; this wrapper gathers those states from the slot pool
(``read_slots``; zeros where ``has_initial_state`` is False), runs the kernel with the q/k
L2-norm fused in, and scatters the final states to ``write_slots``. fla handles grouped value
heads (Hv a multiple of Hk) natively, so q and k are not expanded. Kept out of CPU environments:
transformers picks fla up when it is importable and its Triton kernels need a GPU.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_gated_delta_rule"]


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [T, Hk, Dk]
    k: torch.Tensor,  # [T, Hk, Dk]
    v: torch.Tensor,  # [T, Hv, Dv]
    g: torch.Tensor,  # [T, Hv] log decay, fp32
    beta: torch.Tensor,  # [T, Hv]
    ssm_states: torch.Tensor,  # [num_slots, Hv, Dk, Dv] fp32
    query_start_loc: torch.Tensor,  # [B + 1] int64 (int32 works, at a copy a call)
    read_slots: torch.Tensor,  # [B]
    write_slots: torch.Tensor,  # [B]
    has_initial_state: torch.Tensor,  # [B] bool
    chunk_size: int = 64,
) -> torch.Tensor:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    initial = torch.where(has_initial_state[:, None, None, None], ssm_states[read_slots], 0.0)
    out, final = fla_chunk(
        q[None],
        k[None],
        v[None],
        g[None].float(),
        beta[None],
        scale=q.shape[-1] ** -0.5,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        # The engine's int64 tensor passes through as the same object every GDN layer of a step,
        # so fla's identity-keyed cache (``fla.utils.tensor_cache``) builds the chunk indices once
        # a step; an int32 one would be a new copy, and a device sync, every layer.
        cu_seqlens=query_start_loc.long(),
        chunk_size=chunk_size,
    )
    ssm_states[write_slots] = final.float()
    return out[0]

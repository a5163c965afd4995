"""GDN chunked prefill on CUDA through ``fla-core``, behind the reference's slot-indexed signature.

fla's chunked gated delta rule takes varlen sequences flattened with ``cu_seqlens`` and one
initial state per sequence; this wrapper gathers those states from the slot pool
(``read_slots``; zeros where ``has_initial_state`` is False), runs the kernels with the q/k
L2-norm fused in, and scatters the final states to ``write_slots``. fla handles grouped value
heads (Hv a multiple of Hk) natively, so q and k are not expanded. Kept out of CPU environments:
transformers picks fla up when it is importable and its Triton kernels need a GPU.

It calls the body of fla's ``ChunkGatedDeltaRuleFunction.forward`` (fla-core 0.6.0, the version
the GPU image pins) directly: the L2 norms, the chunk indices, ``chunk_gated_delta_rule_fwd``.
The public function wraps those in a backend dispatch behind ``torch.compiler.disable``, an
autograd Function and an input guard, a third of the call's host time at a mixed step's shape
(``benchmarks/sweeps/gdn_host.py`` compares the two, and their outputs bit for bit); a mixed step
runs this once per GDN layer (docs/decisions.md).
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
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    from fla.ops.utils.index import prepare_chunk_indices

    initial = torch.where(has_initial_state[:, None, None, None], ssm_states[read_slots], 0.0)
    # The engine's int64 tensor passes through as the same object every GDN layer of a step, so
    # fla's identity-keyed cache (``fla.utils.tensor_cache``) builds the chunk indices once a
    # step; an int32 one would be a new copy, and a device sync, every layer.
    cu_seqlens = query_start_loc.long()
    with torch.cuda.device(q.device):  # fla's kernels launch on the current device
        qn, _ = l2norm_fwd(q.contiguous()[None])
        kn, _ = l2norm_fwd(k.contiguous()[None])
        _, out, _, final, _, _ = chunk_gated_delta_rule_fwd(
            q=qn, k=kn, v=v.contiguous()[None], g=g[None].float().contiguous(), beta=beta.contiguous()[None],
            scale=q.shape[-1] ** -0.5, initial_state=initial, output_final_state=True, cu_seqlens=cu_seqlens,
            chunk_indices=prepare_chunk_indices(cu_seqlens, chunk_size), chunk_size=chunk_size,
        )  # fmt: skip
    ssm_states[write_slots] = final.float()
    return out.to(q.dtype)[0]

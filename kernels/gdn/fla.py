"""GDN chunked prefill on CUDA through ``fla-core``, behind the reference's slot-indexed signature.

fla's chunked gated delta rule takes varlen sequences flattened with ``cu_seqlens`` and one
initial state per sequence; this wrapper gathers those states from the slot pool
(``read_slots``; zeros where ``has_initial_state`` is False), runs the kernels with the q/k
L2-norm fused in, and scatters the final states to ``write_slots``. fla handles grouped value
heads (Hv a multiple of Hk) natively, so q and k are not expanded. Kept out of CPU environments:
transformers picks fla up when it is importable and its Triton kernels need a GPU.

It calls the body of fla's ``ChunkGatedDeltaRuleFunction.forward`` (fla-core 0.6.0, the version
the GPU image pins) directly: the L2 norms, the chunk indices, then the four steps of
``chunk_gated_delta_rule_fwd`` (gate cumsum, intra-chunk WY representation, chunk states,
output), so that the state step can take precomputed chunk offsets.
The public function wraps those in a backend dispatch behind ``torch.compiler.disable``, an
autograd Function and an input guard, a third of the call's host time at a mixed step's shape
(``benchmarks/sweeps/gdn_host.py`` compares the two, and their outputs bit for bit); a mixed step
runs this once per GDN layer (docs/decisions.md).

With ``chunks`` (``kernels.gdn.chunk_indices.static_chunk_indices`` over a layout of fixed shape)
nothing is read on the host and fla's identity-keyed caches are bypassed, so the call can be
captured in a CUDA graph and replayed with other lengths (``engine.prefill_graph``); without, fla
builds the indices from the lengths, once a step.
"""

from __future__ import annotations

import torch

from phloem.kernels.gdn.chunk_indices import CHUNK_SIZE

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
    chunk_size: int = CHUNK_SIZE,
    chunks: tuple[torch.Tensor, torch.Tensor] | None = None,  # (chunk_indices [NT, 2], chunk_offsets [B + 1])
) -> torch.Tensor:
    from fla.modules.norm.l2norm import l2norm_fwd
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    from fla.ops.utils.index import prepare_chunk_indices

    initial = torch.where(has_initial_state[:, None, None, None], ssm_states[read_slots], 0.0)
    # The engine's int64 tensor passes through as the same object every GDN layer of a step, so
    # fla's identity-keyed cache (``fla.utils.tensor_cache``) builds the chunk indices once a
    # step; an int32 one would be a new copy, and a device sync, every layer.
    cu_seqlens = query_start_loc.long()
    indices, offsets = chunks if chunks is not None else (prepare_chunk_indices(cu_seqlens, chunk_size), None)
    varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=indices, chunk_size=chunk_size)
    with torch.cuda.device(q.device):  # fla's kernels launch on the current device
        qn, _ = l2norm_fwd(q.contiguous()[None])
        kn, _ = l2norm_fwd(k.contiguous()[None])
        v, beta = v.contiguous()[None], beta.contiguous()[None]
        gc = chunk_local_cumsum(g[None].float().contiguous(), scale=RCP_LN2, **varlen)  # type: ignore[arg-type]
        w, u, _ = chunk_gated_delta_rule_fwd_intra(k=kn, v=v, g=gc, beta=beta, **varlen)  # type: ignore[arg-type]
        h, v_new, final = chunk_gated_delta_rule_fwd_h(
            k=kn, w=w, u=u, g=gc, initial_state=initial, output_final_state=True, chunk_offsets=offsets, **varlen,
        )  # fmt: skip
        out = chunk_fwd_o(q=qn, k=kn, v=v_new, h=h, g=gc, scale=q.shape[-1] ** -0.5, **varlen)  # type: ignore[arg-type]
    ssm_states[write_slots] = final.float()
    return out.to(q.dtype)[0]

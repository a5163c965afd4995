"""Gated delta rule (GDN linear attention) over slot-addressed recurrent state.

Shapes: ``q``, ``k`` ``[T, Hk, Dk]``; ``v`` ``[T, Hv, Dv]`` with ``Hv % Hk == 0`` (q/k heads are
repeat-interleaved up to ``Hv``); ``g`` ``[T, Hv]`` fp32 log decay (``<= 0``); ``beta`` ``[T, Hv]``;
``ssm_states`` ``[num_slots, Hv, Dk, Dv]`` fp32. Decode entry points take ``B`` rows instead of ``T``.

Per token, with q and k L2-normalised (eps 1e-6) and q scaled by ``Dk ** -0.5``::

    S = exp(g) * S
    S = S + k (beta * (v - S^T k))^T        # delta rule write, S is [Dk, Dv]
    o = S^T q

Sequence ``i`` starts from ``ssm_states[read_slots[i]]`` (zeros if not ``has_initial_state[i]``) and its
final state is written to ``ssm_states[write_slots[i]]``. All reads happen before any write.

Everything runs in fp32 (HF ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``)
and outputs are cast to ``v.dtype``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from phloem.kernels.gdn.chunk_indices import CHUNK_SIZE

__all__ = [
    "chunk_gated_delta_rule", "gdn_gates", "naive_recurrent_gated_delta_rule", "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_with_gates",
]

_L2_EPS = 1e-6


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """Casts to ``dtype``, expands q/k heads to ``Hv`` and L2-normalises them (q not yet scaled)."""
    group = v.shape[-2] // k.shape[-2]
    q, k = (x.to(dtype).repeat_interleave(group, dim=-2) for x in (q, k))
    q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS) for x in (q, k))
    return q, k, v.to(dtype), g.to(dtype), beta.to(dtype)


def _delta_step(
    state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token. ``state`` ``[..., H, Dk, Dv]``, q/k ``[..., H, Dk]``, v ``[..., H, Dv]``, g/beta ``[..., H]``."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., None]).sum(-2)  # [..., H, Dv]
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def _chunk_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, head-major: q/k ``[H, L, Dk]``, v ``[H, L, Dv]``, g/beta ``[H, L]``, state ``[H, Dk, Dv]``."""
    length = q.shape[1]
    out = torch.empty_like(v)
    for start in range(0, length, chunk_size):
        c = slice(start, min(start + chunk_size, length))
        qc, kc, vc, bc = q[:, c], k[:, c], v[:, c], beta[:, c]
        gc = g[:, c].cumsum(-1)  # [H, C], log decay since the chunk start
        n = gc.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        # decay[i, j] = exp(gc_i - gc_j) for j <= i; masked before exp so the upper triangle cannot overflow.
        decay = (gc[:, :, None] - gc[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, C, C]
        k_beta = kc * bc[..., None]
        # UT transform: T = I + strictly_lower(beta_i k_i.k_j decay_ij) folds the chunk's sequential
        # delta-rule writes into u = T^-1 (beta v) and w = T^-1 (beta k exp(gc)); the diagonal is ignored.
        system = (k_beta @ kc.transpose(-1, -2)) * decay
        u = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)
        v_new = u - w @ state  # [H, C, Dv], the part of v the incoming state does not predict
        attn = (qc @ kc.transpose(-1, -2)) * decay
        out[:, c] = (qc * gc.exp()[..., None]) @ state + attn @ v_new
        g_last = gc[:, -1:]  # [H, 1]
        k_decayed = kc * (g_last - gc).exp()[..., None]
        state = state * g_last.exp()[..., None] + k_decayed.transpose(-1, -2) @ v_new
    return out, state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
    chunks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Varlen prefill: ``[T, Hv, Dv]`` in ``v.dtype``; final states go to ``ssm_states[write_slots]``.
    ``chunks`` (device-built chunk indices for fla's kernels, ``kernels.gdn.chunk_indices``) is
    not needed here: the lengths are read on the host."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, torch.float32)
    q = q * q.shape[-1] ** -0.5
    initial = ssm_states[read_slots].float()  # [B, Hv, Dk, Dv], gathered before any write
    initial[~has_initial_state.to(initial.device)] = 0
    out = torch.empty(v.shape, dtype=out_dtype, device=v.device)
    starts = query_start_loc.tolist()
    for i in range(len(starts) - 1):
        s = slice(starts[i], starts[i + 1])
        qs, ks, vs, gs, bs = (x[s].transpose(0, 1) for x in (q, k, v, g, beta))
        o, final = _chunk_sequence(qs, ks, vs, gs, bs, initial[i], chunk_size)
        out[s] = o.transpose(0, 1).to(out_dtype)
        ssm_states[write_slots[i]] = final.to(ssm_states.dtype)
    return out


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
) -> torch.Tensor:
    """Decode, one token per sequence (always from a stored state): ``[B, Hv, Dv]`` in ``v.dtype``."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, torch.float32)
    q = q / q.shape[-1] ** 0.5
    o, state = _delta_step(ssm_states[read_slots].float(), q, k, v, g, beta)
    ssm_states[write_slots] = state.to(ssm_states.dtype)
    return o.to(out_dtype)


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token ground truth for one sequence (``[L, ...]`` inputs, ``[Hv, Dk, Dv]`` state).

    Computes in ``v.dtype`` promoted to at least fp32 (pass fp64 for a tighter reference). Returns
    ``(out [L, Hv, Dv] in v.dtype, final_state)``.
    """
    dtype = torch.promote_types(v.dtype, torch.float32)
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, dtype)
    q = q / q.shape[-1] ** 0.5
    num_heads, k_dim, v_dim = v.shape[1], k.shape[-1], v.shape[-1]
    state = torch.zeros(num_heads, k_dim, v_dim, dtype=dtype, device=v.device)
    if initial_state is not None:
        state = initial_state.to(dtype)
    out = torch.empty(v.shape, dtype=dtype, device=v.device)
    for t in range(v.shape[0]):
        out[t], state = _delta_step(state, q[t], k[t], v[t], g[t], beta[t])
    return out.to(out_dtype), state


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The GDN gates from the ``a``/``b`` projections ``[T, Hv]``: ``g = -exp(A_log) * softplus(a + dt_bias)``
    (fp32 log decay) and ``beta = sigmoid(b)`` (in ``b``'s dtype), as HF computes them."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b)


def recurrent_gated_delta_rule_with_gates(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
) -> torch.Tensor:
    """``gdn_gates`` then ``recurrent_gated_delta_rule``: the decode step from the raw ``a``/``b``
    projections ``[B, Hv]`` (the Triton version computes the gates inside its one launch)."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return recurrent_gated_delta_rule(q, k, v, g, beta, ssm_states, read_slots, write_slots)

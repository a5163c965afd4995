"""Depthwise causal conv1d with SiLU over the GDN ``q|k|v`` channels, with slot-addressed state.

Shapes: ``x`` ``[T, D]`` (varlen tokens of B sequences) or ``[B, D]`` (decode), ``weight`` ``[D, K]``,
``bias`` ``[D] | None``, ``conv_states`` ``[num_slots, D, K-1]``. A slot holds the last ``K-1`` inputs
of its sequence, oldest first::

    window of token t:  | state (K-1 inputs, zeros if no initial state) | x[0] ... x[t] |
                                                          out[t] = silu(sum(weight * last K inputs) + bias)

Sequence ``i`` reads its state from ``read_slots[i]`` and writes the final ``K-1`` inputs of the window
(state included when the sequence is shorter than ``K-1``) to ``write_slots[i]``. All reads happen
before any write, so a read slot is never modified unless it is also a write slot.

Numerics mirror HF ``causal_conv1d_fn`` / ``causal_conv1d_update``: the conv runs in ``weight.dtype``,
the activation follows in the same dtype, and the output is cast to ``x.dtype``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_update", "causal_conv1d_varlen"]


def _conv_silu(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``window`` ``[N, D, K-1+L]`` -> ``[N, D, L]`` in ``weight.dtype``."""
    out = F.conv1d(window.to(weight.dtype), weight.unsqueeze(1), bias, groups=weight.shape[0])
    return F.silu(out)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    state_len = weight.shape[1] - 1
    starts = query_start_loc.tolist()
    initial = conv_states[read_slots]  # [B, D, K-1], gathered before any write
    initial[~has_initial_state.to(initial.device)] = 0
    out = torch.empty_like(x)
    for i in range(len(starts) - 1):
        start, end = starts[i], starts[i + 1]
        window = torch.cat((initial[i].to(x.dtype), x[start:end].T), dim=-1)  # [D, K-1+L]
        if end > start:  # an empty sequence passes its state through
            out[start:end] = _conv_silu(window[None], weight, bias)[0].T.to(x.dtype)
        conv_states[write_slots[i]] = window[:, window.shape[-1] - state_len :].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    read_slots: torch.Tensor,
    write_slots: torch.Tensor,
) -> torch.Tensor:
    """One decode token per sequence; every sequence has an initial state."""
    window = torch.cat((conv_states[read_slots].to(x.dtype), x[:, :, None]), dim=-1)  # [B, D, K]
    out = _conv_silu(window, weight, bias)[:, :, 0].to(x.dtype)
    conv_states[write_slots] = window[:, :, 1:].to(conv_states.dtype)
    return out

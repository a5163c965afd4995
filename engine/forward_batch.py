"""What one model forward reads: the step's tokens flattened over requests, and where their state lives.

Tokens of all scheduled requests are concatenated (varlen). Request ``i`` owns rows
``query_start_loc[i] : query_start_loc[i+1]`` of ``input_ids``; its KV history after this step is
``seq_lens[i]`` tokens long, so its new tokens sit at positions
``seq_lens[i] - query_len_i ... seq_lens[i] - 1``::

    request i:  |<------- cached / earlier steps ------->|<--- this step --->|
                0                          seq_lens[i] - query_len_i     seq_lens[i]

Full-attention KV lives in pages: ``page_table[i, j]`` is the page holding positions
``j*page_size ... (j+1)*page_size - 1``; ``slot_mapping[t] = page * page_size + offset`` is where
the new token ``t`` writes its K and V.

GDN state lives in slots (copy-on-write by index indirection): request ``i`` reads its initial
recurrent and conv state from slot ``read_slots[i]`` (only when ``has_initial_state[i]``; otherwise it
starts from zeros) and writes its final state to ``write_slots[i]``. The two differ on the first
step after a prefix-cache hit or a fork, so the cached checkpoint is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    # [B + 1] int64, cumulative query lengths: int64 as fla's varlen kernels take it, so the one
    # tensor of a step is theirs as is (fla memoizes its chunk indices by tensor identity: computed,
    # with a device sync, once a step rather than once a GDN layer).
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor  # [B] int32, KV length of each request after this step
    page_table: torch.Tensor  # [B, max_pages] int32; read by the torch reference only ([B, 1] zeros beside a FlashInfer plan)
    slot_mapping: torch.Tensor  # [T] int64
    read_slots: torch.Tensor  # [B] int64
    write_slots: torch.Tensor  # [B] int64
    has_initial_state: torch.Tensor  # [B] bool
    logits_indices: torch.Tensor  # [S] int64, rows whose hidden state is turned into logits
    query_lens_cpu: tuple[int, ...]  # [B], the same lengths on the host
    is_decode: bool  # every request has exactly one new token
    # Backend-specific attention plan (e.g. FlashInfer wrappers); None for the torch reference.
    attn_metadata: Any = None
    # fla's chunk indices and offsets for the GDN layers, built on the device for a layout of fixed
    # shape (``kernels.gdn.chunk_indices``; ``engine.prefill_graph``); None: fla builds them.
    gdn_chunks: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)


@dataclass(frozen=True, slots=True)
class ModelCaches:
    """The engine's state tensors, shared by every request (rows are handed out by the pools).

    ``kv[a]`` is the paged KV of the ``a``-th full-attention layer, ``conv[g]`` / ``ssm[g]`` the
    conv and recurrent state of the ``g``-th GDN layer. Layers index by their position among
    layers of the same kind, not by model layer index.
    """

    kv: torch.Tensor  # [num_attn_layers, num_pages, 2, page_size, num_kv_heads, head_dim]
    conv: torch.Tensor  # [num_gdn_layers, num_slots, conv_dim, conv_kernel - 1]
    ssm: torch.Tensor  # [num_gdn_layers, num_slots, num_v_heads, key_head_dim, value_head_dim] fp32

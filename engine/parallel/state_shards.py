"""A cached prefix's KV pages and GDN state, read from and written to the caches of every rank.

Exported state (``engine.transfer.prefix_export``, what ``storage`` segments hold) is always in the TP=1
layout, whatever the tensor-parallel size that produced it, so a session spilled by a TP=2 server
resumes on a TP=1 or TP=4 one. Rank ``r``'s caches hold a part of each tensor: ranges along
one dim of the whole-model layout (the same split as the weights, ``engine.parallel``)::

    kv    [attn_layers, pages, 2, page_size, Hkv, D]   dim 4: its KV heads (its share, or the
                                                       one KV head its q heads read)
    conv  [gdn_layers, conv_dim, K - 1]                 dim 1: its q, k and v channels (3 ranges)
    ssm   [gdn_layers, Hv, Dk, Dv] (fp32)               dim 1: its value heads

Export gathers every rank's part to rank 0 and places each range (a replicated KV head is
written once per rank that holds it, with the same values); import cuts each rank's ranges out
of the whole tensors and scatters them. Both are collectives: every rank of the group calls the
same function for the same pages and slot (rank 0 tells the others through a ``StepPlan``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phloem.engine.config import ModelConfig
from phloem.engine.forward_batch import ModelCaches
from phloem.engine.host_copy import to_device
from phloem.engine.parallel.group import TPGroup, kv_head_start
from phloem.kernels.attention.reference import to_kv_dtype

__all__ = ["StateTensors", "gather_state", "read_local", "scatter_state", "state_shapes", "write_local"]

# kv, conv, ssm
StateTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class _Part:
    """Where one rank's tensor sits in the whole one: ``ranges`` along ``dim``, concatenated in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]


def _parts(mc: ModelConfig, rank: int, size: int) -> tuple[_Part, _Part, _Part]:
    tp = TPGroup(rank, size, torch.device("cpu"))
    kv_heads = max(1, mc.num_key_value_heads // size)
    kv0 = kv_head_start(mc.num_attention_heads, mc.num_key_value_heads, tp)
    nk, nv = mc.linear_num_key_heads // size, mc.linear_num_value_heads // size
    dk, dv = mc.linear_key_head_dim, mc.linear_value_head_dim
    key_dim = mc.linear_key_dim
    k0, v0 = rank * nk, rank * nv
    conv = (
        (k0 * dk, (k0 + nk) * dk),
        (key_dim + k0 * dk, key_dim + (k0 + nk) * dk),
        (2 * key_dim + v0 * dv, 2 * key_dim + (v0 + nv) * dv),
    )
    return _Part(4, ((kv0, kv0 + kv_heads),)), _Part(1, conv), _Part(1, ((v0, v0 + nv),))


def state_shapes(mc: ModelConfig, page_size: int, num_pages: int) -> tuple[tuple[int, ...], ...]:
    """The whole-model (TP=1) shapes of ``kv``, ``conv`` and ``ssm`` for ``num_pages`` pages."""
    return (
        (len(mc.full_attention_layers), num_pages, 2, page_size, mc.num_key_value_heads, mc.head_dim),
        (len(mc.linear_attention_layers), mc.conv_dim, mc.linear_conv_kernel_dim - 1),
        (len(mc.linear_attention_layers), mc.linear_num_value_heads, mc.linear_key_head_dim, mc.linear_value_head_dim),
    )


def read_local(caches: ModelCaches, pages: Sequence[int], slot: int, kv_layers: int | None = None) -> StateTensors:
    """This rank's pages (copied out) and slot (views of the caches), on the caches' device.
    ``kv_layers``: the first that many KV layers only (the trunk's: a speculating engine's pool
    has the MTP layer's after them, which a moved state does not carry)."""
    index = torch.tensor(list(pages), dtype=torch.long, device=caches.kv.device)
    return caches.kv[:kv_layers].index_select(1, index), caches.conv[:, slot], caches.ssm[:, slot]


def write_local(caches: ModelCaches, pages: Sequence[int], slot: int | None, state: StateTensors) -> None:
    """Copy this rank's part of a state into its ``pages`` and ``slot`` (None: the KV only), on the
    current stream, queued rather than waited for from pinned host memory (the page index too)."""
    kv, conv, ssm = state
    dev = caches.kv.device
    non_blocking = dev.type == "cuda" and kv.is_pinned()
    index = to_device(torch.tensor(list(pages), dtype=torch.long), dev)
    # A state carries the trunk's KV layers; the MTP layer's (after them, when speculating) keep
    # what the pages held: the drafts' quality, never the output, depends on them.
    if kv.is_contiguous() or dev.type != "cuda":
        kv = kv.to(dev, non_blocking=non_blocking)
    else:
        # A page range of a state (``kv.narrow(1, ...)``, past a prefix the tree held) is a
        # strided view: copied whole, torch would stage it through pageable memory and block
        # the host. Each layer's slice of it is contiguous (and pinned): one copy a layer.
        out = torch.empty(kv.shape, dtype=kv.dtype, device=dev)
        for layer in range(kv.shape[0]):
            out[layer].copy_(kv[layer], non_blocking=non_blocking)
        kv = out
    if kv.dtype != caches.kv.dtype:
        # A segment of another KV dtype converts (docs/decisions.md, "FP8 KV cache").
        kv = to_kv_dtype(kv, caches.kv.dtype)
    dst = caches.kv[: kv.shape[0]]
    if dst.element_size() == 1:
        dst, kv = dst.view(torch.uint8), kv.view(torch.uint8)  # index_copy_ has no fp8 kernel on CPU
    dst.index_copy_(1, index, kv)
    if slot is not None:
        caches.conv[:, slot].copy_(conv, non_blocking=non_blocking and conv.is_pinned())
        caches.ssm[:, slot].copy_(ssm, non_blocking=non_blocking and ssm.is_pinned())


def _merge(parts: Sequence[torch.Tensor], where: Sequence[_Part], shape: tuple[int, ...]) -> torch.Tensor:
    out = parts[0].new_empty(shape)
    for part, place in zip(parts, where):
        offset = 0
        for start, end in place.ranges:
            out.narrow(place.dim, start, end - start).copy_(part.narrow(place.dim, offset, end - start))
            offset += end - start
    return out


def _cut(whole: torch.Tensor, place: _Part) -> torch.Tensor:
    return torch.cat([whole.narrow(place.dim, start, end - start) for start, end in place.ranges], place.dim)


def gather_state(
    tp: TPGroup, mc: ModelConfig, caches: ModelCaches, pages: Sequence[int], slot: int
) -> StateTensors | None:
    """Collective: the whole state of ``pages`` and ``slot`` on rank 0 (its device); None elsewhere."""
    local = read_local(caches, pages, slot, len(mc.full_attention_layers))
    if tp.size == 1:
        return local
    gathered = [tp.gather_list(t) for t in local]
    if tp.rank != 0:
        return None
    where = [_parts(mc, r, tp.size) for r in range(tp.size)]
    shapes = state_shapes(mc, caches.kv.shape[3], len(pages))
    kv, conv, ssm = (
        _merge(parts, [w[i] for w in where], shapes[i]) for i, parts in enumerate(gathered) if parts is not None
    )
    return kv, conv, ssm


def scatter_state(
    tp: TPGroup,
    mc: ModelConfig,
    caches: ModelCaches,
    pages: Sequence[int],
    slot: int,
    whole: StateTensors | None,
) -> None:
    """Collective: write each rank's part of ``whole`` (given on rank 0 only) into ``pages`` and ``slot``."""
    if tp.size == 1:
        assert whole is not None
        write_local(caches, pages, slot, whole)
        return
    dev = caches.kv.device
    shapes = ((caches.kv.shape[0], len(pages), *caches.kv.shape[2:]), caches.conv[:, 0].shape, caches.ssm[:, 0].shape)
    dtypes = (caches.kv.dtype, caches.conv.dtype, caches.ssm.dtype)
    where = [_parts(mc, r, tp.size) for r in range(tp.size)]
    received = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        out = torch.empty(shape, dtype=dtype, device=dev)
        cuts = None
        if whole is not None:
            t = whole[i].to(dev)
            if t.dtype != dtype:
                t = to_kv_dtype(t, dtype)  # a state of another KV dtype converts (write_local)
            cuts = [_cut(t, w[i]) for w in where]
        received.append(tp.scatter_from_first(out, cuts))
    kv, conv, ssm = received
    write_local(caches, pages, slot, (kv, conv, ssm))

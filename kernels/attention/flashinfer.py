"""Paged attention through FlashInfer on CUDA, over the same KV layout as the torch reference.

The KV layout is chosen once for both backends: per layer ``[num_pages, 2, page_size, Hkv, D]``
(FlashInfer's ``NHD`` paged layout with K and V stacked). A step plans once on the host (page
indptr/indices/last-page lengths) and every attention layer then runs the same plan.

Pure-decode steps use the decode wrapper (tensor cores on: GQA 16:2 gives 8 query heads per KV
head); any step with a multi-token query uses the prefill wrapper with a causal mask, which also
covers chunked prefill over a cached history. A mixed step (the scheduler puts its one-token decode
rows first, then the prefill chunks) runs as two calls (``MixedPlan``): the decode rows through the
decode kernel, the chunks through the prefill wrapper. In one prefill call each decode row takes a
128-row query tile of its own for one row's work and walks its whole history in that one CTA
(FlashInfer's FA3 prefill does not split KV), so a batch of decode rows beside a tool result's
chunk over a long history cost the layer several times the chunk's own attention; split, it costs
the chunk plus a decode step's attention (docs/decisions.md).

For CUDA-graph capture a decode wrapper is built per batch size with fixed index buffers
(``use_cuda_graph=True``); ``plan`` then refills those buffers in place before each replay.

FlashInfer's ``plan`` fills a pinned host buffer and queues its copy to the device; the next
``plan`` rewrites that buffer. The page indices of a captured graph's wrapper reach the device by a
queued copy of ours first (FlashInfer's own copy of host indices into the fixed buffer blocks the
host until the device has run every queued step, which async scheduling cannot hide). When the engine queues step N+1 before step N has run (async
scheduling), a plan must not overwrite the buffer before step N's copy has been done: each plan
waits for the previous plan's copies (an event recorded after them; the device reaches them as
soon as it starts step N, so the wait is short) and records its own.

Pure-decode steps of fp16/bf16 models run the split-KV Triton kernel
(``kernels.attention.triton_decode``) instead of FlashInfer's decode, unless
``KernelConfig.triton_decode_attention`` is off: it reads the same indptr / indices / last-page
lengths, which a plan copies from pinned memory into the device (a captured graph keeps them in
its staging buffer with the step's other inputs, ``engine.cuda_graph``, and plans nothing), needs
no host-side scheduling of its own, and joins the decode kernels' programmatic dependent launch.
Its attention layers hand their prologue (QK norm, RoPE, gate, KV write) to the split launch
(``TritonDecodePlan.prologue``).

FP8 KV pages (``kv_dtype`` ``float8_e4m3fn``, unit scale): every step goes through FlashInfer,
whose wrappers read them given ``kv_data_type`` and upcast in the kernel; the Triton decode
kernel reads only pages of the query's dtype, so it is off for them (decode steps and their
captured graphs use FlashInfer's decode wrappers, the layers' ``qk_norm_rope_gate_store`` writes
the pages with a saturating cast).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from phloem.kernels.config import KernelConfig

__all__ = [
    "MAX_GRAPH_PAGES", "FlashInferAttention", "FlashInferPlan", "MixedPlan", "TritonDecodePlan", "fill_page_lists",
    "flashinfer_available", "page_indices",
]

_WORKSPACE_BYTES = 256 * 1024 * 1024
# Page ids a captured decode step can hold (all sequences of the bucket together): FlashInfer's
# fixed-buffer wrapper and the graph runner's staging buffer (engine.cuda_graph).
MAX_GRAPH_PAGES = 1 << 20


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@dataclass(frozen=True, slots=True)
class FlashInferPlan:
    """A planned wrapper; ``run`` is what the attention layers call."""

    wrapper: Any

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``kv_cache`` ``[pages, 2, page_size, Hkv, D]`` -> ``[T, Hq, D]``."""
        out: torch.Tensor = self.wrapper.run(q, kv_cache)
        return out


@dataclass(frozen=True, slots=True)
class TritonDecodePlan:
    """A pure-decode step through ``kernels.attention.triton_decode``: the page lists on the device
    (the kernel's split count depends on the batch size alone, so a captured graph's grid holds for
    any lengths)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    scale: float
    # The attention layers hand the step's projections to ``run_prologue`` (QK norm, RoPE, gate and
    # the KV write inside the split launch) instead of running them first (the engine's plans always
    # do; False is the two-launch composition the tests compare it with).
    prologue: bool = False
    # Launched under programmatic dependent launch (``kernels/common/pdl.py``).
    pdl: bool = False

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """``q`` ``[B, Hq, D]``, ``kv_cache`` ``[pages, 2, page_size, Hkv, D]`` -> ``[B, Hq, D]``."""
        from phloem.kernels.attention.triton_decode import paged_decode_attention

        return paged_decode_attention(
            q, kv_cache, self.kv_indptr, self.kv_indices, self.kv_last_page_len, self.scale, pdl=self.pdl
        )

    def run_prologue(
        self, q_gate: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_norm_w: torch.Tensor,
        k_norm_w: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float,
        kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``kernels.attention.qk_norm_rope.qk_norm_rope_gate_store`` then ``run``, in one split launch:
        ``(out [B, Hq, D], gate [B, Hq * D])`` (``kernels.attention.triton_decode.paged_decode_attention_prologue``)."""
        from phloem.kernels.attention.triton_decode import paged_decode_attention_prologue

        return paged_decode_attention_prologue(
            q_gate, key, value, q_norm_w, k_norm_w, positions, inv_freq, eps, kv_cache, slot_mapping,
            self.kv_indptr, self.kv_indices, self.kv_last_page_len, self.scale, pdl=self.pdl,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class MixedPlan:
    """A mixed step's attention in two calls: its first ``num_decode`` rows (one token each) through
    ``decode``, the other rows (the prefill chunks) through ``prefill``."""

    num_decode: int
    decode: FlashInferPlan | TritonDecodePlan
    prefill: FlashInferPlan

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``kv_cache`` ``[pages, 2, page_size, Hkv, D]`` -> ``[T, Hq, D]``."""
        n = self.num_decode
        return torch.cat([self.decode.run(q[:n], kv_cache), self.prefill.run(q[n:], kv_cache)])


def page_indices(
    page_ids: Sequence[Sequence[int]], seq_lens: Sequence[int], page_size: int, pin: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host-side ``(indptr [B+1], indices [nnz], last_page_len [B])`` int32 for FlashInfer.

    ``pin``: in pinned memory, so FlashInfer's non-blocking copies of them are queued, not staged
    through a copy that may wait for the device (``engine.host_copy`` says why that matters).
    """
    num = len(seq_lens)
    indptr = torch.empty(num + 1, dtype=torch.int32, pin_memory=pin)
    last = torch.empty(num, dtype=torch.int32, pin_memory=pin)
    indices = torch.empty(sum(-(-n // page_size) for n in seq_lens), dtype=torch.int32, pin_memory=pin)
    fill_page_lists(page_ids, seq_lens, page_size, indptr.numpy(), indices.numpy(), last.numpy())
    return indptr, indices, last


def fill_page_lists(
    page_ids: Sequence[Sequence[int]], seq_lens: Sequence[int], page_size: int,
    indptr: np.ndarray, indices: np.ndarray, last: np.ndarray,
) -> int:  # fmt: skip
    """``page_indices``'s lists written into int32 arrays (``indptr[:B+1]``, ``last[:B]``,
    ``indices[:nnz]``; e.g. views of a pinned staging buffer); returns ``nnz``.

    The page ids go straight into the array, a request's slice at a time. Give each request's ids
    as an int32 numpy array where the caller can (``engine.cache.page_lists`` keeps them across steps):
    a slice of an array is a memory copy, a slice of a Python list is converted id by id.

    Raises:
        ValueError: a request has fewer pages than its tokens need, or ``indices`` is too short.
    """
    used = [-(-n // page_size) for n in seq_lens]
    ends = list(itertools.accumulate(used, initial=0))
    if ends[-1] > len(indices):
        raise ValueError(f"{ends[-1]} pages do not fit a page list of {len(indices)}")
    indptr[: len(ends)] = ends
    last[: len(used)] = [n - (u - 1) * page_size for n, u in zip(seq_lens, used)]
    for i, (pages, start, end) in enumerate(zip(page_ids, ends, ends[1:])):
        if len(pages) < end - start:
            raise ValueError(f"request {i} has {len(pages)} pages for {seq_lens[i]} tokens of {page_size} a page")
        indices[start:end] = pages[: end - start]
    return ends[-1]


class FlashInferAttention:
    """FlashInfer's prefill and decode wrappers over one workspace; with
    ``config.triton_decode_attention`` pure-decode steps plan the split-KV Triton kernel instead
    (with the attention prologue inside it, and ``config.pdl`` resolved for ``device``).
    ``kv_dtype``: the pages' dtype (default ``dtype``); fp8 pages turn the Triton decode off."""

    def __init__(
        self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
        device: torch.device, config: KernelConfig = KernelConfig(), kv_dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        import flashinfer

        self._fi = flashinfer
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.kv_dtype = kv_dtype or dtype
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        self._graph_wrappers: dict[int, Any] = {}
        self._staged: torch.cuda.Event | None = None  # recorded after the last plan's copies
        # Mixed steps' decode rows through the decode kernel (``MixedPlan``); off: every row in
        # the one prefill call (the comparison of benchmarks/sweeps/mixed_step.py).
        self.split_mixed = True
        self.triton_decode = config.triton_decode_attention and self.kv_dtype == dtype
        self.prologue = self.triton_decode
        self.pdl = False
        if self.triton_decode:
            from phloem.kernels.common.pdl import use_pdl

            self.pdl = use_pdl(config.pdl, device)

    def plan(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        page_ids: Sequence[Sequence[int]],
        graph_batch_size: int | None = None,
    ) -> FlashInferPlan | TritonDecodePlan | MixedPlan:
        """Plan one step. ``graph_batch_size`` selects the fixed buffers of a captured graph."""
        if self._staged is not None:
            self._staged.synchronize()  # the previous plan's pinned buffer has been copied
        planned = self._plan(query_lens, seq_lens, page_ids, graph_batch_size)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return planned

    def _plan(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        page_ids: Sequence[Sequence[int]],
        graph_batch_size: int | None,
    ) -> FlashInferPlan | TritonDecodePlan | MixedPlan:
        num_decode = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        if self.split_mixed and 0 < num_decode < len(query_lens):
            assert graph_batch_size is None, "only decode steps are captured"
            decode = self._plan(query_lens[:num_decode], seq_lens[:num_decode], page_ids[:num_decode], None)
            prefill = self._plan(query_lens[num_decode:], seq_lens[num_decode:], page_ids[num_decode:], None)
            assert isinstance(prefill, FlashInferPlan) and not isinstance(decode, MixedPlan)
            if isinstance(decode, TritonDecodePlan):
                decode = dataclasses.replace(decode, prologue=False)  # the layer runs the prologue first
            return MixedPlan(num_decode, decode, prefill)
        indptr, indices, last = page_indices(page_ids, seq_lens, self.page_size, pin=True)
        common = dict(q_data_type=self.dtype, kv_data_type=self.kv_dtype, sm_scale=self.head_dim**-0.5)
        if all(n == 1 for n in query_lens) and self.triton_decode:
            return self._triton_plan(indptr, indices, last, graph_batch_size)
        if all(n == 1 for n in query_lens):
            wrapper = self.decode_wrapper if graph_batch_size is None else self._graph_wrapper(graph_batch_size)
            if graph_batch_size is not None:
                # The fixed-buffer wrapper copies host indices into its buffer with a blocking copy
                # (FlashInfer 0.6: non_blocking only from a device tensor), which waits for the step
                # async scheduling queued before this one; a queued copy from pinned memory does not.
                indices = indices.to(self.device, non_blocking=True)
            wrapper.plan(
                indptr, indices, last, self.num_q_heads, self.num_kv_heads, self.head_dim, self.page_size, **common
            )
            return FlashInferPlan(wrapper)
        assert graph_batch_size is None, "only decode steps are captured"
        qo_indptr = torch.tensor([0, *torch.tensor(list(query_lens)).cumsum(0).tolist()], dtype=torch.int32)
        self.prefill_wrapper.plan(
            qo_indptr,
            indptr,
            indices,
            last,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            causal=True,
            **common,
        )
        return FlashInferPlan(self.prefill_wrapper)

    def _triton_plan(
        self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor, graph_batch_size: int | None
    ) -> TritonDecodePlan:
        """The page lists to the device by queued copies. A captured step's lists live in the graph
        runner's staging buffer instead (``staged_decode_plan``, ``engine.cuda_graph``)."""
        if graph_batch_size is not None:
            raise ValueError("a captured Triton decode step takes its page lists from the graph's staging buffer "
                             "(staged_decode_plan), not from plan()")  # fmt: skip
        return self.staged_decode_plan(*(t.to(self.device, non_blocking=True) for t in (indptr, indices, last)))

    def staged_decode_plan(self, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> TritonDecodePlan:
        """The split-KV Triton decode over page lists its caller keeps on the device (a captured
        graph's static staging buffer, ``engine.cuda_graph``): no ``plan`` call per step."""
        return TritonDecodePlan(indptr, indices, last, self.head_dim**-0.5, self.prologue, self.pdl)

    def _graph_wrapper(self, batch_size: int) -> Any:
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is None:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(MAX_GRAPH_PAGES, dtype=torch.int32, device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device),
            )
            self._graph_wrappers[batch_size] = wrapper
        return wrapper

"""Paged attention through FlashInfer on CUDA, over the same KV layout as the torch reference.

The KV layout is chosen once for both backends: per layer ``[num_pages, 2, page_size, Hkv, D]``
(FlashInfer's ``NHD`` paged layout with K and V stacked). A step plans once on the host (page
indptr/indices/last-page lengths) and every attention layer then runs the same plan.

Pure-decode steps use the decode wrapper (tensor cores on: GQA 16:2 gives 8 query heads per KV
head); any step with a multi-token query uses the prefill wrapper with a causal mask, which also
covers chunked prefill over a cached history. For CUDA-graph capture a decode wrapper is built
per batch size with fixed index buffers (``use_cuda_graph=True``); ``plan`` then refills those
buffers in place before each replay.

FlashInfer's ``plan`` fills a pinned host buffer and queues its copy to the device; the next
``plan`` rewrites that buffer. The page indices of a captured graph's wrapper reach the device by a
queued copy of ours first (FlashInfer's own copy of host indices into the fixed buffer blocks the
host until the device has run every queued step: measured on an H200, the batch-1 host step waited
~2 ms in it and async scheduling hid nothing). When the engine queues step N+1 before step N has run (async
scheduling), a plan must not overwrite the buffer before step N's copy has been done: each plan
waits for the previous plan's copies (an event recorded after them; the device reaches them as
soon as it starts step N, so the wait is short) and records its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FlashInferAttention", "FlashInferPlan", "flashinfer_available"]

_WORKSPACE_BYTES = 256 * 1024 * 1024


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


def page_indices(
    page_ids: Sequence[Sequence[int]], seq_lens: Sequence[int], page_size: int, pin: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host-side ``(indptr [B+1], indices [nnz], last_page_len [B])`` int32 for FlashInfer.

    ``pin``: in pinned memory, so FlashInfer's non-blocking copies of them are queued, not staged
    through a copy that may wait for the device (``engine.host_copy`` says why that matters).
    """
    indptr, indices, last = [0], [], []
    for pages, n in zip(page_ids, seq_lens):
        used = -(-n // page_size)
        indices.extend(pages[:used])
        indptr.append(indptr[-1] + used)
        last.append(n - (used - 1) * page_size)
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, pin_memory=pin)  # noqa: E731
    return as_i32(indptr), as_i32(indices), as_i32(last)


class FlashInferAttention:
    def __init__(
        self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        import flashinfer

        self._fi = flashinfer
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.page_size, self.dtype, self.device = page_size, dtype, device
        self.workspace = torch.zeros(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=True)
        self._graph_wrappers: dict[int, Any] = {}
        self._staged: torch.cuda.Event | None = None  # recorded after the last plan's copies

    def plan(
        self,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        page_ids: Sequence[Sequence[int]],
        graph_batch_size: int | None = None,
    ) -> FlashInferPlan:
        """Plan one step. ``graph_batch_size`` selects the fixed-buffer wrapper of a captured graph."""
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
    ) -> FlashInferPlan:
        indptr, indices, last = page_indices(page_ids, seq_lens, self.page_size, pin=True)
        common = dict(q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.head_dim**-0.5)
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

    def _graph_wrapper(self, batch_size: int) -> Any:
        wrapper = self._graph_wrappers.get(batch_size)
        if wrapper is None:
            max_pages = 1 << 20
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=torch.zeros(batch_size + 1, dtype=torch.int32, device=self.device),
                paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=self.device),
                paged_kv_last_page_len_buffer=torch.zeros(batch_size, dtype=torch.int32, device=self.device),
            )
            self._graph_wrappers[batch_size] = wrapper
        return wrapper

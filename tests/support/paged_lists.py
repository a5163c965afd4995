"""Page lists of a decode batch for the paged-attention kernel tests: pages handed out in a given
(shuffled) order, as the torch reference's page table and as FlashInfer's indptr / indices /
last-page lengths."""

from __future__ import annotations

import torch


class PageLists:
    """Sequence ``i`` of ``seq_lens[i]`` tokens takes the next ``cdiv(seq_lens[i], page_size)`` page
    ids of ``order``. ``indices`` ends with three entries of ``pad_page`` (past ``nnz``: a kernel
    must never read them)."""

    def __init__(self, seq_lens: list[int], page_size: int, order: list[int], pad_page: int, device: torch.device):
        used = [-(-n // page_size) for n in seq_lens]
        self.ids: list[list[int]] = []
        self.page_table = torch.zeros(len(seq_lens), max(used), dtype=torch.int32)
        indices, indptr, self.last = [], [0], []
        for i, (n, count) in enumerate(zip(seq_lens, used)):
            ids, order = order[:count], order[count:]
            self.ids.append(ids)
            self.page_table[i, :count] = torch.tensor(ids, dtype=torch.int32)
            indices += ids
            indptr.append(len(indices))
            self.last.append(n - (count - 1) * page_size)
        indices += [pad_page] * 3
        as_i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        self.kv_indptr, self.kv_indices, self.kv_last_page_len = as_i32(indptr), as_i32(indices), as_i32(self.last)

"""The CUDA-graph runner's staging layout (``engine.cuda_graph._StagingLayout``): one buffer holds
the static inputs and the page lists, so a step's inputs reach the device in one copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from phloem.engine.cuda_graph import _StagingLayout
from phloem.kernels.attention.flashinfer import fill_page_lists, page_indices


@pytest.mark.parametrize(("n", "max_pages"), [(1, 64), (7, 1000), (256, 1 << 12), (5, 0)])
def test_parts_are_aligned_disjoint_and_shared_by_host_and_device_views(n: int, max_pages: int) -> None:
    layout = _StagingLayout(n, max_pages)
    host = np.zeros(layout.nbytes, dtype=np.uint8)
    dev = torch.zeros(layout.nbytes, dtype=torch.uint8)
    (rows, lens, lists), (d_rows, d_lens, d_lists) = layout.views(host), layout.views(dev)
    assert rows.shape == (5, n) and rows.dtype == np.int64 and lens.shape == (n,) and lens.dtype == np.int32
    rng = np.random.default_rng(n)
    rows[:] = rng.integers(-(2**40), 2**40, size=(5, n))
    lens[:] = rng.integers(0, 2**31 - 1, size=n)
    parts = [rows, lens]
    if max_pages:
        assert lists is not None and d_lists is not None
        indptr, last, indices = lists
        assert (len(indptr), len(last), len(indices)) == (n + 1, n, max_pages)
        for part in lists:
            part[:] = rng.integers(0, 2**31 - 1, size=len(part))
        parts += list(lists)
        offsets = [layout.lists_offset, layout.last_offset, layout.indices_offset]
        assert all(o % 16 == 0 for o in offsets), "each part 16-byte aligned (the kernels' vector loads)"
        assert layout.indices_end(max_pages) == layout.nbytes
    else:
        assert lists is None and d_lists is None and layout.nbytes == layout.lists_offset
    # No part overlaps another: every value written survives the others' writes.
    assert rows.tolist() == parts[0].tolist()
    dev.copy_(torch.from_numpy(host))
    device_parts = [d_rows, d_lens, *(d_lists or ())]
    for h, d in zip(parts, device_parts):
        assert d.tolist() == h.tolist()
    assert sum(p.nbytes for p in parts) <= layout.nbytes


def test_page_lists_written_in_place_match_page_indices() -> None:
    layout = _StagingLayout(4, 64)
    host = np.zeros(layout.nbytes, dtype=np.uint8)
    _rows, _lens, lists = layout.views(host)
    assert lists is not None
    indptr, last, indices = lists
    page_ids, seq_lens = [[5, 1], [2], [6, 0, 11], [9]], [17, 16, 40, 1]
    nnz = fill_page_lists(page_ids, seq_lens, 16, indptr, indices, last)
    want = page_indices(page_ids, seq_lens, 16)
    assert (indptr.tolist(), indices[:nnz].tolist(), last.tolist()) == tuple(t.tolist() for t in want)
    with pytest.raises(ValueError, match="do not fit"):
        fill_page_lists([list(range(80))], [80 * 16], 16, indptr, indices, last)

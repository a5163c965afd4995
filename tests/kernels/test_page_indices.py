"""The host-side page lists of the paged attention plans (``kernels.attention.flashinfer.page_indices``)."""

from __future__ import annotations

import pytest
import torch

from phloem.kernels.attention.flashinfer import page_indices


def _reference(page_ids: list[list[int]], seq_lens: list[int], page_size: int) -> tuple[list[int], list[int], list[int]]:
    indptr, indices, last = [0], [], []
    for pages, n in zip(page_ids, seq_lens):
        used = (n + page_size - 1) // page_size
        indices += pages[:used]
        indptr.append(len(indices))
        last.append(n - (used - 1) * page_size)
    return indptr, indices, last


@pytest.mark.parametrize(
    ("page_ids", "seq_lens"),
    [
        ([[7]], [1]),  # one token
        ([[3, 9, 4]], [48]),  # exactly three full pages
        ([[3, 9, 4, 8, 8]], [33]),  # pages reserved past the tokens are left out
        ([[5, 1], [2], [6, 0, 11]], [17, 16, 40]),  # several requests
        ([], []),  # nothing scheduled
    ],
    ids=["one-token", "full-pages", "reserved-pages", "batch", "empty"],
)
def test_matches_the_plain_lists(page_ids: list[list[int]], seq_lens: list[int]) -> None:
    indptr, indices, last = page_indices(page_ids, seq_lens, 16)
    assert all(t.dtype == torch.int32 for t in (indptr, indices, last))
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == _reference(page_ids, seq_lens, 16)


def test_a_request_short_of_pages_is_an_error() -> None:
    """Fewer pages than its tokens need: an error, not a page list that disagrees with indptr."""
    with pytest.raises(ValueError):
        page_indices([[1, 2]], [40], 16)

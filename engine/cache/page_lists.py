"""numpy mirrors of the requests' page-id lists, kept from one step to the next.

Every attention plan (a captured decode step's page lists, FlashInfer's plan) copies each
request's page ids into an int32 array, every step. From Python lists that is a conversion per
element (batch 16 at 57K tokens of context: 57K page ids a step; docs/decisions.md has the cost),
which a synchronous step adds to the device's and an async one must hide behind it. A mirror is
converted once and then only grows by the pages a request gained.

Invariant this relies on (``engine.cache.manager``): a request's ``page_ids`` list is only ever
changed in place by appending; any other change (admission, a published prefix swapping in the
tree's pages, release) assigns a new list. A mirror is therefore keyed by its list's identity
and holds a reference to the list, so the identity cannot be reused while the mirror lives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PageListMirror"]


class PageListMirror:
    """Arrays of the page ids of the lists it was last asked for (older mirrors are dropped)."""

    def __init__(self) -> None:
        # id(list) -> (the list, its ids as int32, how many of them are filled)
        self._mirrors: dict[int, tuple[list[int], np.ndarray, int]] = {}

    def arrays(self, page_lists: Sequence[list[int]]) -> list[np.ndarray]:
        """``np.int32`` views holding each list's ids (valid until the next call)."""
        kept: dict[int, tuple[list[int], np.ndarray, int]] = {}
        out = []
        for pages in page_lists:
            key = id(pages)
            entry = kept.get(key) or self._mirrors.get(key)
            if entry is None or entry[0] is not pages or entry[2] > len(pages):
                entry = (pages, np.array(pages, dtype=np.int32), len(pages))
            elif entry[2] < len(pages):
                entry = _grow(entry)
            kept[key] = entry
            out.append(entry[1][: entry[2]])
        self._mirrors = kept
        return out


def _grow(entry: tuple[list[int], np.ndarray, int]) -> tuple[list[int], np.ndarray, int]:
    """Append the ids the list gained since (doubling the array when it is full)."""
    pages, array, filled = entry
    if len(pages) > len(array):
        bigger = np.empty(max(len(pages), 2 * len(array)), dtype=np.int32)
        bigger[:filled] = array[:filled]
        array = bigger
    array[filled : len(pages)] = pages[filled:]
    return pages, array, len(pages)

"""``PageListMirror``: arrays that follow the requests' page-id lists as they grow or are replaced."""

from __future__ import annotations

import numpy as np

from phloem.engine.cache.page_lists import PageListMirror


def test_mirrors_follow_appends_replacements_and_drop_what_is_not_asked_for() -> None:
    mirror = PageListMirror()
    a, b = [3, 1, 4], [1, 5]
    first = mirror.arrays([a, b])
    assert [x.tolist() for x in first] == [a, b] and all(x.dtype == np.int32 for x in first)
    a.extend(range(100, 200))  # grows in place, past the array's capacity
    b.append(9)
    assert [x.tolist() for x in mirror.arrays([a, b])] == [a, b]
    a.append(7)
    assert mirror.arrays([a])[0].tolist() == a
    a = [8] + a[1:]  # a prefix swap is a new list (``CacheManager._publish``)
    assert mirror.arrays([a, b])[0].tolist() == a
    assert mirror.arrays([b])[0].tolist() == b


def test_a_request_served_through_the_engine_keeps_its_mirror_in_step() -> None:
    """The engine's own lists, through prefills, decode, a prompt-end checkpoint (which swaps in
    the tree's pages) and a finish, match their mirrors at every step."""
    from toy_model import expected, make_engine

    from phloem.engine import SamplingParams

    engine = make_engine(interval=8)
    mirror = engine.runner.page_mirror
    prompts = [list(range(1, 30)), list(range(5, 12))]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out.token_ids
        running = [r.page_ids for r in engine.scheduler.running]
        assert [x.tolist() for x in mirror.arrays(running)] == running
    assert sorted(map(tuple, outs.values())) == sorted(tuple(expected(p, 12)) for p in prompts)

"""The prefix cache partitioned by namespace (tenant), on the toy model: exact hit counts.

A request of namespace ``T`` hits only prefixes ``T`` inserted and shared ones (namespace None);
the same tokens inserted by two tenants live on separate nodes and pages; a tenant's own hits
are exactly those of an unpartitioned cache (docs/architecture.md, "Invariants": tenants).
"""

from __future__ import annotations

from toy_model import assert_pools_empty, expected, make_engine

from phloem.engine import Engine, SamplingParams


def _prefill(engine: Engine, prompt: list[int], namespace: str | None) -> None:
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1), prefill_only=True, namespace=namespace)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.cached_prefix_len(prompt + [0], namespace) == len(prompt), rid


def test_a_tenant_never_hits_another_tenants_prefix() -> None:
    engine = make_engine(budget=64)
    secret = list(range(30, 70))
    a = engine.generate([secret], SamplingParams(max_tokens=3), namespace="a")[0]
    conv = secret + a.token_ids
    assert engine.cached_prefix_len(conv + [1], "b") == 0 and engine.cached_prefix_len(conv + [1]) == 0
    probe = engine.generate([conv + [1]], SamplingParams(max_tokens=2), namespace="b")[0]
    assert probe.num_cached_tokens == 0 and probe.token_ids == expected(conv + [1], 2)
    # B's own copy now has a prompt-end checkpoint one token before its end (issue 48), at
    # len(conv): B's resend hits it, the shared namespace still sees nothing.
    assert engine.cached_prefix_len(conv + [1], "b") == len(conv) and engine.cached_prefix_len(conv + [1]) == 0
    # A's next turn still hits its whole conversation, as without a partition.
    own = engine.generate([conv + [2]], SamplingParams(max_tokens=2), namespace="a")[0]
    assert own.num_cached_tokens == len(conv) and own.token_ids == expected(conv + [2], 2)
    # B's copy of the same tokens is B's: separate nodes and pages.
    tree = engine.cache.tree
    mine = tree.match(conv + [0], 100, "a")
    theirs = tree.match(conv + [1] + probe.token_ids + [0], 100, "b")
    assert mine.node.namespace == "a" and theirs.node.namespace == "b"
    assert not set(mine.pages) & set(theirs.pages)
    assert_pools_empty(engine)


def test_a_shared_prefix_is_hit_by_every_tenant_and_leaks_nothing_below_it() -> None:
    engine = make_engine(budget=64)
    system = list(range(1, 23))  # 22 tokens: a mid-page checkpoint
    _prefill(engine, system, None)
    a_turn = system + [50, 51, 52, 53, 54, 55]
    a = engine.generate([a_turn], SamplingParams(max_tokens=3), namespace="a")[0]
    assert a.num_cached_tokens == len(system) and a.token_ids == expected(a_turn, 3)
    # B hits the shared prompt, and no further into A's turn below it.
    b = engine.generate([a_turn + a.token_ids + [9]], SamplingParams(max_tokens=2), namespace="b")[0]
    assert b.num_cached_tokens == len(system) and b.token_ids == expected(a_turn + a.token_ids + [9], 2)
    again = engine.generate([a_turn + a.token_ids + [9]], SamplingParams(max_tokens=2), namespace="a")[0]
    assert again.num_cached_tokens == len(a_turn) + len(a.token_ids)
    # The shared prompt's node stays shared though both tenants' turns split off below it.
    assert engine.cache.tree.match(system + [0], 100, "b").node.namespace is None
    assert_pools_empty(engine)


def test_a_tenant_checkpoint_inside_shared_text_is_its_own() -> None:
    """A tenant's turn that ends inside the shared prompt checkpoints a shared node: the
    checkpoint is the tenant's, invisible to others and to the shared namespace."""
    engine = make_engine(budget=64)
    system = list(range(1, 31))
    _prefill(engine, system, None)
    _prefill(engine, system[:13], "a")
    assert engine.cached_prefix_len(system[:13] + [0], "a") == 13
    assert engine.cached_prefix_len(system[:13] + [0], "b") == 0
    assert engine.cached_prefix_len(system[:13] + [0]) == 0
    assert engine.cached_prefix_len(system + [0], "b") == len(system)
    assert_pools_empty(engine)


def test_periodic_checkpoints_are_namespaced() -> None:
    engine = make_engine(budget=64, interval=8)
    shared = list(range(10, 30))
    a = engine.generate([shared + [1, 2, 3]], SamplingParams(max_tokens=2), namespace="a")[0]
    assert a.token_ids == expected(shared + [1, 2, 3], 2)
    b = engine.generate([shared + [7]], SamplingParams(max_tokens=4), namespace="b")[0]
    assert b.num_cached_tokens == 0 and b.token_ids == expected(shared + [7], 4)
    a2 = engine.generate([shared + [7]], SamplingParams(max_tokens=4), namespace="a")[0]
    assert a2.num_cached_tokens == 16 and a2.token_ids == b.token_ids
    assert_pools_empty(engine)


def test_pins_and_exports_are_namespaced() -> None:
    engine = make_engine(num_pages=32, num_slots=6, budget=64)
    conv = [7] * 9
    conv += engine.generate([conv], SamplingParams(max_tokens=2), namespace="a")[0].token_ids
    assert engine.pin_prefix(conv, "b") is None and engine.export_prefix(conv, "b") is None
    handle = engine.pin_prefix(conv, "a")
    state = engine.export_prefix(conv, "a")
    assert handle is not None and state is not None and state.num_tokens == len(conv)
    engine.unpin_prefix(handle)
    engine.cache.tree.clear()
    assert engine.import_prefix(state, "b")
    assert engine.cached_prefix_len(conv + [1], "a") == 0 and engine.cached_prefix_len(conv + [1], "b") == len(conv)
    out = engine.generate([conv + [1]], SamplingParams(max_tokens=3), namespace="b")[0]
    assert out.num_cached_tokens == len(conv) and out.token_ids == expected(conv + [1], 3)
    assert_pools_empty(engine)


def test_eviction_frees_every_tenants_pages() -> None:
    # 24 pages of 4 tokens, 6 slots: three tenants' conversations cannot all stay cached.
    engine = make_engine(num_pages=24, num_slots=6, budget=64)
    _prefill(engine, [3] * 8, None)
    for i in range(9):
        prompt = [3] * 8 + [i + 10] * 5
        out = engine.generate([prompt], SamplingParams(max_tokens=3), namespace=f"t{i % 3}")[0]
        assert out.token_ids == expected(prompt, 3)
    assert engine.cache_stats().checkpoints_evicted > 0
    assert_pools_empty(engine)

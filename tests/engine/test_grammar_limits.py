"""Grammar size and complexity limits (refused before compiling, one line naming the limit), the
byte-bounded compiled-grammar cache with per-owner quotas, and the backend that joins them."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from phloem.engine import GrammarConfig, GrammarSpec, InvalidRequest
from phloem.engine.sampling.grammar import GrammarBackend
from phloem.engine.sampling.grammar_cache import GrammarCache
from phloem.engine.sampling.grammar_limits import check_grammar, pattern_repeat
from phloem.runtime.default_model import ensure_default_model

LIMITS = GrammarConfig()


def schema(prop: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"a": prop}, "required": ["a"]}))


def refused(spec: GrammarSpec, limits: GrammarConfig = LIMITS) -> str:
    with pytest.raises(InvalidRequest) as info:
        check_grammar(spec, limits)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_100000_value_enum_is_refused_at_once() -> None:
    spec = schema({"enum": [f"value-{i}" for i in range(100_000)]})
    start = time.perf_counter()
    message = refused(spec)
    assert time.perf_counter() - start < 0.1, "checked from the text's size, before parsing"
    assert message == f"grammar: the schema is {len(spec.source)} bytes of JSON; the limit is 131072"
    roomy = GrammarConfig(max_schema_bytes=10**7)
    assert refused(spec, roomy) == "grammar: an enum has 100000 values; the limit is 4096"


def test_enum_and_const_values_count_together() -> None:
    assert check_grammar(schema({"enum": [f"v{i}" for i in range(4096)]}), LIMITS)
    text = "x" * 20_000
    spec = GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"a": {"const": text}, "b": {"enum": [text]}}}))
    assert refused(spec).startswith("grammar: the schema's enum and const values are over 40004 bytes")
    assert refused(spec).endswith("the limit is 32768")


def test_nesting_is_limited() -> None:
    inner: dict = {"type": "string"}
    for _ in range(40):
        inner = {"type": "object", "properties": {"x": inner}}
    assert refused(GrammarSpec("json_schema", json.dumps(inner))) == "grammar: the schema nests 65 deep; the limit is 64"
    inner = {"type": "string"}
    for _ in range(30):
        inner = {"type": "object", "properties": {"x": inner}}
    check_grammar(GrammarSpec("json_schema", json.dumps(inner)), LIMITS)


def test_patterns_are_limited_by_length_and_unrolled_repetition() -> None:
    uuid = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
    check_grammar(schema({"type": "string", "pattern": uuid}), LIMITS)
    check_grammar(schema({"type": "string", "pattern": "a{1000}"}), LIMITS)
    assert refused(schema({"type": "string", "pattern": "a{1001}"})) == (
        "grammar: a pattern's repetition counts unroll to 1001; the limit is 1000")
    assert refused(schema({"type": "string", "pattern": "(a{10}){200}"})).endswith("unroll to 2000; the limit is 1000")
    assert refused(schema({"type": "string", "pattern": "a" * 4097})) == (
        "grammar: a pattern is 4097 characters; the limit is 4096")


@pytest.mark.parametrize(("pattern", "repeat"), [
    ("abc", 0), ("a{1000}", 1000), ("(a{10}){100}", 1000), ("(a{5})b", 5), (r"\d{4}-\d{2}-\d{2}", 8),
    ("((a{10}){10}){10}", 1000), ("a{2,}", 2), ("a{2,7}", 7), ("[{]{3}", 3), (r"\{5}", 0), ("(ab)+", 0),
    ("x{,5}", 0), ("(a{3}", 3),
])
def test_pattern_repeat(pattern: str, repeat: int) -> None:
    assert pattern_repeat(pattern) == repeat


def test_large_counts_that_do_not_unroll_are_allowed() -> None:
    # Measured: maxLength / minItems / maxItems of 100,000 compile in milliseconds.
    check_grammar(schema({"type": "string", "maxLength": 100_000, "minLength": 50_000}), LIMITS)
    check_grammar(schema({"type": "array", "items": {"type": "integer"}, "maxItems": 100_000}), LIMITS)


def test_structural_tags_are_checked_through_their_tool_schemas() -> None:
    def tag(params: dict) -> GrammarSpec:
        return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": {
            "type": "tag", "begin": "<tool_call>", "end": "</tool_call>",
            "content": {"type": "json_schema", "json_schema": params}}}))

    check_grammar(tag({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}}), LIMITS)
    big = tag({"type": "object", "properties": {"a": {"enum": list(range(5000))}}})
    assert refused(big) == "grammar: an enum has 5000 values; the limit is 4096"
    regex = GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "regex", "pattern": "b{5000}"}}))
    assert refused(regex) == "grammar: a pattern's repetition counts unroll to 5000; the limit is 1000"
    huge = tag({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}})
    assert refused(huge).startswith("grammar: the structural tag is ")


def test_the_largest_allowed_enum_compiles_in_well_under_a_second(tmp_path: Path) -> None:
    backend = GrammarBackend(ensure_default_model(tmp_path), 1920, (2,))
    backend.compile(schema({"type": "integer"}))  # loads the tokenizer
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(6)) for _ in range(4000)]
    spec = schema({"enum": words})
    check_grammar(spec, LIMITS)
    start = time.perf_counter()
    backend.compile(spec, owner="a")
    assert time.perf_counter() - start < 1.5  # measured 0.2 s alone; shared CPUs in CI
    stats = backend.stats()
    assert stats.cache_entries == 2 and stats.compiles == 2 and stats.cache_bytes > 0
    with pytest.raises(InvalidRequest, match="limit is 4096"):
        backend.compile(schema({"enum": list(range(5000))}))
    assert backend.stats().rejections == 1 and backend.stats().compiles == 2


def test_the_cache_evicts_an_owners_own_grammars_first_then_the_least_recent() -> None:
    cache: GrammarCache[str, str] = GrammarCache(capacity_bytes=100, bytes_per_owner=60)
    assert cache.put("a1", "A1", 30, "a") and cache.put("a2", "A2", 30, "a")
    assert cache.put("a3", "A3", 20, "a")  # a's quota: its least recent goes, nobody else's
    assert list(cache._entries) == ["a2", "a3"] and cache.owner_bytes("a") == 50
    assert cache.put("b1", "B1", 40, "b")
    assert cache.put("b2", "B2", 30, "b")  # b's quota: b1 goes
    assert list(cache._entries) == ["a2", "a3", "b2"] and cache.bytes == 80
    assert cache.get("a2") == "A2"  # any owner may hit it; now the most recent
    assert cache.put("c1", "C1", 50, "c")  # the whole cache: the least recent (a3, then b2) go
    assert list(cache._entries) == ["a2", "c1"]
    assert (cache.bytes, cache.owner_bytes("a"), cache.owner_bytes("b"), cache.owner_bytes("c")) == (80, 30, 0, 50)
    assert cache.evictions == 4
    assert not cache.put("big", "BIG", 61, "d") and "big" not in cache and cache.evictions == 4
    assert cache.put("c1", "C1'", 10, "d")  # replaced: the charge moves
    assert (cache.owner_bytes("c"), cache.owner_bytes("d"), cache.bytes, len(cache)) == (0, 10, 40, 2)


def test_one_owner_cannot_fill_the_cache(tmp_path: Path) -> None:
    backend = GrammarBackend(ensure_default_model(tmp_path), 1920, (2,),
                             GrammarConfig(cache_bytes=4 * 1024 * 1024, cache_bytes_per_owner=1024 * 1024))
    b_spec = schema({"type": "integer", "minimum": 7})
    backend.compile(b_spec, owner="b")
    for i in range(40):
        backend.compile(schema({"enum": [f"value-{i}-{j}" for j in range(50)]}), owner="a")
    stats = backend.stats()
    assert backend._compiled.owner_bytes("a") <= 1024 * 1024 and stats.cache_evictions > 0
    assert b_spec in backend._compiled, "b's grammar stays: a's compiles evict a's own"
    assert stats.cache_bytes == backend._compiled.owner_bytes("a") + backend._compiled.owner_bytes("b")

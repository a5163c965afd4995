"""Helpers of the tensor-parallel engine tests: a TP engine next to a TP=1 engine that gets the
same calls, and the checks that their answers, cache hits and exported states agree."""

from __future__ import annotations

import multiprocessing

import torch

from phloem.engine import Engine, SamplingParams
from phloem.engine.transfer.prefix_export import PrefixState

__all__ = ["assert_same_state", "assert_stopped", "both", "clear", "spill_and_resume", "tokens"]


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 256 for i in range(n)]


def assert_stopped(engine: Engine) -> None:
    """Every worker process of ``engine`` (closed) exited cleanly and was joined."""
    assert engine.workers is not None
    for proc in engine.workers.processes:
        assert not proc.is_alive() and proc.exitcode == 0, f"{proc.name} exit code {proc.exitcode}"
        assert proc not in multiprocessing.active_children()


def both(
    pair: tuple[Engine, Engine], prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> list[list[int]]:
    """Run ``prompts`` on both engines; assert equal tokens and cache hits; return the tokens."""
    ref, tp = (engine.generate(prompts, params) for engine in pair)
    assert [o.token_ids for o in tp] == [o.token_ids for o in ref]
    assert [o.num_cached_tokens for o in tp] == [o.num_cached_tokens for o in ref]
    return [o.token_ids for o in ref]


def assert_same_state(a: PrefixState | None, b: PrefixState | None) -> None:
    """Two exports of one prefix hold the same tokens and (to fp32 sum-order noise) the same state."""
    assert a is not None and b is not None and a.token_ids == b.token_ids
    assert a.kv.shape == b.kv.shape

    def written(kv: torch.Tensor) -> torch.Tensor:  # the tail page past the checkpoint is not state
        layers, pages, _, ps, heads, dim = kv.shape
        return kv.transpose(1, 2).reshape(layers, 2, pages * ps, heads, dim)[:, :, : a.num_tokens]

    for x, y in ((written(a.kv), written(b.kv)), (a.conv, b.conv), (a.ssm, b.ssm)):
        assert x.shape == y.shape and x.dtype == y.dtype
        # Not bit-exact: tensor parallelism sums the row-parallel partials in another order.
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def clear(pair: tuple[Engine, Engine]) -> None:
    """Empty both engines' prefix caches; every page must come back."""
    for engine in pair:
        engine.cache.tree.clear()  # type: ignore[union-attr]
        assert engine.page_pool.num_free_pages == engine.page_pool.num_pages


def spill_and_resume(pair: tuple[Engine, Engine], max_tokens: int) -> tuple[list[int], PrefixState]:
    """Export one conversation from both engines (the TP one's export must equal the TP=1 one's:
    the TP=1 layout), then resume each engine from the *other's* export: both must give a fresh
    recompute's ``max_tokens`` tokens with the whole conversation cached. Returns the
    conversation and the TP=1 export; both caches are left empty."""
    prompt = tokens(29, 60)
    conv = prompt + both(pair, [prompt], SamplingParams(max_tokens=6))[0]
    nxt = conv + tokens(4, 61)
    one, many = (engine.export_prefix(conv) for engine in pair)
    assert one is not None and one.num_tokens == len(conv)
    assert_same_state(many, one)
    clear(pair)
    fresh = both(pair, [nxt], SamplingParams(max_tokens=max_tokens))
    clear(pair)
    assert pair[0].import_prefix(many) and pair[1].import_prefix(one)  # type: ignore[arg-type]
    outs = [engine.generate([nxt], SamplingParams(max_tokens=max_tokens))[0] for engine in pair]
    assert [o.token_ids for o in outs] == fresh * 2
    assert [o.num_cached_tokens for o in outs] == [len(conv)] * 2
    clear(pair)
    return conv, one

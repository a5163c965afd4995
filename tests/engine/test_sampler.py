"""Sampling properties: seeds, greedy, top-k / top-p filtering."""

from __future__ import annotations

import torch

from phloem.engine.sampling.params import SamplingParams
from phloem.engine.sampling.sampler import sample


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def logits(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(rows, vocab)


def test_same_seed_same_tokens_and_batch_independence() -> None:
    lg = logits()
    p = SamplingParams(max_tokens=1, temperature=1.0)
    a = sample(lg, [p] * 4, [gen(s) for s in (1, 2, 3, 4)])
    b = sample(lg, [p] * 4, [gen(s) for s in (1, 2, 3, 4)])
    assert torch.equal(a, b)
    # Row 2 alone with the same seed draws the same token as inside the batch.
    alone = sample(lg[2:3], [p], [gen(3)])
    assert alone.item() == a[2].item()


def test_different_seeds_differ_somewhere() -> None:
    lg = logits(rows=1, vocab=1000).repeat(1, 1) * 0.01  # near-uniform: draws vary with the seed
    p = SamplingParams(max_tokens=1, temperature=1.0)
    draws = {sample(lg, [p], [gen(s)]).item() for s in range(20)}
    assert len(draws) > 5


def test_temperature_zero_ignores_seed() -> None:
    lg = logits()
    p = [SamplingParams(max_tokens=1, temperature=0.0, seed=s) for s in range(4)]
    assert torch.equal(sample(lg, p, [gen(s) for s in range(4)]), lg.argmax(-1))


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    lg = logits()
    k1 = [SamplingParams(max_tokens=1, temperature=1.5, top_k=1)] * 4
    p0 = [SamplingParams(max_tokens=1, temperature=1.5, top_p=1e-6)] * 4
    assert torch.equal(sample(lg, k1, [gen(s) for s in range(4)]), lg.argmax(-1))
    assert torch.equal(sample(lg, p0, [gen(s) for s in range(4)]), lg.argmax(-1))


def test_top_k_keeps_only_the_k_best() -> None:
    lg = logits(rows=1, vocab=100)
    best3 = set(lg[0].topk(3).indices.tolist())
    p = SamplingParams(max_tokens=1, temperature=5.0, top_k=3)
    draws = {sample(lg, [p], [gen(s)]).item() for s in range(200)}
    assert draws <= best3 and len(draws) == 3


def test_top_p_keeps_the_nucleus() -> None:
    lg = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7)
    draws = {sample(lg, [p], [gen(s)]).item() for s in range(200)}
    assert draws == {0, 1}


def test_greedy_rows_take_the_argmax_in_the_logits_dtype() -> None:
    """bf16 logits (with exact ties, as bf16 makes many) pick what their fp32 upcast picks: the
    sampler skips the fp32 copy for greedy rows; random rows still sample in fp32."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 500, generator=gen) * 3).to(torch.bfloat16)
    logits[2, 17] = logits[2, 300] = logits[2].max() + 1  # a tie: the first index wins
    greedy = [SamplingParams(max_tokens=1)] * 6
    tokens = sample(logits, greedy, [None] * 6)
    assert tokens.tolist() == logits.float().argmax(-1).tolist() and tokens[2] == 17
    mixed = [SamplingParams(max_tokens=1, temperature=0.7, seed=1) if i % 2 else greedy[0] for i in range(6)]
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    gens32 = [torch.Generator().manual_seed(i) for i in range(6)]
    assert sample(logits, mixed, gens).tolist() == sample(logits.float(), mixed, gens32).tolist()


def test_greedy_ids_given_are_used_and_never_written() -> None:
    """A CUDA graph hands the sampler every row's greedy id (its static output buffer): a greedy
    step returns those ids; a step with random rows samples them into a copy, the buffer intact,
    and its greedy rows keep the given ids."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(4, 300, generator=gen)
    given = values.argmax(-1)
    buffer = given.clone()
    greedy = [SamplingParams(max_tokens=1)] * 4
    assert sample(values, greedy, [None] * 4, buffer) is buffer
    mixed = [SamplingParams(max_tokens=1, temperature=0.9, seed=1) if i in (1, 2) else greedy[0] for i in range(4)]
    want = sample(values, mixed, [torch.Generator().manual_seed(i) for i in range(4)])
    got = sample(values, mixed, [torch.Generator().manual_seed(i) for i in range(4)], buffer)
    assert got.tolist() == want.tolist() and got is not buffer
    assert buffer.tolist() == given.tolist()

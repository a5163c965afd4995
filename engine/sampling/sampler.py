"""Next-token selection: greedy, temperature, top-k, top-p, per-request seeds.

Random draws use the exponential-race form of categorical sampling
(``argmax(p / q)`` with ``q ~ Exp(1)``), drawn from the request's own ``torch.Generator`` when it
has a seed: the draw then depends only on that request's logits and seed, not on what else is in
the batch, so the same seed gives the same output whether a request runs alone or batched.
Greedy rows never touch a generator (temperature 0 ignores the seed). A step whose requests
change their logits (grammar, penalties, bias, ``min_tokens``: ``engine.sampling.logits_processors``)
samples from the processed fp32 copy; every other step samples the logits as they come.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from phloem.engine.host_copy import to_device
from phloem.engine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from phloem.engine.sampling.logits_processors import StepProcessing

__all__ = ["filtered_probs", "sample", "skip_draws"]


def sample(
    logits: torch.Tensor,  # [S, V], the model's dtype or fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    greedy: torch.Tensor | None = None,
    processing: StepProcessing | None = None,
) -> torch.Tensor:
    """Pick one token per row; returns ``[S]`` int64 on the logits' device.

    Greedy rows take the argmax of the logits as they come (bf16's argmax is its fp32 upcast's,
    first index on ties in both, so no fp32 copy of a ``[S, V]`` tensor is made for them), or
    ``greedy`` where the caller has it (a CUDA graph computes every row's argmax inside the graph;
    then a greedy step launches nothing here, and ``greedy`` itself is returned); random rows are
    sampled in fp32. With ``processing`` every row samples from ``processing.apply(logits)``
    (``greedy`` is then ignored: it is the argmax of the unprocessed logits).
    """
    if processing is not None:
        logits, greedy = processing.apply(logits), None
    assert logits.shape[0] == len(params) == len(generators), "one SamplingParams and generator per row"
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if greedy is not None:
        # Never written in place: it is the graph's output buffer, which the next replay rewrites.
        tokens = greedy.clone() if rows else greedy
    else:
        tokens = logits.argmax(dim=-1)
    if not rows:
        return tokens
    idx = to_device(torch.tensor(rows), logits.device)
    probs = filtered_probs(logits[idx].float(), [params[i] for i in rows])
    for j, i in enumerate(rows):
        q = torch.empty_like(probs[j]).exponential_(generator=generators[i])
        tokens[i] = (probs[j] / q).argmax()
    return tokens


def skip_draws(generator: torch.Generator, vocab_size: int, num_tokens: int, device: torch.device) -> None:
    """Advance ``generator`` past the draws of ``num_tokens`` random samples (one ``[V]`` fp32
    exponential each, as ``sample`` takes): a request continued after tokens sampled elsewhere
    then draws exactly what it would have drawn had it sampled them itself."""
    for _ in range(num_tokens):
        torch.empty(vocab_size, dtype=torch.float32, device=device).exponential_(generator=generator)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of temperature-scaled logits ``[S, V]`` (fp32) with top-k and top-p applied per row:
    the distribution a random row is drawn from (each row independent of the others)."""
    temps = to_device(torch.tensor([p.temperature for p in params], dtype=logits.dtype), logits.device)
    logits = logits / temps[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    top_k = to_device(torch.tensor([p.top_k or logits.shape[-1] for p in params]), logits.device)
    drop = ranks[None, :] >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    top_p = to_device(torch.tensor([p.top_p for p in params], dtype=logits.dtype), logits.device)
    # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)

"""Which draft tokens a speculative step keeps, and the token it adds: the three acceptance rules.

A speculative step (``engine.speculative``) drafts ``d1..dk`` for a request and the target scores
``[last, d1..dk]``. Row ``j`` of the target's distributions ``p[j]`` is its next-token
distribution after ``d1..dj``; row ``j`` of the draft's ``q[j]`` is the one ``d(j+1)`` was drawn
from. Both are the distributions the plain sampler would draw from (grammar mask, temperature,
top-k, top-p applied: ``engine.sampling.draft_sampler``). Every rule returns, per request, ``n``
(drafts accepted, ``0..k``) and the one token emitted after them; the step emits
``d1..dn, token``::

    greedy    t[j] = argmax of the logits; accept while d(j+1) == t[j]; token = t[n].
              The plain greedy tokens, exactly.
    standard  accept d(j+1) with probability min(1, p[j][d] / q[j][d]); at the first rejection n
              token ~ normalize(max(0, p[n] - q[n])); all k accepted: token ~ p[k].
              (Leviathan et al. 2023, Chen et al. 2023.) Each emitted token is distributed as p
              of its prefix, so the output's distribution is the plain sampler's; its acceptance
              rate, sum(min(p, q)) per position, is the highest any rule achieves.
    coupled   the plain sampler's own draw: t[j] = argmax(p[j] / E[j]), E[j] ~ Exp(1)^V the
              exponential draw the plain sampler takes for that token (the request's seeded
              generator), the draft drawn with the same noise, d(j+1) = argmax(q[j] / E[j]);
              accept while d(j+1) == t[j]; token = t[n]. The tokens are the plain sampler's for
              the same seed, exactly; acceptance is lower than the standard rule's
              (P[argmax(p/E) = argmax(q/E)] >= (1 - TV) / (1 + TV), TV = 1 - sum(min(p, q))).

The standard rule's draft may come from any ``q`` it was really drawn from: a draft that is not a
model's sample (a placeholder) is drawn from the point mass on itself (``q[j] = one-hot``), and
the rule stays exact. All inputs are batched (``B`` requests) and the randomness is passed in, so
the rules are pure functions of their tensors.
"""

from __future__ import annotations

import torch

__all__ = ["accept_coupled", "accept_greedy", "accept_standard", "num_accepted", "race"]


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A categorical draw ``argmax(probs / noise)`` with ``noise ~ Exp(1)`` (the plain sampler's
    exponential race; ``probs`` need not be normalized); ``[..., V] -> [...]`` int64."""
    return (probs / noise).argmax(dim=-1)


def num_accepted(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[B]``: the length of the prefix of ``drafts`` ``[B, k]`` equal to ``target[:, :k]``."""
    k = drafts.shape[1]
    return (drafts == target[:, :k]).long().cumprod(dim=1).sum(dim=1)


def _pick(target: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return target.gather(1, n[:, None]).squeeze(1)


def accept_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rule: ``logits`` ``[B, k+1, V]`` (grammar-masked), ``drafts`` ``[B, k]`` ->
    ``(n [B], token [B])``."""
    target = logits.argmax(dim=-1)
    n = num_accepted(drafts, target)
    return n, _pick(target, n)


def accept_coupled(
    p: torch.Tensor, drafts: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coupled rule: ``p`` ``[B, k+1, V]``, ``drafts`` ``[B, k]`` (each ``argmax(q[j] / noise[j])``),
    ``noise`` ``[B, k+1, V]`` the plain sampler's draws for these positions -> ``(n, token)``."""
    target = race(p, noise)
    n = num_accepted(drafts, target)
    return n, _pick(target, n)


def accept_standard(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, uniform: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard rule: ``p`` ``[B, k+1, V]``, ``q`` ``[B, k, V]``, ``drafts`` ``[B, k]`` drawn from
    ``q``, ``uniform`` ``[B, k]`` ~ U[0, 1) (one per draft), ``noise`` ``[B, V]`` ~ Exp(1) (the
    emitted token's draw) -> ``(n [B], token [B])``."""
    b, k = drafts.shape
    p_d = p[:, :k].gather(2, drafts[..., None]).squeeze(2)
    q_d = q.gather(2, drafts[..., None]).squeeze(2)
    # u < p/q, without dividing (q(d) > 0: d was drawn from q).
    n = (uniform * q_d < p_d).long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(b, device=p.device)
    p_n = p[rows, n]
    # q of the bonus position is 0: the residual there is p[k] itself.
    q_n = torch.cat((q, torch.zeros_like(q[:, :1])), dim=1)[rows, n]
    residual = (p_n - q_n).clamp_min(0)
    # An empty residual means p == q up to rounding, where a rejection has probability 0.
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_n)
    return n, race(residual, noise)

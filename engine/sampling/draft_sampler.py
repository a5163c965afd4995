"""One speculative step's sampling: drafts under each request's own rule, grammar masks, acceptance.

``engine.speculative`` drafts ``k`` tokens per request with the MTP layer and verifies them in one
target forward; this module decides every token of that step as the plain sampler would
(``engine.sampling.draft_acceptance`` has the rules):

* **greedy** requests (temperature 0) draft the argmax and accept exact matches;
* **seeded** sampled requests use the *coupled* rule: the step draws, from the request's own
  generator, the ``k + 1`` exponential vectors the plain sampler would draw for the next ``k + 1``
  tokens (one ``[V]`` fp32 draw each, as ``sample`` and ``skip_draws`` take), drafts and verifies
  with them, and then rewinds the generator to just after the draws of the tokens it emitted. A
  seeded request's tokens are then exactly its plain tokens, whatever the batch, whether a step
  speculated or not, and a request continued elsewhere (``skip_draws``) stays in step;
* **unseeded** sampled requests use the *standard* rule: the draft ``d ~ q``, ``u ~ U[0, 1)``
  per draft, and one exponential vector for the emitted token, all from the engine's default
  generator (which promises no stream: the plain sampler shares it across requests).

**Grammar.** A request with a grammar drafts under its matcher: before draft ``j + 1`` the
bitmask of the matcher's state after ``d1..dj`` is filled into row ``j`` and masks the draft's
logits; the draft is then fed to the matcher. After the ``k`` drafts row ``k`` is filled and the
matcher rolls back the drafts it accepted, so it leaves in the state it came in (the engine feeds
it the emitted tokens, ``Request.append_output``). The verify masks target row ``j`` with the same
row ``j``: the state after the accepted prefix it conditions on. That is ``k + 1`` masks for
``k + 1`` verified positions. Rows past a draft the matcher refused (a placeholder draft) or past
one that completed the grammar are left unmasked: no emitted token is ever read from them (a
refused draft never matches a masked target, and a completing one ends the request).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from phloem.engine.host_copy import to_device
from phloem.engine.request import Request
from phloem.engine.sampling.draft_acceptance import accept_coupled, accept_greedy, accept_standard, race
from phloem.engine.sampling.grammar import bitmask_width, unpack_bitmask
from phloem.engine.sampling.sampler import filtered_probs

__all__ = ["DraftSampler"]

# Per request: drafts accepted [B], the token emitted after them [B].
Decision = tuple[torch.Tensor, torch.Tensor]


class DraftSampler:
    """Sampling state of one speculative step over ``reqs`` drafting ``k`` tokens each.

    Call ``draft(j, ...)`` for ``j = 0..k-1`` (the drafts in order), then ``finish_drafts()``, then
    ``accept(logits)`` with the verify's logits.
    """

    def __init__(
        self, reqs: Sequence[Request], k: int, vocab_size: int, default_generator: torch.Generator,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.reqs = tuple(reqs)
        self.k = k
        self.vocab_size = vocab_size
        self.device = device
        self.default_generator = default_generator
        b = len(self.reqs)
        self.drafts = [[0] * k for _ in range(b)]
        self.greedy = [i for i, r in enumerate(reqs) if r.params.is_greedy]
        self.coupled = [i for i, r in enumerate(reqs) if not r.params.is_greedy and r.generator is not None]
        self.standard = [i for i, r in enumerate(reqs) if not r.params.is_greedy and r.generator is None]
        # Draft distributions of the standard rows [B, k, V] (other rows stay 0).
        self.q = torch.zeros((b, k, vocab_size), device=device) if self.standard else None
        # The coupled rows' noise [B, k + 1, V] and each generator's state after each draw.
        self.noise: torch.Tensor | None = None
        self.states: dict[int, list[torch.Tensor]] = {}
        if self.coupled:
            self._draw_coupled_noise()
        self.grammar = [i for i, r in enumerate(reqs) if r.grammar is not None]
        self.live = {i: True for i in self.grammar}
        self.num_fed = dict.fromkeys(self.grammar, 0)
        # Row i * (k + 1) + j: request i's mask after its first j drafts (all ones: unmasked).
        self.bitmask: torch.Tensor | None = None
        if self.grammar:
            self.bitmask = torch.full((b * (k + 1), bitmask_width(vocab_size)), -1, dtype=torch.int32)

    def _draw_coupled_noise(self) -> None:
        self.noise = torch.ones((len(self.reqs), self.k + 1, self.vocab_size), device=self.device)
        for i in self.coupled:
            gen = self.reqs[i].generator
            assert gen is not None
            states = []
            for j in range(self.k + 1):
                # One [V] draw per token, as the plain sampler takes them (not one [k + 1, V] draw).
                self.noise[i, j] = torch.empty(self.vocab_size, device=self.device).exponential_(generator=gen)
                states.append(gen.get_state())
            self.states[i] = states

    # --- drafting -----------------------------------------------------------------------------

    def draft(self, j: int, rows: Sequence[int], logits: torch.Tensor | None) -> list[int]:
        """Draft ``j + 1`` of every request: for ``rows`` (indices into ``reqs``) from the draft
        model's ``logits`` ``[len(rows), V]``, for the others their last token (a placeholder,
        drawn from the point mass on itself). Returns every request's draft."""
        for i in self.grammar:
            self._fill(i, j)
        picked: dict[int, int] = {}
        if rows:
            assert logits is not None and logits.shape[0] == len(rows)
            picked = dict(zip(rows, self._pick(j, list(rows), logits).tolist()))
        out: list[int] = []
        for i, req in enumerate(self.reqs):
            token = picked.get(i, req.all_token_ids[-1])
            if i not in picked and self.q is not None:
                self.q[i, j, token] = 1.0
            self.drafts[i][j] = token
            out.append(token)
        for i in self.grammar:
            self._feed(i, out[i])
        return out

    def _pick(self, j: int, rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits = self._masked(logits.float(), [i * (self.k + 1) + j for i in rows])
        tokens = logits.argmax(dim=-1)
        sampled = [r for r, i in enumerate(rows) if not self.reqs[i].params.is_greedy]
        if not sampled:
            return tokens
        q = filtered_probs(logits[sampled], [self.reqs[rows[r]].params for r in sampled])
        for s, r in enumerate(sampled):
            i = rows[r]
            if self.noise is not None and i in self.states:
                tokens[r] = race(q[s], self.noise[i, j])
            else:
                assert self.q is not None
                self.q[i, j] = q[s]
                noise = torch.empty_like(q[s]).exponential_(generator=self.default_generator)
                tokens[r] = race(q[s], noise)
        return tokens

    def _fill(self, i: int, j: int) -> None:
        matcher = self.reqs[i].grammar
        if self.live[i] and matcher is not None and self.bitmask is not None:
            matcher.fill(self.bitmask, i * (self.k + 1) + j)

    def _feed(self, i: int, token: int) -> None:
        matcher = self.reqs[i].grammar
        if not self.live[i] or matcher is None:
            return
        if not matcher.accept(token):
            self.live[i] = False  # a placeholder the grammar refuses: nothing past it is emitted
            return
        self.num_fed[i] += 1
        if matcher.is_terminated:
            self.live[i] = False  # the draft completes the grammar: a run through it ends there

    def finish_drafts(self) -> None:
        """Fill the bonus rows' masks and roll every matcher back to where the step found it."""
        for i in self.grammar:
            self._fill(i, self.k)
            matcher = self.reqs[i].grammar
            assert matcher is not None
            matcher.rollback(self.num_fed[i])

    def _masked(self, logits: torch.Tensor, mask_rows: list[int]) -> torch.Tensor:
        """``logits`` (fp32, one row per entry of ``mask_rows``) with those masks applied."""
        if self.bitmask is None:
            return logits
        words = to_device(self.bitmask[mask_rows], logits.device)
        return logits.masked_fill(~unpack_bitmask(words, self.vocab_size), float("-inf"))

    # --- verification ------------------------------------------------------------------------

    def accept(self, logits: torch.Tensor) -> list[list[int]]:
        """The tokens each request emits from the verify's ``logits`` ``[B * (k + 1), V]``: its
        accepted drafts and one more (``engine.sampling.draft_acceptance``). Seeded generators are
        left just past the draws of the emitted tokens."""
        b, k1 = len(self.reqs), self.k + 1
        logits = self._masked(logits.float(), list(range(b * k1))).view(b, k1, -1)
        drafts = to_device(torch.tensor(self.drafts, dtype=torch.int64).view(b, self.k), logits.device)
        n = torch.zeros(b, dtype=torch.int64, device=logits.device)
        token = torch.zeros(b, dtype=torch.int64, device=logits.device)
        for rows, rule in ((self.greedy, self._greedy), (self.coupled, self._coupled), (self.standard, self._standard)):
            if rows:
                idx = to_device(torch.tensor(rows), logits.device)
                n[idx], token[idx] = rule(rows, logits[idx], drafts[idx])
        runs = []
        for i, (num, last) in enumerate(zip(n.tolist(), token.tolist())):
            runs.append([*self.drafts[i][:num], last])
            if i in self.states:
                gen = self.reqs[i].generator
                assert gen is not None
                gen.set_state(self.states[i][num])
        return runs

    def _probs(self, rows: list[int], logits: torch.Tensor) -> torch.Tensor:
        params = [self.reqs[i].params for i in rows for _ in range(self.k + 1)]
        return filtered_probs(logits.flatten(0, 1), params).view(logits.shape)

    def _greedy(self, rows: list[int], logits: torch.Tensor, drafts: torch.Tensor) -> Decision:
        return accept_greedy(logits, drafts)

    def _coupled(self, rows: list[int], logits: torch.Tensor, drafts: torch.Tensor) -> Decision:
        assert self.noise is not None
        idx = to_device(torch.tensor(rows), logits.device)
        return accept_coupled(self._probs(rows, logits), drafts, self.noise[idx])

    def _standard(self, rows: list[int], logits: torch.Tensor, drafts: torch.Tensor) -> Decision:
        assert self.q is not None
        gen, dev = self.default_generator, logits.device
        uniform = torch.stack([torch.rand(self.k, device=dev, generator=gen) for _ in rows])
        noise = torch.stack([torch.empty(self.vocab_size, device=dev).exponential_(generator=gen) for _ in rows])
        idx = to_device(torch.tensor(rows), dev)
        return accept_standard(self._probs(rows, logits), self.q[idx], drafts, uniform, noise)

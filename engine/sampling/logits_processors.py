"""Per-request changes to a step's logits before sampling, and the log-probabilities it reports.

``StepProcessing.build`` looks at the sampled requests of a step; when none of them has a
grammar, penalties, a logit bias, ``min_tokens`` or ``logprobs`` it returns None and the step
samples exactly as before (no tensor is built). Otherwise ``apply`` returns an fp32 copy of the
logits with, for the rows concerned and in this order:

1. the grammar's mask: tokens it does not allow next become ``-inf`` (``engine.sampling.grammar``; the
   bitmask is filled on the host when ``build`` runs, which the runner calls after queueing the
   forward, so the host work overlaps the device's). A finished request's row (one that a step
   queued ahead still samples, its token dropped: ``engine.step_pipeline``) is not masked: its
   matcher may have terminated, and a terminated matcher has no next tokens;
2. the penalties, over the counts ``c`` of each token in the output and the set ``seen`` of
   tokens in the prompt or the output::

       l = l / r  if l > 0 and t in seen          (repetition_penalty r)
       l = l * r  if l <= 0 and t in seen
       l = l - c * frequency_penalty - (c > 0) * presence_penalty

3. the logit bias (added);
4. ``min_tokens``: while fewer tokens were generated, the EOS and stop tokens become ``-inf``.

Everything runs on the device as a few batched tensor ops; the per-request state kept between
steps is a device tensor of output-token counts (``PenaltyState``), updated with the tokens
generated since the request's last step.

Log-probabilities are ``log_softmax`` of the model's logits as the runner produced them (before
any of the above, temperature included): what the model thinks of each token, as OpenAI's
``logprobs`` and vLLM's default report it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phloem.engine.host_copy import to_device
from phloem.engine.request import Request, TokenLogprob
from phloem.engine.sampling.grammar import GrammarMatcher, bitmask_width, fill_bitmask, unpack_bitmask

__all__ = ["PenaltyState", "StepLogprobs", "StepProcessing"]


class PenaltyState:
    """One request's token counts on the device: output counts ``[V]`` int32, and with a
    repetition penalty the prompt's tokens ``[V]`` bool (built once)."""

    def __init__(self, req: Request, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        self.num_counted = 0
        self.prompt_mask: torch.Tensor | None = None
        if req.params.repetition_penalty != 1.0:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            mask[to_device(torch.tensor(req.prompt_token_ids), device)] = True
            self.prompt_mask = mask


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    """The sampled rows' log-probabilities, packed ``[R, 1 + 2k]`` fp32 (the token's, then k
    alternatives' log-probabilities, then their ids: exact in fp32 below 2**24)."""

    rows: tuple[int, ...]
    num_top: tuple[int, ...]
    values: torch.Tensor
    copied: torch.cuda.Event | None = None

    def to_host(self) -> StepLogprobs:
        """A pinned host copy queued on the current stream (CUDA only); ``read`` waits for it."""
        host = torch.empty(self.values.shape, dtype=self.values.dtype, pin_memory=True)
        host.copy_(self.values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepLogprobs(self.rows, self.num_top, host, event)

    def read(self, token_ids: Sequence[int]) -> dict[int, TokenLogprob]:
        """Per sampled row: the token (``token_ids[row]``), its log-probability, the alternatives."""
        if self.copied is not None:
            self.copied.synchronize()
        values = self.values.tolist()
        out: dict[int, TokenLogprob] = {}
        k_max = (len(values[0]) - 1) // 2 if values else 0
        for row, k, v in zip(self.rows, self.num_top, values):
            top = tuple((int(v[1 + k_max + j]), v[1 + j]) for j in range(k))
            out[row] = TokenLogprob(int(token_ids[row]), v[0], top)
        return out


class StepProcessing:
    """What one step's sampled requests change in their logits (see the module docstring)."""

    def __init__(self, reqs: Sequence[Request], vocab_size: int, eos_ids: Sequence[int], device: torch.device) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.reqs = tuple(reqs)
        self.grammar_rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.is_finished]
        self.bitmask = self._fill_bitmask() if self.grammar_rows else None
        self.penalty_rows = [i for i, r in enumerate(reqs) if r.params.has_penalties]
        self.eos_ids = tuple(eos_ids)
        self.logprob_rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]

    @classmethod
    def build(
        cls, reqs: Sequence[Request], vocab_size: int, eos_ids: Sequence[int], device: torch.device
    ) -> StepProcessing | None:
        """The step's processing, or None when no request needs any (the common case)."""
        if not any(r.processes_logits or r.grammar is not None for r in reqs):
            return None
        return cls(reqs, vocab_size, eos_ids, device)

    def _fill_bitmask(self) -> torch.Tensor:
        pin = self.device.type == "cuda"
        mask = torch.empty((len(self.grammar_rows), bitmask_width(self.vocab_size)), dtype=torch.int32, pin_memory=pin)
        matchers: list[GrammarMatcher] = [self.reqs[i].grammar for i in self.grammar_rows]  # type: ignore[misc]
        fill_bitmask(matchers, mask)
        return to_device(mask, self.device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """An fp32 copy of ``logits`` ``[S, V]`` with every row's processing applied."""
        out = logits.float()
        if out.data_ptr() == logits.data_ptr():
            out = out.clone()
        if self.bitmask is not None:
            allowed = unpack_bitmask(self.bitmask, self.vocab_size)
            if len(self.grammar_rows) == len(self.reqs):
                out.masked_fill_(~allowed, float("-inf"))
            else:
                rows = self._rows(self.grammar_rows)
                out[rows] = out[rows].masked_fill(~allowed, float("-inf"))
        if self.penalty_rows:
            self._apply_penalties(out)
        self._apply_bias(out)
        self._ban_stops(out)
        return out

    def _rows(self, rows: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(rows, dtype=torch.int64), self.device)

    def _apply_penalties(self, logits: torch.Tensor) -> None:
        reqs = [self.reqs[i] for i in self.penalty_rows]
        states = [self._penalty_state(r) for r in reqs]
        counts = torch.stack([s.counts for s in states])
        new_rows: list[int] = []
        new_ids: list[int] = []
        for j, (req, state) in enumerate(zip(reqs, states)):
            new = req.output_token_ids[state.num_counted :]
            new_rows += [j] * len(new)
            new_ids += new
            state.num_counted += len(new)
        if new_ids:
            index = (self._rows(new_rows), self._rows(new_ids))
            counts.index_put_(index, torch.ones(len(new_ids), dtype=torch.int32, device=self.device), accumulate=True)
        for j, state in enumerate(states):
            state.counts = counts[j]  # a view: the next step stacks (copies) it again
        penalize_rows(logits, self._rows(self.penalty_rows), counts, self._seen(states, counts), reqs)

    def _penalty_state(self, req: Request) -> PenaltyState:
        if req.penalty_state is None:
            req.penalty_state = PenaltyState(req, self.vocab_size, self.device)
        assert isinstance(req.penalty_state, PenaltyState)
        return req.penalty_state

    def _seen(self, states: list[PenaltyState], counts: torch.Tensor) -> torch.Tensor:
        seen = counts > 0
        prompt = [j for j, s in enumerate(states) if s.prompt_mask is not None]
        if prompt:
            # Indexed by a device tensor: a Python list index would be copied synchronously, and
            # the host would wait for the forward queued before this step's sampling.
            rows = self._rows(prompt)
            seen[rows] |= torch.stack([states[j].prompt_mask for j in prompt])  # type: ignore[misc]
        return seen

    def _apply_bias(self, logits: torch.Tensor) -> None:
        rows, ids, bias = [], [], []
        for i, r in enumerate(self.reqs):
            for token_id, value in r.params.logit_bias:
                rows.append(i)
                ids.append(token_id)
                bias.append(value)
        if rows:
            values = to_device(torch.tensor(bias, dtype=torch.float32), self.device)
            logits.index_put_((self._rows(rows), self._rows(ids)), values, accumulate=True)

    def _ban_stops(self, logits: torch.Tensor) -> None:
        rows, ids = [], []
        for i, r in enumerate(self.reqs):
            p = r.params
            if r.num_output_tokens < p.min_tokens:
                banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_ids))
                rows += [i] * len(banned)
                ids += sorted(banned)
        if rows:
            logits[self._rows(rows), self._rows(ids)] = float("-inf")

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor) -> StepLogprobs | None:
        """Log-probabilities of the sampled ``tokens`` ``[S]`` and their alternatives, from the
        model's ``logits`` ``[S, V]`` as given to the sampler; None when no row asked."""
        if not self.logprob_rows:
            return None
        rows = self._rows(self.logprob_rows)
        lp = logits[rows].float().log_softmax(dim=-1)
        num_top = tuple(int(self.reqs[i].params.logprobs or 0) for i in self.logprob_rows)
        parts = [lp.gather(1, tokens[rows].unsqueeze(1))]
        k = max(num_top)
        if k:
            top = lp.topk(k, dim=-1)
            parts += [top.values, top.indices.float()]
        return StepLogprobs(tuple(self.logprob_rows), num_top, torch.cat(parts, dim=1))


def penalize_rows(
    logits: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, reqs: Sequence[Request]
) -> None:
    """Apply the penalties (formula in the module docstring) to ``logits[rows]`` in place.

    ``counts`` ``[R, V]`` are the output tokens' counts, ``seen`` ``[R, V]`` the tokens of the
    prompt (with a repetition penalty) or the output, one row per entry of ``rows``.
    """
    device = logits.device

    def column(name: str) -> torch.Tensor:
        values = [getattr(r.params, name) for r in reqs]
        return to_device(torch.tensor(values, dtype=torch.float32), device)[:, None]

    sub = logits[rows]
    rep = column("repetition_penalty")
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - counts * column("frequency_penalty") - (counts > 0) * column("presence_penalty")
    logits[rows] = sub


"""Speculative decoding with the checkpoint's MTP layer: synchronous loop, eager.

A speculative step replaces a plain decode step when every request of it is *eligible*: greedy
or sampled, seeded or not, with or without a grammar or logprobs; not with penalties, a logit
bias or ``min_tokens`` (their logits change with every drafted token), nor finalizing. Any other
step runs plain, so requests that are not eligible never see speculation (the fallback is per
step). Every token is decided as the plain sampler would decide it
(``engine.sampling.draft_sampler``: exact match for greedy requests, the standard
rejection-sampling rule for unseeded sampled ones, the plain sampler's own draws for seeded
ones, each row masked by the request's grammar). For each request at position ``p`` (its last
token ``x[p]`` not yet computed):

1. **Draft.** The MTP layer first catches up over the request's *pending rows*: the trunk's
   final hidden states of the positions it has computed whose next token was unknown when they
   were computed (the last row of a step), now known. That writes the MTP layer's KV at those
   positions (the MTP KV has no gaps) and its last row drafts ``d1``; ``d2..dk`` come from the
   MTP layer run recursively one token at a time (``engine.models.mtp``), each picked by the
   request's rule under its grammar. A request with no valid pending rows (never expected on
   this path) drafts its last token ``k`` times: correct, rarely accepted.
2. **Verify.** One trunk forward over ``[x[p], d1..dk]`` at ``p..p+k`` per request (a small
   prefill chunk from the request's state), logits of every row.
3. **Accept** ``d1..dn`` and one more token ``t`` by the request's rule. A stop token,
   ``max_tokens``, the context limit or the end of its grammar inside that run cuts it there
   (``n`` shrinks), so the request's counters end exactly where a plain run's would. Requests
   asking for logprobs get those of the verify's rows of the emitted tokens.
4. **Roll back** (when ``n < k``): the GDN state the verify left in the write slot is past the
   accepted position. The state read before the verify was snapshotted (a copy of the request's
   conv and recurrent states); it is written back into the write slot and the trunk reruns over
   the ``n + 1`` accepted tokens (snapshot + recompute: the simplest correct mechanism; it costs
   a second forward on rejection, which the slot-indirection design of issue 50 will remove).
   Trunk KV of rejected positions stays in pages past ``num_computed_tokens``: nothing reads it
   (sequence lengths bound attention), the next step overwrites it, and the radix cache only
   publishes up to ``num_computed_tokens``, so rejected positions are never published.
5. The verify's hidden states of the accepted rows become the request's pending rows.

Plain (non-speculative) steps of a speculating engine run the MTP layer's first step over the
step's rows through ``ModelRunner.hidden_hook`` (prefill chunks included, and decode steps
replayed from a CUDA graph: the graph keeps its final hidden states), so the MTP KV of the
prompt is there when decoding starts and a cached prefix carries it (a turn's last accepted
positions keep the entries the drafts wrote there, approximations that only cost acceptance,
unless a finalize step reran them).

**On CUDA** every speculative forward is eager and goes through the calls an eager plain step
makes: ``ModelRunner.build_batch`` plans the attention backend (FlashInfer's prefill wrapper,
``causal=True`` over the KV history, for the verify's ``k + 1`` tokens a request, the rerun's
``n + 1`` and the MTP layer's catch-up rows; the split-KV Triton decode kernel, or FlashInfer's
decode, for the MTP layer's one-token steps; a mixed plan where one-token rows come first), and
the trunk runs its GDN layers through the chunked kernel (``chunk_gated_delta_rule``, the varlen
conv) as for a prefill chunk, or, where the rerun is one token a request, the conv update and
recurrent kernel of a decode step (the fused projections at batch 1,
``DecoderLayer._forward_decode``). The GDN rollback's snapshot and restore are index copies of
the state slots (``SpeculativeRanks``). The rule: the CUDA fast paths that cannot take a
speculative step are left to plain steps. CUDA graphs capture one-token decode steps with their
sampling, so a speculating engine keeps them for its plain decode steps and runs speculative
steps (``k + 1`` tokens a request, logits of every row, host decisions between the forwards)
eagerly; the piecewise prefill graphs likewise serve only plain steps; async scheduling is off
(step N + 1's inputs depend on step N's acceptance, decided on the host); the MTP layer never
takes the fused one-token path (``MultiTokenPredictor``).

Every forward, LM head and state copy goes through ``SpeculativeRanks``
(``engine.speculative_ranks``), which under tensor parallelism has the worker ranks join it.

Limits for now (docs/decisions.md): speculative steps are eager (no CUDA graph), synchronous
scheduling (async is turned off), tensor parallelism on CPU only (on CUDA a worker would replay
a decode graph for a one-token rerun that rank 0 runs eagerly: refused), a verify step may
exceed ``max_num_batched_tokens`` by ``B * k``, periodic checkpoints falling inside an accepted
run are skipped, and spilling a session does not carry the MTP KV layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from phloem.engine.cache.manager import CacheManager
from phloem.engine.config import MAX_DRAFT_TOKENS, ModelConfig, SpeculativeConfig
from phloem.engine.model_runner import ModelRunner
from phloem.engine.models.mtp import mtp_kv_layers
from phloem.engine.request import Request, TokenLogprob
from phloem.engine.sampling.draft_sampler import DraftSampler
from phloem.engine.scheduler import SchedulerOutput
from phloem.engine.speculative_ranks import SpeculativeRanks
from phloem.engine.step_plan import StepInputs

__all__ = ["MTPSpeculator", "SpeculationStats", "SpeculativeStep", "extra_kv_layers", "token_logprobs"]


@dataclass(slots=True)
class SpeculationStats:
    """Counters since the engine started.

    ``steps``: speculative steps; ``request_steps``: requests drafted for over them;
    ``drafted_tokens`` / ``emitted_tokens``: tokens the MTP layer drafted, and tokens the steps
    emitted (accepted drafts + the target's token, after stop cuts); ``plain_steps``: steps of a
    speculating engine that ran plain (prefill, mixed, requests that do not speculate, a batch
    over ``SpeculativeConfig.max_batch_size``), of which ``over_batch_steps`` for the batch alone;
    ``emitted_lengths[n]``: request-steps that emitted ``n`` tokens (index 0 unused).
    """

    steps: int = 0
    request_steps: int = 0
    drafted_tokens: int = 0
    emitted_tokens: int = 0
    plain_steps: int = 0
    over_batch_steps: int = 0
    emitted_lengths: list[int] = field(default_factory=lambda: [0] * (MAX_DRAFT_TOKENS + 2))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per request per speculative step (1.0: no draft accepted)."""
        return self.emitted_tokens / self.request_steps if self.request_steps else 0.0

    @property
    def accepted_tokens(self) -> int:
        """Drafts accepted (the emitted tokens less each request-step's target token)."""
        return self.emitted_tokens - self.request_steps

    def record(self, emitted: list[int], drafted: int) -> None:
        """One speculative step: each request's emitted length, and the drafts of the step."""
        self.steps += 1
        self.request_steps += len(emitted)
        self.drafted_tokens += drafted
        self.emitted_tokens += sum(emitted)
        for n in emitted:
            self.emitted_lengths[n] += 1

    def snapshot(self) -> SpeculationStats:
        """A copy that later steps leave alone."""
        return replace(self, emitted_lengths=list(self.emitted_lengths))


@dataclass(frozen=True, slots=True)
class SpeculativeStep:
    """What a speculative step emitted: each request's tokens in order, and their
    log-probabilities for the requests that asked (from the verify's logits)."""

    tokens: dict[str, list[int]]
    logprobs: dict[str, tuple[TokenLogprob, ...]]


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: int) -> tuple[TokenLogprob, ...]:
    """Each token's log-probability and ``num_top`` alternatives from its row of the model's
    ``logits`` ``[len(tokens), V]``: what the plain step reports (``StepProcessing.logprobs``)."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None]).squeeze(1).tolist()
    top = lp.topk(num_top, dim=-1) if num_top else None
    values = top.values.tolist() if top is not None else [[] for _ in tokens]
    ids = top.indices.tolist() if top is not None else [[] for _ in tokens]
    return tuple(
        TokenLogprob(t, c, tuple(zip(i, v))) for t, c, i, v in zip(tokens, chosen, ids, values)
    )


def extra_kv_layers(spec: SpeculativeConfig, model_config: ModelConfig) -> int:
    """KV layers the page pool needs past the trunk's: the MTP layer's when it drafts."""
    return mtp_kv_layers(model_config) - len(model_config.full_attention_layers) if spec.uses_mtp else 0


def eligible(req: Request) -> bool:
    """Whether ``req``'s next decode step may speculate: greedy or sampled, with or without a
    grammar or logprobs; not with penalties, a logit bias or ``min_tokens`` (their logits change
    with every drafted token), nor finalizing."""
    p = req.params
    return (
        not p.has_penalties and not p.logit_bias and p.min_tokens == 0
        and not req.finalizing and not req.prefill_only and req.has_state
        and req.num_computed_tokens == req.num_tokens - 1
    )  # fmt: skip


class MTPSpeculator:
    """Drafts with the MTP layer, verifies with the trunk, accepts and rolls back (module doc)."""

    def __init__(
        self, runner: ModelRunner, cache: CacheManager, model_config: ModelConfig, num_drafts: int,
        max_model_len: int, max_batch_size: int | None = None,
    ) -> None:  # fmt: skip
        if runner.device.type == "cuda" and runner.tp.size > 1:
            raise ValueError("speculative: runs at tensor_parallel_size=1 on CUDA for now (TP speculation is CPU-only)")
        if getattr(runner.model, "mtp", None) is None:
            raise ValueError("speculative: the model has no MTP layer loaded")
        self.runner = runner
        self.cache = cache
        self.model_config = model_config
        self.k = num_drafts
        self.max_model_len = max_model_len
        # Above it a decode step runs plain: the verify would no longer be bandwidth-bound.
        self.max_batch_size = max_batch_size
        # Request id -> (final hidden rows [m, H], position of the first): rows computed by the
        # trunk whose MTP step has not run yet.
        self.pending: dict[str, tuple[torch.Tensor, int]] = {}
        self.stats = SpeculationStats()
        self.ranks = SpeculativeRanks(runner)  # every forward below runs on every TP rank
        self._sched: SchedulerOutput | None = None
        runner.hidden_hook = self._after_plain_forward

    @classmethod
    def build(
        cls, spec: SpeculativeConfig, runner: ModelRunner, cache: CacheManager, model_config: ModelConfig,
        max_model_len: int,
    ) -> MTPSpeculator | None:  # fmt: skip
        """The speculator ``spec`` asks for; None when speculation is off."""
        if not spec.uses_mtp:
            return None
        return cls(runner, cache, model_config, spec.num_draft_tokens, max_model_len, spec.max_batch_size)

    # --- plain steps ------------------------------------------------------------------------

    def before_plain_step(self, sched: SchedulerOutput, running: list[Request]) -> None:
        """Called before a plain step is launched: its requests, and forget finished ones."""
        self._sched = sched
        self.stats.plain_steps += 1
        live = {r.request_id for r in running} | {r.request_id for r in sched.requests}
        for rid in [rid for rid in self.pending if rid not in live]:
            del self.pending[rid]

    def _after_plain_forward(self, inp: StepInputs, hidden: torch.Tensor) -> None:
        sched, self._sched = self._sched, None
        if sched is None or len(sched.requests) != len(inp.query_lens):
            return  # a forward the engine did not schedule (warm-up): the MTP layer sits it out
        rows: list[tuple[Request, int, torch.Tensor]] = []
        for i, req in enumerate(sched.requests):
            a, b = inp.query_start_loc[i], inp.query_start_loc[i + 1]
            start = inp.positions[a]
            h, pos0 = self._with_pending(req, hidden[a:b], start)
            known = max(0, min(h.shape[0], req.num_tokens - 1 - pos0))
            if known:
                rows.append((req, pos0, h[:known]))
            if known < h.shape[0]:
                self.pending[req.request_id] = (h[known:].clone(), pos0 + known)
            else:
                self.pending.pop(req.request_id, None)
        if rows:
            self._mtp_rows(rows)

    def _with_pending(self, req: Request, h: torch.Tensor, start: int) -> tuple[torch.Tensor, int]:
        """``h`` (rows from ``start``) with the request's pending rows before it when they end at
        ``start``."""
        pend = self.pending.pop(req.request_id, None)
        if pend is not None and pend[1] + pend[0].shape[0] == start:
            return torch.cat((pend[0], h)), pend[1]
        return h, start

    # --- building batches -------------------------------------------------------------------

    def _inputs(self, rows: list[tuple[Request, int, list[int]]]) -> StepInputs:
        """A step over ``(request, first position, ids)`` rows, reading and writing each request's
        write slot; nothing sampled."""
        ps = self.runner.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        state: list[int] = []
        pages: list[list[int]] = []
        for req, pos0, toks in rows:
            assert req.write_slot is not None
            end = pos0 + len(toks)
            assert end <= len(req.page_ids) * ps, f"request {req.request_id} lacks pages for {end} tokens"
            ids.extend(toks)
            positions.extend(range(pos0, end))
            slots.extend(req.page_ids[p // ps] * ps + p % ps for p in range(pos0, end))
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            state.append(req.write_slot)
            pages.append(req.page_ids)
        n = len(rows)
        lens = tuple(len(t) for _, _, t in rows)
        return StepInputs(ids, positions, slots, qsl, seq_lens, state, list(state), [True] * n, lens, pages, [])

    def _mtp_rows(self, rows: list[tuple[Request, int, torch.Tensor]]) -> torch.Tensor:
        """The MTP layer's first step over each request's rows (their next tokens known): writes
        its KV there; returns ``h'`` of every row."""
        spec = [(req, pos0, req.all_token_ids[pos0 + 1 : pos0 + 1 + h.shape[0]]) for req, pos0, h in rows]
        return self.ranks.mtp(self._inputs(spec), torch.cat([h for _, _, h in rows]))

    # --- speculative steps ------------------------------------------------------------------

    @torch.inference_mode()
    def try_step(self, sched: SchedulerOutput) -> SpeculativeStep | None:
        """Run ``sched`` (a decode step) speculatively: each request's emitted tokens (decided as
        the plain sampler would: ``engine.sampling.draft_sampler``, cut at a stop), with the GDN
        state and KV at the last one's position. None (nothing run) when the step is not
        eligible; then run it plain."""
        reqs = sched.requests
        if sched.kind != "decode" or not reqs or not all(eligible(r) for r in reqs):
            return None
        if self.max_batch_size is not None and len(reqs) > self.max_batch_size:
            self.stats.over_batch_steps += 1
            return None
        k = min(self.k, min(self.max_model_len - 1 - r.num_computed_tokens for r in reqs))
        if k < 1:
            return None
        # Pages for the verify's positions p..p+k (the scheduler reserved p's).
        if not all(self.cache.allocate_pages(r, k + 1) for r in reqs):
            return None
        sampler = DraftSampler(reqs, k, self.model_config.vocab_size, self.runner.default_generator, self.runner.device)
        drafts = self._draft(reqs, k, sampler)
        read = [r.read_slot if r.read_slot is not None else r.write_slot for r in reqs]
        self.ranks.snapshot(read)
        verify = self._inputs([(r, r.num_computed_tokens, [r.all_token_ids[-1], *d]) for r, d in zip(reqs, drafts)])
        verify = StepInputs(
            verify.input_ids, verify.positions, verify.slot_mapping, verify.query_start_loc, verify.seq_lens,
            read, verify.write_slots, verify.has_state, verify.query_lens, verify.page_ids, [],
        )
        hidden = self.ranks.trunk(verify)
        logits = self.ranks.logits(hidden)
        emitted = sampler.accept(logits)
        out = SpeculativeStep({}, {})
        redo: list[tuple[Request, int, list[int]]] = []
        redo_rows: list[int] = []
        for i, (req, d, run) in enumerate(zip(reqs, drafts, emitted)):
            tokens = self._cut(req, run)
            n = len(tokens) - 1
            out.tokens[req.request_id] = tokens
            if req.params.logprobs is not None:
                out.logprobs[req.request_id] = token_logprobs(logits[i * (k + 1) : i * (k + 1) + n + 1], tokens,
                                                              req.params.logprobs)
            p = req.num_computed_tokens
            self.pending[req.request_id] = (hidden[i * (k + 1) : i * (k + 1) + n + 1].clone(), p)
            if n < k:
                redo.append((req, p, [req.all_token_ids[-1], *d[:n]]))
                redo_rows.append(i)
        if redo:
            self.ranks.restore(redo_rows, [reqs[i].write_slot for i in redo_rows])  # type: ignore[misc]
            self.ranks.trunk(self._inputs(redo))
        self.stats.record([len(t) for t in out.tokens.values()], len(reqs) * k)
        return out

    def _draft(self, reqs: tuple[Request, ...], k: int, sampler: DraftSampler) -> list[list[int]]:
        """``k`` MTP drafts per request, picked by ``sampler`` (its last token repeated where it
        has no pending rows)."""
        rows: list[tuple[Request, int, torch.Tensor]] = []
        which: list[int] = []
        for i, req in enumerate(reqs):
            pend = self.pending.pop(req.request_id, None)
            if pend is not None and pend[1] + pend[0].shape[0] == req.num_computed_tokens:
                rows.append((req, pend[1], pend[0]))
                which.append(i)
        h: torch.Tensor | None = None
        if rows:
            h = self._mtp_rows(rows)
            last = torch.tensor([0, *(h.shape[0] for _, _, h in rows)]).cumsum(0)[1:] - 1
            h = h[last]
        chosen = [reqs[i] for i in which]
        for step in range(k):
            token = sampler.draft(step, which, self.ranks.logits(h) if h is not None else None)
            if step + 1 == k or h is None:
                continue
            # The draft of step ``step`` at the position after the one ``h`` is at.
            pos = [r.num_computed_tokens + step for r in chosen]
            last_drafts = [token[i] for i in which]
            h = self.ranks.mtp(self._inputs([(r, q, [t]) for r, q, t in zip(chosen, pos, last_drafts)]), h)
        sampler.finish_drafts()
        return sampler.drafts

    def _cut(self, req: Request, tokens: list[int]) -> list[int]:
        """``tokens`` up to and including the first one a plain run would stop at (a stop token,
        the length limit, the token that completes the request's grammar)."""
        params, eos = req.params, self.model_config.eos_token_ids
        grammar, fed = req.grammar, 0
        cut = tokens
        for j, t in enumerate(tokens):
            if grammar is not None:
                assert grammar.accept(t), f"request {req.request_id}: emitted {t} outside its grammar"
                fed += 1
            if (
                t in params.stop_token_ids or (not params.ignore_eos and t in eos)
                or (grammar is not None and grammar.is_terminated) or req.reaches_length(self.max_model_len, j + 1)
            ):  # fmt: skip
                cut = tokens[: j + 1]
                break
        if grammar is not None:
            grammar.rollback(fed)
        return cut

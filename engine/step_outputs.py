"""The update of an engine step: advance each request by what the step computed and sampled,
finish the ones that stop, and report an output for every request that changed.

A step sampling an id outside the vocabulary raises ``CorruptStep`` before any request moves:
no correct forward produces one, and the engine then drops the step's requests unpublished.
"""

from __future__ import annotations

from phloem.engine.cache.manager import CacheManager
from phloem.engine.config import ModelConfig
from phloem.engine.errors import CorruptStep
from phloem.engine.model_runner import LaunchedStep, StepResult
from phloem.engine.request import FinishReason, Request, RequestOutput, RequestStatus, TokenLogprob
from phloem.engine.scheduler import Scheduler, SchedulerOutput

__all__ = ["StepOutputs"]


class StepOutputs:
    """Applies collected steps to their requests.

    Args:
        model_config: vocabulary size and EOS ids.
        scheduler: finishes requests and completes turn-end checkpoints.
        cache: takes the interval checkpoints of long prefills.
        max_model_len: the engine's context limit (``FinishReason.LENGTH``).
        in_flight: the engine's requests by id; a request leaves it with its final output.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        scheduler: Scheduler,
        cache: CacheManager,
        max_model_len: int,
        in_flight: dict[str, Request],
    ) -> None:
        self.model_config = model_config
        self.scheduler = scheduler
        self.cache = cache
        self.max_model_len = max_model_len
        self.in_flight = in_flight

    def apply(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Advance ``sched``'s requests by ``result``; their outputs."""
        vocab = self.model_config.vocab_size
        impossible = {rid: t for rid, t in result.sampled.items() if not 0 <= t < vocab}
        if impossible:
            raise CorruptStep(f"the step sampled token ids outside the vocabulary [0, {vocab}): {impossible}")
        outputs: list[RequestOutput] = []
        for req, n in zip(sched.requests, sched.num_new_tokens):
            if req.is_finished and not req.finalizing:
                continue  # stopped (or aborted) while a queued step computed one more token
            req.num_computed_tokens += n
            req.has_state = True
            req.read_slot = req.write_slot
            if req.finalizing:
                self.scheduler.complete_finalize(req)
                continue
            if req.prefill_only and req.num_computed_tokens == req.num_tokens:
                # The prompt is computed: publishing on release puts the checkpoint at its end
                # (at num_computed_tokens: a first token sampled here is not part of it).
                first = result.sampled.get(req.request_id)
                if first is not None:
                    req.append_output(first)
                self.scheduler.finish_now(req, FinishReason.PREFILL)
                outputs.append(self.output(req, [] if first is None else [first], result.logprobs.get(req.request_id)))
                continue
            self.cache.maybe_checkpoint(req)
            token = result.sampled.get(req.request_id)
            if token is None:
                continue
            req.append_output(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.scheduler.finish(req, reason)
            outputs.append(self.output(req, [token], result.logprobs.get(req.request_id)))
        return outputs

    def apply_runs(
        self, sched: SchedulerOutput, runs: dict[str, list[int]], logprobs: dict[str, tuple[TokenLogprob, ...]]
    ) -> list[RequestOutput]:
        """Advance the requests of a speculative decode step (``engine.speculative``) by their
        accepted tokens: each computed all but the last of them (the next step's input); the
        tokens are appended in order and a stop ends the run (the speculator already cut it
        there). ``logprobs``: one entry per token, for the requests that asked."""
        outputs: list[RequestOutput] = []
        for req in sched.requests:
            tokens = runs[req.request_id]
            req.num_computed_tokens += len(tokens)
            req.has_state = True
            req.read_slot = req.write_slot
            self.cache.maybe_checkpoint(req)
            applied: list[int] = []
            for token in tokens:
                req.append_output(token)
                applied.append(token)
                reason = self._stop_reason(req, token)
                if reason is not None:
                    self.scheduler.finish(req, reason)
                    break
            assert len(applied) == len(tokens), f"request {req.request_id}: a stop inside an uncut run"
            outputs.append(self.output(req, applied, logprobs.get(req.request_id)))
        return outputs

    def drop(self, launched: LaunchedStep, queued: LaunchedStep | None) -> None:
        """Abort the requests of a corrupt step and of the step queued behind it, publishing
        nothing: their GDN state on the device is past their counters."""
        for step in (launched, queued):
            for req in step.sched.requests if step is not None else ():
                if req.status is RequestStatus.FINISHED and not req.finalizing:
                    continue
                req.has_state = False  # ``release`` then frees the write slot instead of publishing it
                self.scheduler.abort(req.request_id)
                self.in_flight.pop(req.request_id, None)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.model_config.eos_token_ids):
            return FinishReason.STOP
        if req.grammar is not None and req.grammar.is_terminated:
            return FinishReason.STOP
        if req.reaches_length(self.max_model_len):
            return FinishReason.LENGTH
        return None

    def output(
        self, req: Request, new_tokens: list[int], logprob: TokenLogprob | tuple[TokenLogprob, ...] | None = None
    ) -> RequestOutput:
        """``req``'s output for this step (a finished request leaves ``in_flight``); ``logprob``:
        the new token's, or one per new token."""
        finished = req.status is RequestStatus.FINISHED
        if finished:
            self.in_flight.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            new_token_ids=new_tokens,
            finished=finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_cached_tokens=req.served_tokens,
            new_logprobs=(logprob,) if isinstance(logprob, TokenLogprob) else logprob,
            num_resumed_tokens=req.num_resumed_tokens,
        )

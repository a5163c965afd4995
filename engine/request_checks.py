"""What a request must satisfy before it enters the engine (checked once, at ``add_request``).

A bad request raises here, naming the field, and never reaches the loop: the engine keeps
serving the others. ``InvalidRequest`` is the caller's mistake (HTTP 400); ``CapacityExceeded``
means the prompt cannot fit this engine's KV pool even when it is empty.
"""

from __future__ import annotations

from collections.abc import Sequence

from phloem.engine.cache.kv_pages import PagePool
from phloem.engine.errors import CapacityExceeded, InvalidRequest
from phloem.engine.sampling.grammar import GrammarBackend, GrammarMatcher
from phloem.engine.sampling.params import SamplingParams

__all__ = ["check_logit_bias", "check_outputs", "check_prompt", "grammar_matcher"]


def _bad_ids(ids: list[int], vocab: int) -> list[int]:
    """The ids that are not ints (bools included) in ``[0, vocab)``. Every turn of an agent's
    conversation re-sends its whole history to the engine loop's thread, so a prompt of plain ints
    is passed by a type set and its min/max (C loops); only a failing one is walked id by id."""
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab:
        return []
    return [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]


def check_prompt(
    prompt_token_ids: Sequence[int], params: SamplingParams, vocab: int, max_model_len: int, pages: PagePool
) -> list[int]:
    """The prompt as a list.

    Raises:
        InvalidRequest: ``params`` is not ``SamplingParams``; the prompt is empty, holds an id outside
            ``[0, vocab)``, or is at or over ``max_model_len`` (one generated token must fit).
        CapacityExceeded: the prompt needs more pages than the pool has.
    """
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params: expected SamplingParams, got {type(params).__name__}")
    prompt = list(prompt_token_ids)
    if not prompt:
        raise InvalidRequest("prompt_token_ids: expected at least one token, got an empty prompt")
    bad = _bad_ids(prompt, vocab)
    if bad:
        raise InvalidRequest(f"prompt_token_ids: expected integers in [0, {vocab}), got {bad[:5]!r}")
    if len(prompt) >= max_model_len:
        raise InvalidRequest(
            f"prompt_token_ids: the prompt has {len(prompt)} tokens; the context limit is "
            f"{max_model_len} including at least one generated token"
        )
    if pages.pages_for(len(prompt) + 1) > pages.num_pages:
        raise CapacityExceeded(
            f"prompt_token_ids: {len(prompt)} tokens need more than the {pages.num_pages} KV pages of this engine"
        )
    return prompt


def check_outputs(
    prompt: list[int], output_token_ids: Sequence[int], params: SamplingParams, prefill_only: bool,
    sample_first: bool, vocab: int, max_model_len: int,
) -> list[int]:
    """Tokens already generated elsewhere for ``prompt`` (a disaggregated prefill's first token), as a list.

    Raises:
        InvalidRequest: ``sample_first`` without ``prefill_only``; outputs for a prefill-only
            request; ids outside ``[0, vocab)``; outputs that already reach ``max_tokens`` or the
            context limit.
    """
    outputs = list(output_token_ids)
    if sample_first and not prefill_only:
        raise InvalidRequest("sample_first: only a prefill_only request can sample its first token alone")
    if outputs and prefill_only:
        raise InvalidRequest("output_token_ids: a prefill_only request generates nothing to continue")
    if _bad_ids(outputs, vocab):
        raise InvalidRequest(f"output_token_ids: expected integers in [0, {vocab}), got {outputs[:5]!r}")
    if outputs and (len(outputs) >= params.max_tokens or len(prompt) + len(outputs) >= max_model_len):
        raise InvalidRequest(
            f"output_token_ids: {len(outputs)} token(s) already reach max_tokens={params.max_tokens} or the "
            f"context limit {max_model_len}: nothing is left to generate"
        )
    return outputs


def check_logit_bias(params: SamplingParams, vocab: int) -> None:
    """Raises ``InvalidRequest`` when a logit bias names a token outside ``[0, vocab)``."""
    bad = [t for t, _ in params.logit_bias if t >= vocab]
    if bad:
        raise InvalidRequest(f"logit_bias: expected token ids in [0, {vocab}), got {bad[:5]!r}")


def grammar_matcher(backend: GrammarBackend | None, params: SamplingParams, outputs: list[int]) -> GrammarMatcher:
    """A matcher of ``params.grammar`` that has accepted ``outputs`` (tokens generated elsewhere).

    Raises:
        InvalidRequest: no backend (an engine without a tokenizer), a grammar that does not
            compile, or outputs the grammar does not allow.
    """
    assert params.grammar is not None, "grammar_matcher needs a request with a grammar"
    if backend is None:
        raise InvalidRequest("grammar: this engine was built without a tokenizer to compile grammars with")
    matcher = backend.matcher(params.grammar)
    if not all(matcher.accept(t) for t in outputs):
        raise InvalidRequest(f"output_token_ids: {outputs[:5]!r} do not follow the request's grammar")
    return matcher

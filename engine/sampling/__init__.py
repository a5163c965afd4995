"""Choosing the next token: the sampling parameters, the logits processors, the grammar, the sampler.

Modules::

    params             ``SamplingParams`` and ``GrammarSpec``: per-request parameters, validated
                       once at the edge and frozen (no torch: the public API exports them)
    grammar            ``GrammarBackend`` / ``GrammarMatcher``: JSON Schema and structural-tag
                       grammars compiled (xgrammar) to per-token bitmasks
    logits_processors  ``StepProcessing``: a step's grammar masks, penalties, logit bias,
                       ``min_tokens`` and log-probabilities on an fp32 copy of its logits
    sampler            ``sample``: greedy, temperature, top-k, top-p, per-request seeds;
                       ``skip_draws``

``SamplingParams`` and ``GrammarSpec`` load with the package (``phloem.engine`` exports them and
imports without torch); the other names load on first access.

May import: ``engine.request`` (the record it reads and whose log-probabilities it builds),
``engine.errors``, ``engine.host_copy`` (and torch, xgrammar); not ``engine.cache``, the
scheduler, the runner, the models or ``engine.parallel`` (import-linter's engine layers contract
checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phloem._lazy import lazy_exports
from phloem.engine.sampling.params import GrammarSpec, SamplingParams

if TYPE_CHECKING:
    from phloem.engine.sampling.grammar import GrammarBackend, GrammarMatcher
    from phloem.engine.sampling.logits_processors import PenaltyState, StepLogprobs, StepProcessing
    from phloem.engine.sampling.sampler import sample, skip_draws

__all__ = [
    "GrammarBackend", "GrammarMatcher", "GrammarSpec", "PenaltyState", "SamplingParams", "StepLogprobs",
    "StepProcessing", "sample", "skip_draws",
]

_LAZY = {
    "GrammarBackend": "phloem.engine.sampling.grammar",
    "GrammarMatcher": "phloem.engine.sampling.grammar",
    "PenaltyState": "phloem.engine.sampling.logits_processors",
    "StepLogprobs": "phloem.engine.sampling.logits_processors",
    "StepProcessing": "phloem.engine.sampling.logits_processors",
    "sample": "phloem.engine.sampling.sampler",
    "skip_draws": "phloem.engine.sampling.sampler",
}


__getattr__ = lazy_exports(__name__, _LAZY)

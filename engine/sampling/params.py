"""Per-request sampling parameters, validated once at the edge and frozen afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["GrammarSpec", "SamplingParams"]

MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the generated text, compiled by ``engine.sampling.grammar`` (xgrammar).

    Args:
        kind: ``"json_schema"`` (``source`` is a JSON Schema as JSON text) or ``"structural_tag"``
            (``source`` is an xgrammar structural tag as JSON text: tool calls, reasoning blocks).
        source: The grammar's text; equal specs share one compiled grammar.
    """

    kind: Literal["json_schema", "structural_tag"]
    source: str

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "structural_tag"):
            raise ValueError(f"grammar.kind: expected 'json_schema' or 'structural_tag', got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source:
            raise ValueError("grammar.source: expected non-empty JSON text")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token.

    Args:
        max_tokens: new tokens to generate at most (>= 1).
        temperature: 0 means greedy (argmax); the seed is then irrelevant.
        top_p: nucleus mass kept, in (0, 1].
        top_k: keep the k most likely tokens; 0 disables.
        seed: per-request seed: the same seed and history give the same tokens, whatever else
            shares the batch. ``None`` draws from the engine's generator.
        stop_token_ids: extra token ids that finish the request (the stop token is kept in the output).
        ignore_eos: keep generating past the model's EOS tokens (benchmarks).
        presence_penalty: subtracted once from the logit of every token already generated, in [-2, 2].
        frequency_penalty: subtracted from a token's logit per time it was generated, in [-2, 2].
        repetition_penalty: divides the positive (multiplies the negative) logits of every token
            of the prompt or the output, in (0, 10]; 1 disables.
        logit_bias: ``(token_id, bias)`` pairs added to the logits, bias in [-100, 100].
        min_tokens: the EOS and stop tokens cannot be sampled before this many tokens (<= max_tokens).
        logprobs: with a value, every sampled token reports its log-probability and that many
            most likely alternatives (0 to 20); ``None``: no log-probabilities.
        grammar: the generated text must match it; the request finishes when it is complete.
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature: expected a value in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed: expected an integer in [0, 2**63), got {self.seed!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: expected non-negative integers, got {self.stop_token_ids!r}")
        self._check_processing()

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}: expected a value in [-2, 2], got {getattr(self, name)!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty: expected a value in (0, 10], got {self.repetition_penalty!r}")
        if any(not isinstance(t, int) or t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError(
                f"logit_bias: expected (token id >= 0, bias in [-100, 100]) pairs, got {self.logit_bias[:5]!r}"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens: expected 0 to max_tokens={self.max_tokens}, got {self.min_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs: expected None or 0 to {MAX_LOGPROBS}, got {self.logprobs!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits (``engine.sampling.logits_processors``)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0 or self.grammar is not None

    @property
    def reads_last_token(self) -> bool:
        """Whether the next token's logits depend on the token just sampled (a grammar's mask,
        the penalties' counts, the count ``min_tokens`` compares): a step queued before the
        previous step's ids are read samples such a request only once they are
        (``engine.step_pipeline``)."""
        return self.grammar is not None or self.has_penalties or self.min_tokens > 0

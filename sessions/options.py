"""``GenerateOptions``: what one generation asks for, checked at the sessions edge.

Sampling (temperature, top-p/k, seed, penalties, logit bias), stopping (``max_tokens``,
``min_tokens``, stop strings and tokens), what is reported (``logprobs``) and what the output
must look like (``response_format``, ``tool_choice``: ``sessions.text.structured``). The engine's
``SamplingParams`` is derived per request (``sampling_params``), once the room left in the
context window and the grammar are known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phloem.engine import GrammarSpec, SamplingParams
from phloem.sessions.errors import InvalidInput
from phloem.sessions.text.structured import TOOL_CALL_CONSTRAINTS, ResponseFormat, ToolCallConstraint, ToolChoice

__all__ = ["GenerateOptions"]

@dataclass(frozen=True, slots=True)
class GenerateOptions:
    """Options of one generation (``docs/api.md``, ``GenerateParams``).

    Args:
        max_tokens: New tokens at most; None: until a stop condition or the context's end.
            Clamped to the room left in the context window.
        temperature: 0 is greedy (the seed is then irrelevant); at most 2.
        top_p: Nucleus mass kept, in (0, 1].
        top_k: Keep the k most likely tokens; None: no top-k.
        seed: Per-request seed.
        stop: Stop strings; the text is cut before the earliest match.
        stop_token_ids: Token ids that end the generation (kept in the output).
        ignore_eos: Keep generating past the model's EOS tokens.
        presence_penalty: Subtracted from the logit of every token already generated, in [-2, 2].
        frequency_penalty: Subtracted per earlier occurrence of a generated token, in [-2, 2].
        repetition_penalty: Divides positive (multiplies negative) logits of the tokens of the
            prompt and the output, in (0, 10]; 1 is off.
        logit_bias: ``(token_id, bias)`` pairs added to the logits, bias in [-100, 100].
        min_tokens: EOS and the stop tokens cannot end the generation before this many tokens.
        logprobs: Report each token's log-probability and this many alternatives (0 to 20);
            None: no log-probabilities.
        response_format: ``json_object`` / ``json_schema`` constrain the output; None: free text.
        tool_choice: ``auto``, ``none``, ``required`` or a named function (forced calls are
            constrained by the tools' schemas).
        parallel_tool_calls: ``required`` (and ``auto``) may make several calls.
        tool_call_constraint: In ``auto`` mode with tools, what the grammar constrains once the
            model opens a call: ``strict`` (a declared name, arguments valid against its
            schema), ``envelope`` (a declared name, any JSON object) or ``none`` (nothing).

    Raises:
        InvalidInput: A value is out of bounds.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    tool_call_constraint: ToolCallConstraint = "strict"

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, ">= 1 or None"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "in [0, 2]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k is None or self.top_k >= 1, ">= 1 or None"),
            ("seed", self.seed is None or 0 <= self.seed < 2**63, "in [0, 2**63) or None"),
            ("stop", all(self.stop), "non-empty strings"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "ids >= 0"),
            ("tool_call_constraint", self.tool_call_constraint in TOOL_CALL_CONSTRAINTS,
             f"one of {list(TOOL_CALL_CONSTRAINTS)}"),
            ("min_tokens", 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens), ">= 0 and <= max_tokens"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise InvalidInput(f"{name}: expected {expected}, got {getattr(self, name)!r}")
        try:
            # The engine's own bounds for what it takes as is (penalties, bias, logprobs).
            self.sampling_params(max(self.max_tokens or 1, self.min_tokens))
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc

    def sampling_params(self, room: int, grammar: GrammarSpec | None = None) -> SamplingParams:
        """The engine's parameters, with ``max_tokens`` clamped to ``room`` (>= 1) tokens (and
        ``min_tokens`` to ``max_tokens``), constrained by ``grammar`` if given."""
        max_tokens = room if self.max_tokens is None else min(self.max_tokens, room)
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or 0,
            seed=self.seed, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
            min_tokens=min(self.min_tokens, max_tokens), logprobs=self.logprobs, grammar=grammar,
        )

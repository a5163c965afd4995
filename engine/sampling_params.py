"""Per-request sampling parameters, validated once at the edge and frozen afterwards."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SamplingParams"]


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
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

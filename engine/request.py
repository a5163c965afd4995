"""A request inside the engine: its tokens, its progress counters, and the memory it holds.

Progress is counters, scheduling is arithmetic on them::

    |<---------------- num_tokens = len(prompt) + len(output) ---------------->|
    |<-- num_cached_tokens -->|                                                 |
    |<------------ num_computed_tokens ------------>|<-- scheduled this step -->|

A request needs a sample when a step brings ``num_computed_tokens`` up to ``num_tokens``: the
last computed position then predicts the next token.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    # Types only: a request is the record the cache and the sampling layers work on, so it names
    # what they attach to it without depending on them (import-linter's engine layers contract).
    from phloem.engine.cache.radix import RadixNode
    from phloem.engine.sampling.grammar import GrammarMatcher
    from phloem.engine.sampling.logits_processors import PenaltyState
    from phloem.engine.sampling.params import SamplingParams

__all__ = ["FinishReason", "MemoryWait", "Request", "RequestOutput", "RequestStatus", "SpilledPrefix",
           "TokenLogprob"]


class MemoryWait(enum.IntEnum):
    """Why a request waits for admission (``Engine.waits_for_memory``); false only for ``NO``."""

    NO = 0  # not waiting, or waiting for its turn behind other work
    FOR_MEMORY = 1  # the pools are full after eviction; running requests or hand-off holds give some back
    STALLED = 2  # the pools are full, nothing runs and nothing is held: only unpinning frees memory


class SpilledPrefix(Protocol):
    """What the scheduler reads of a request's ``resume`` state (``engine.transfer.PrefixState``,
    which it hands to the engine's loader without knowing its layout)."""

    @property
    def num_tokens(self) -> int: ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop token
    LENGTH = "length"  # max_tokens or the model's context limit
    ABORT = "abort"
    PREFILL = "prefill"  # a prefill-only request computed its prompt and published its checkpoint


@dataclass(eq=False)
class Request:
    request_id: str
    # Prompt then generated tokens, in one list that only grows (no per-step concatenation).
    all_token_ids: list[int]
    params: SamplingParams
    arrival_idx: int
    num_prompt_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # Of ``num_cached_tokens`` (its first admission's hit, fixed), those it computed after all: a
    # preemption let the cache evict them before its next admission. Outputs report the
    # difference, the prompt tokens the cache really served (``served_tokens``).
    num_cached_lost: int = 0
    # KV pages covering positions [0, len(page_ids) * page_size); the first num_shared_pages
    # belong to the radix cache (immutable, kept alive by lock_node).
    page_ids: list[int] = field(default_factory=list)
    num_shared_pages: int = 0
    lock_node: RadixNode | None = None
    num_admissions: int = 0
    # Finished for the caller, but its last token still runs once more so the turn-end
    # checkpoint covers the whole conversation (the next turn then recomputes nothing).
    finalizing: bool = False
    # Compute the prompt, publish a checkpoint at its end, sample nothing (a session's turn 0).
    prefill_only: bool = False
    # With prefill_only: also sample the token after the prompt (a disaggregated prefill).
    sample_first: bool = False
    # Keep the checkpoint published at its end locked until a pin takes it (a session's turn:
    # ``engine.cache.holds``).
    hold_turn_end: bool = False
    # A spilled prefix of the prompt (host tensors), loaded into the cache when the scheduler
    # admits the request unless the cache holds it then (``Scheduler._load_resume``); dropped once
    # the request runs.
    resume: SpilledPrefix | None = None
    # Prompt tokens that ``resume`` loaded (0: the cache held them, or it was dropped): the
    # sessions layer counts a turn's tokens as served by the tier only when they were.
    num_resumed_tokens: int = 0
    # GDN state: read from read_slot (valid iff has_state), write the step's final state to write_slot.
    read_slot: int | None = None
    write_slot: int | None = None
    has_state: bool = False
    # (slot, tail page or None) set aside for the prompt-end checkpoint of a step not collected
    # yet, which a step queued behind it already writes into (``CacheManager.reserve_checkpoint``).
    checkpoint_reservation: tuple[int, int | None] | None = None
    generator: torch.Generator | None = None
    # While waiting: its tokens past the cached prefix when the scheduler first looked (its size
    # class; ``engine.scheduler``). Reset when it is preempted.
    num_uncached_hint: int | None = None
    # Where its prompt leaves the deepest checkpoint it resumed from but still matches cached KV
    # (floored to a page): a prefill chunk ends there and publishes a branch-point checkpoint
    # (``CacheManager.admit``). None: no such point, or already published.
    branch_point: int | None = None
    # Constrained decoding and penalties (``engine.sampling.logits_processors``); None for most requests.
    grammar: GrammarMatcher | None = None
    penalty_state: PenaltyState | None = None
    # Read by the sampler every step: computed once (``engine.sampling.logits_processors``).
    processes_logits: bool = field(init=False)
    # The prefix-cache namespace (tenant) it reads from and publishes to; None: shared.
    namespace: str | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.all_token_ids)
        self.processes_logits = self.params.processes_logits or self.params.logprobs is not None

    @functools.cached_property
    def prompt_token_ids(self) -> list[int]:
        """The prompt, copied once: every step's ``RequestOutput`` shares this list (a copy per
        step would copy an agent's whole history, per request)."""
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def served_tokens(self) -> int:
        """Prompt tokens the prefix cache served it: its first admission's hit, less what a
        preemption lost of it (``num_cached_lost``)."""
        return self.num_cached_tokens - self.num_cached_lost

    def reaches_length(self, max_model_len: int, ahead: int = 0) -> bool:
        """Whether ``ahead`` more tokens bring it to ``max_tokens`` generated or to the context
        limit (``ahead=0``: whether it is there now, the engine's length stop)."""
        return self.num_output_tokens + ahead >= self.params.max_tokens or self.num_tokens + ahead >= max_model_len

    def append_output(self, token: int) -> None:
        self.all_token_ids.append(token)
        if self.grammar is not None:
            # The sampler masked every token the grammar does not allow.
            assert self.grammar.accept(token), f"request {self.request_id}: sampled {token} outside its grammar"

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A sampled token's log-probability and the ``top`` most likely ``(token_id, logprob)``
    alternatives, most likely first (``SamplingParams.logprobs`` of them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What the engine reports about a request after a step (and at the end of ``generate``).

    ``new_token_ids`` holds the tokens produced by this step only (for streaming);
    ``token_ids`` every token generated so far; ``new_logprobs`` one entry per new token when
    the request asked for log-probabilities (else None); ``num_resumed_tokens`` the prompt
    tokens a spilled prefix given with the request loaded (``Request.num_resumed_tokens``),
    which ``num_cached_tokens`` includes; ``num_cached_tokens`` counts only prompt tokens the
    request never computed itself (a preemption whose prefix was evicted before the request came
    back takes those back).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    new_logprobs: tuple[TokenLogprob, ...] | None = None
    num_resumed_tokens: int = 0

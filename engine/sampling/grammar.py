"""Constrained decoding: ``GrammarSpec`` compiled with xgrammar, one matcher per request.

A request whose ``SamplingParams.grammar`` is set gets a ``GrammarMatcher`` when it is added.
Each step the sampler asks it for the bitmask of the tokens allowed next (``fill``, on the host,
while the step's forward runs on the device: ``engine.sampling.logits_processors``), and the engine feeds
it every sampled token (``accept``). The request finishes once the grammar is complete (its
matcher accepted a stop token), so a JSON answer ends where its JSON ends.

``GrammarBackend`` compiles against the served model's tokenizer, loaded on first use (a model
that never sees a grammar never imports xgrammar). A grammar past ``GrammarConfig``'s limits is
refused before it compiles (``engine.sampling.grammar_limits``). Compiled grammars are kept in a
cache bounded by their measured size (``CompiledGrammar.memory_size_bytes``), with a quota per
owner (``engine.sampling.grammar_cache``): an agent sends the same schemas and tools on every
turn. xgrammar's own compiler cache is off (it is unbounded). It is thread-safe: ``EngineClient``
compiles on its own bounded pool (``runtime.grammar_compiles``) before the request reaches the
engine thread, so a slow compile (or a schema xgrammar rejects) never stalls a step, and holds
the compiled grammar (``hold``) until the engine made the request's matcher from it.

The bitmask is xgrammar's layout: ``[rows, ceil(V / 32)]`` int32, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. Ids past the tokenizer's vocabulary (embedding rows
padded to a multiple of 64) are never allowed.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from phloem.engine.config import GrammarConfig
from phloem.engine.errors import InvalidRequest
from phloem.engine.sampling.grammar_cache import GrammarCache
from phloem.engine.sampling.grammar_limits import check_grammar
from phloem.engine.sampling.params import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

__all__ = ["GrammarBackend", "GrammarMatcher", "GrammarStats", "bitmask_width", "fill_bitmask", "unpack_bitmask"]

# Consecutive whitespace a JSON schema grammar allows: pretty-printed JSON nested seven levels at
# indent 2 fits, and a model cannot loop on whitespace forever.
MAX_JSON_WHITESPACE = 16


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, ceil(V / 32)]`` int32 words -> ``[R, V]`` bool (bit ``t % 32`` of word ``t // 32``)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def fill_bitmask(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """Row ``j`` of ``bitmask`` (CPU int32) <- the tokens ``matchers[j]`` allows next; several
    matchers of one backend fill in parallel on its thread pool (xgrammar's batch matcher)."""
    batch = matchers[0].batch if len(matchers) > 1 else None
    if batch is None or any(m.batch is not batch for m in matchers):
        for j, matcher in enumerate(matchers):
            matcher.fill(bitmask, j)
        return
    batch.batch_fill_next_token_bitmask([m.handle for m in matchers], bitmask)


class GrammarMatcher:
    """One request's position in its grammar (xgrammar's ``GrammarMatcher``); ``batch`` is its
    backend's parallel filler."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, batch: xgrammar.BatchGrammarMatcher | None = None) -> None:
        self.handle = matcher
        self.batch = batch

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-next-token bits into ``bitmask[row]`` (a CPU int32 tensor)."""
        self.handle.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (unchanged) when the grammar does not allow it."""
        return bool(self.handle.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative drafts: ``engine.speculative``)."""
        if num_tokens:
            self.handle.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return bool(self.handle.is_terminated())


@dataclass(frozen=True, slots=True)
class GrammarStats:
    """The grammar backend's counters (``/metrics``).

    Args:
        cache_bytes: measured bytes of the compiled grammars kept.
        cache_entries: compiled grammars kept.
        cache_capacity_bytes: the cache's bound.
        cache_evictions: grammars evicted for room (an owner's quota or the whole cache).
        compiles: grammars compiled (cache misses that compiled, or failed to).
        rejections: grammars refused: past a limit, or not compilable.
        timeouts: requests that waited past ``compile_timeout_s`` (counted by the compile pool).
        abandoned: queued compiles dropped before they started: every request waiting for one
            went away (counted by the compile pool).
    """

    cache_bytes: int
    cache_entries: int
    cache_capacity_bytes: int
    cache_evictions: int
    compiles: int
    rejections: int
    timeouts: int = 0
    abandoned: int = 0


class GrammarBackend:
    """Compiles grammars for one model's tokenizer (see the module docstring).

    Args:
        tokenizer_dir: The model folder whose tokenizer the grammars are compiled against.
        vocab_size: The model's vocabulary (logits width), which may exceed the tokenizer's.
        stop_token_ids: Tokens that end a completed grammar (the model's EOS tokens); empty:
            the tokenizer's own EOS.
        config: The limits, the cache's bounds (and, for ``EngineClient``, the compile pool).
    """

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, stop_token_ids: tuple[int, ...] = (),
                 config: GrammarConfig | None = None) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.config = config if config is not None else GrammarConfig()
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._compiled: GrammarCache[GrammarSpec, xgrammar.CompiledGrammar] = GrammarCache(
            self.config.cache_bytes, self.config.cache_bytes_per_owner
        )
        # Compiled grammars handed from a compile to the engine thread's ``matcher`` (``hold``).
        self._held: dict[GrammarSpec, tuple[xgrammar.CompiledGrammar, int]] = {}
        self.num_compiles = 0
        self.num_rejections = 0

    def check(self, spec: GrammarSpec) -> Any:
        """``spec``'s parsed JSON, once it is within the configured limits.

        Raises:
            InvalidRequest: past a limit (one line naming it and the value), or not JSON.
        """
        try:
            return check_grammar(spec, self.config)
        except InvalidRequest:
            with self._lock:
                self.num_rejections += 1
            raise

    def cached(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar | None:
        """The compiled grammar of ``spec`` if kept (cache or ``hold``), else None."""
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is None and spec in self._held:
                compiled = self._held[spec][0]
            return compiled

    def compile(self, spec: GrammarSpec, owner: str | None = None) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached; a miss compiles in the calling thread and is
        charged to ``owner``'s quota).

        Raises:
            InvalidRequest: past a limit, or xgrammar rejects the schema or structural tag.
        """
        compiled = self.cached(spec)
        if compiled is not None:
            return compiled
        source = self.check(spec)
        with self._lock:
            compiler = self._compiler or self._load()
        try:
            compiled = _compile(compiler, spec, source)
        except InvalidRequest:
            with self._lock:
                self.num_compiles += 1
                self.num_rejections += 1
            raise
        with self._lock:
            self.num_compiles += 1
            self._compiled.put(spec, compiled, _size(compiled), owner)
        return compiled

    @contextlib.contextmanager
    def hold(self, spec: GrammarSpec, compiled: xgrammar.CompiledGrammar) -> Iterator[None]:
        """Keep ``compiled`` for ``matcher(spec)`` while inside, even if the cache evicts it
        (another owner's compile between this request's compile and its admission)."""
        with self._lock:
            _, count = self._held.get(spec, (compiled, 0))
            self._held[spec] = (compiled, count + 1)
        try:
            yield
        finally:
            with self._lock:
                compiled, count = self._held[spec]
                if count > 1:
                    self._held[spec] = (compiled, count - 1)
                else:
                    del self._held[spec]

    def stats(self) -> GrammarStats:
        """The counters, taken under the lock."""
        with self._lock:
            return GrammarStats(self._compiled.bytes, len(self._compiled), self._compiled.capacity_bytes,
                                self._compiled.evictions, self.num_compiles, self.num_rejections)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar.

        Raises:
            InvalidRequest: as ``compile``.
        """
        import xgrammar

        compiled = self.compile(spec)
        return GrammarMatcher(xgrammar.GrammarMatcher(compiled), self._batch)

    def _load(self) -> xgrammar.GrammarCompiler:
        """Build the compiler (under the lock): load the tokenizer, describe its vocabulary."""
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir))
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_token_ids) or None
        )
        # One thread per compile (the pool runs compile_workers of them at once); no cache of
        # xgrammar's own: it has no bound by default, and ours is bounded per owner.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher("auto")  # half the host's hardware threads
        return self._compiler


def _size(compiled: xgrammar.CompiledGrammar) -> int:
    """The compiled grammar's measured bytes (xgrammar's count; 1 if it has none)."""
    return max(1, int(getattr(compiled, "memory_size_bytes", 1)))


def _compile(compiler: xgrammar.GrammarCompiler, spec: GrammarSpec, source: Any) -> xgrammar.CompiledGrammar:
    try:
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(source, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        return compiler.compile_structural_tag(spec.source)
    except (RuntimeError, ValueError, TypeError) as exc:
        # xgrammar's own errors (invalid schema, unsupported keyword) derive from these.
        raise InvalidRequest(f"grammar: the {spec.kind.replace('_', ' ')} cannot be compiled: {_reason(exc)}") from exc


def _reason(exc: Exception) -> str:
    """xgrammar's message without its log prefix (``[12:00:00] /project/cpp/x.cc:12: ...``)."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: .* is false: ", "", text)

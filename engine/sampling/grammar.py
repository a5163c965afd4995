"""Constrained decoding: ``GrammarSpec`` compiled with xgrammar, one matcher per request.

A request whose ``SamplingParams.grammar`` is set gets a ``GrammarMatcher`` when it is added.
Each step the sampler asks it for the bitmask of the tokens allowed next (``fill``, on the host,
while the step's forward runs on the device: ``engine.sampling.logits_processors``), and the engine feeds
it every sampled token (``accept``). The request finishes once the grammar is complete (its
matcher accepted a stop token), so a JSON answer ends where its JSON ends.

``GrammarBackend`` compiles against the served model's tokenizer, loaded on first use (a model
that never sees a grammar never imports xgrammar), and keeps the ``_CACHE_SIZE`` most recent
compiled grammars: an agent sends the same schemas and tools on every turn. It is thread-safe:
``EngineClient`` compiles in a worker thread before the request reaches the engine thread, so a
slow compile (or a schema xgrammar rejects) never stalls a step.

The bitmask is xgrammar's layout: ``[rows, ceil(V / 32)]`` int32, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed. Ids past the tokenizer's vocabulary (embedding rows
padded to a multiple of 64) are never allowed.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from phloem.engine.errors import InvalidRequest
from phloem.engine.sampling.params import GrammarSpec

if TYPE_CHECKING:
    import xgrammar

__all__ = ["GrammarBackend", "GrammarMatcher", "bitmask_width", "fill_bitmask"]

_CACHE_SIZE = 256
# Consecutive whitespace a JSON schema grammar allows: pretty-printed JSON nested seven levels at
# indent 2 fits, and a model cannot loop on whitespace forever.
MAX_JSON_WHITESPACE = 16


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


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

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return bool(self.handle.is_terminated())


class GrammarBackend:
    """Compiles grammars for one model's tokenizer (see the module docstring).

    Args:
        tokenizer_dir: The model folder whose tokenizer the grammars are compiled against.
        vocab_size: The model's vocabulary (logits width), which may exceed the tokenizer's.
        stop_token_ids: Tokens that end a completed grammar (the model's EOS tokens); empty:
            the tokenizer's own EOS.
    """

    def __init__(self, tokenizer_dir: str | Path, vocab_size: int, stop_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._batch: xgrammar.BatchGrammarMatcher | None = None
        self._compiled: OrderedDict[GrammarSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self.num_compiles = 0

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``spec`` (cached).

        Raises:
            InvalidRequest: xgrammar rejects the schema or structural tag.
        """
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
            compiler = self._compiler or self._load()
        compiled = _compile(compiler, spec)
        with self._lock:
            self.num_compiles += 1
            self._compiled[spec] = compiled
            while len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

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
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self._batch = xgrammar.BatchGrammarMatcher("auto")  # half the host's hardware threads
        return self._compiler


def _compile(compiler: xgrammar.GrammarCompiler, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
    try:
        source: Any = json.loads(spec.source)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"grammar: expected JSON text, got {spec.source[:80]!r}: {exc}") from exc
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

"""Sessions as first-class objects: lifecycle, pins/TTL, fork, chat templates -> token ids.

Role: ``SessionManager`` owns every session (its exact token ids, turns, chat context, pin and
TTL) over one ``runtime.EngineClient``; ``Generation`` drives one engine request and streams its
text, split into reasoning, content and tool calls, its output constrained by
``response_format`` / ``tool_choice``. Errors are one shallow family (``sessions.errors``) that
``api`` maps to HTTP.

Layout, top to bottom (each imports only what is below it; the ``layers`` contract in
pyproject.toml checks it, type-only imports counted, and ``tools/check_import_cycles.py
--count-type-imports phloem.sessions`` finds any cycle):

- the core: ``manager``; ``_turns`` (one append or completion), ``_forks``; ``generation``,
  ``options``, ``_inputs``, ``_prefill``, ``_shared_prefixes``;
- ``sessions.tiers``: where a session's state lives — pins (``_pins``), spilling to host memory
  and disk and resuming (``spill``, ``_segments``, ``_flush``, ``_tier_moves``), and the durable
  journal + index (``store``);
- the records: ``_events`` (log lines and counters), ``session`` (``Session``,
  ``SpilledSegment``, the frozen snapshots);
- ``sessions.text``: tokenizer, chat templates (``chat``, ``_special_text``), output parsing
  (``output_parser``, ``tool_parsers``), ``structured`` output, the tokenize pool;
- ``errors``, ``config``.

A lower module that must name a higher one's type owns a protocol for it
(``session.RunningGeneration``, ``_events.TokenCounts``) or takes a callback
(``tiers._flush.flush_to_disk``).

May import: ``phloem.runtime``, ``phloem.storage``, and the engine's public request types that
``EngineClient`` speaks (``SamplingParams``, ``EngineError`` and its subclasses).
"""

from __future__ import annotations

from phloem.sessions.text.chat import ChatContext, render_append
from phloem.sessions.errors import (
    ContextLengthExceeded, GenerationFailed, InvalidInput, Overloaded, SessionBusy, SessionError,
    SessionNotFound,
)
from phloem.sessions.generation import (
    GenerateOptions, Generation, GenerationResult, OutputDelta, Usage,
)
from phloem.sessions.text.output_parser import OutputFormat, ParsedDelta, ParsedOutput, ToolCallDelta
from phloem.sessions.text.structured import ResponseFormat, ToolChoice
from phloem.sessions.text.tool_parsers import ParsedToolCall
from phloem.sessions._events import SessionStats, TierCounts
from phloem.sessions._inputs import SessionInput
from phloem.sessions.config import KEEP, SessionConfig
from phloem.sessions.manager import SessionManager
from phloem.sessions.session import (
    FinishReason, SessionSnapshot, SessionStatus, TurnInfo,
)
from phloem.sessions.tiers.store import model_fingerprint
from phloem.sessions.text.tokenizer import IncrementalDetokenizer, Message, Tokenizer, ToolSpec

__all__ = [
    "KEEP", "ChatContext", "ContextLengthExceeded", "FinishReason", "GenerateOptions",
    "Generation", "GenerationFailed", "GenerationResult", "IncrementalDetokenizer", "InvalidInput",
    "Message", "OutputDelta", "OutputFormat", "Overloaded", "ParsedDelta", "ParsedOutput",
    "ParsedToolCall", "ResponseFormat", "SessionBusy", "SessionConfig", "SessionError",
    "SessionInput", "SessionManager", "SessionNotFound", "SessionSnapshot", "SessionStats",
    "SessionStatus", "TierCounts", "Tokenizer", "ToolCallDelta", "ToolChoice", "ToolSpec",
    "TurnInfo", "Usage", "model_fingerprint", "render_append",
]

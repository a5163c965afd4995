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

from typing import TYPE_CHECKING

from phloem._lazy import lazy_exports

if TYPE_CHECKING:
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
    from phloem.sessions._served import ServedStats
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
    "ServedStats", "SessionInput", "SessionManager", "SessionNotFound", "SessionSnapshot", "SessionStats",
    "SessionStatus", "TierCounts", "Tokenizer", "ToolCallDelta", "ToolChoice", "ToolSpec",
    "TurnInfo", "Usage", "model_fingerprint", "render_append",
]

# Every name loads on first access: ``SessionConfig`` (``sessions.config``) imports without torch,
# so the CLI builds its configuration before anything heavy loads.
_LAZY = {
    "ChatContext": "phloem.sessions.text.chat",
    "render_append": "phloem.sessions.text.chat",
    "ContextLengthExceeded": "phloem.sessions.errors",
    "GenerationFailed": "phloem.sessions.errors",
    "InvalidInput": "phloem.sessions.errors",
    "Overloaded": "phloem.sessions.errors",
    "SessionBusy": "phloem.sessions.errors",
    "SessionError": "phloem.sessions.errors",
    "SessionNotFound": "phloem.sessions.errors",
    "GenerateOptions": "phloem.sessions.generation",
    "Generation": "phloem.sessions.generation",
    "GenerationResult": "phloem.sessions.generation",
    "OutputDelta": "phloem.sessions.generation",
    "Usage": "phloem.sessions.generation",
    "OutputFormat": "phloem.sessions.text.output_parser",
    "ParsedDelta": "phloem.sessions.text.output_parser",
    "ParsedOutput": "phloem.sessions.text.output_parser",
    "ToolCallDelta": "phloem.sessions.text.output_parser",
    "ResponseFormat": "phloem.sessions.text.structured",
    "ToolChoice": "phloem.sessions.text.structured",
    "ParsedToolCall": "phloem.sessions.text.tool_parsers",
    "SessionStats": "phloem.sessions._events",
    "TierCounts": "phloem.sessions._events",
    "ServedStats": "phloem.sessions._served",
    "SessionInput": "phloem.sessions._inputs",
    "KEEP": "phloem.sessions.config",
    "SessionConfig": "phloem.sessions.config",
    "SessionManager": "phloem.sessions.manager",
    "FinishReason": "phloem.sessions.session",
    "SessionSnapshot": "phloem.sessions.session",
    "SessionStatus": "phloem.sessions.session",
    "TurnInfo": "phloem.sessions.session",
    "model_fingerprint": "phloem.sessions.tiers.store",
    "IncrementalDetokenizer": "phloem.sessions.text.tokenizer",
    "Message": "phloem.sessions.text.tokenizer",
    "Tokenizer": "phloem.sessions.text.tokenizer",
    "ToolSpec": "phloem.sessions.text.tokenizer",
}


__getattr__ = lazy_exports(__name__, _LAZY)

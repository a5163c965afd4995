"""Sessions as first-class objects: lifecycle, pins/TTL, fork, chat templates -> token ids.

Role: ``SessionManager`` owns every session (its exact token ids, turns, chat context, pin and
TTL) over one ``runtime.EngineClient``; ``Generation`` drives one engine request and streams its
text, split into reasoning, content and tool calls (``output_parser``, ``tool_parsers``), its
output constrained by ``response_format`` / ``tool_choice`` (``structured``); ``Tokenizer`` / ``IncrementalDetokenizer`` / ``sessions.chat`` turn messages into tokens
and tokens into text; ``sessions.store`` makes every acknowledged turn durable (journal + index);
``sessions.spill`` moves idle sessions' state to host memory and disk and resumes it.
Errors are one shallow family (``sessions.errors``) that ``api`` maps to HTTP.

May import: ``phloem.runtime``, ``phloem.storage``, and the engine's public request types that
``EngineClient`` speaks (``SamplingParams``, ``EngineError`` and its subclasses).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phloem.sessions.chat import ChatContext, render_append
    from phloem.sessions.errors import (
        ContextLengthExceeded, GenerationFailed, InvalidInput, Overloaded, SessionBusy, SessionError,
        SessionNotFound,
    )
    from phloem.sessions.generation import (
        GenerateOptions, Generation, GenerationResult, OutputDelta, Usage,
    )
    from phloem.sessions.output_parser import OutputFormat, ParsedDelta, ParsedOutput, ToolCallDelta
    from phloem.sessions.structured import ResponseFormat, ToolChoice
    from phloem.sessions.tool_parsers import ParsedToolCall
    from phloem.sessions._events import SessionStats, TierCounts
    from phloem.sessions._inputs import SessionInput
    from phloem.sessions.config import KEEP, SessionConfig
    from phloem.sessions.manager import SessionManager
    from phloem.sessions.session import (
        FinishReason, SessionSnapshot, SessionStatus, TurnInfo,
    )
    from phloem.sessions.store import model_fingerprint
    from phloem.sessions.tokenizer import IncrementalDetokenizer, Message, Tokenizer, ToolSpec

__all__ = [
    "KEEP", "ChatContext", "ContextLengthExceeded", "FinishReason", "GenerateOptions",
    "Generation", "GenerationFailed", "GenerationResult", "IncrementalDetokenizer", "InvalidInput",
    "Message", "OutputDelta", "OutputFormat", "Overloaded", "ParsedDelta", "ParsedOutput",
    "ParsedToolCall", "ResponseFormat", "SessionBusy", "SessionConfig", "SessionError",
    "SessionInput", "SessionManager", "SessionNotFound", "SessionSnapshot", "SessionStats",
    "SessionStatus", "TierCounts", "Tokenizer", "ToolCallDelta", "ToolChoice", "ToolSpec",
    "TurnInfo", "Usage", "model_fingerprint", "render_append",
]

# Every name loads on first access: ``SessionConfig`` (``sessions.config``) imports without torch,
# so the CLI builds its configuration before anything heavy loads.
_LAZY = {
    "ChatContext": "phloem.sessions.chat",
    "render_append": "phloem.sessions.chat",
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
    "OutputFormat": "phloem.sessions.output_parser",
    "ParsedDelta": "phloem.sessions.output_parser",
    "ParsedOutput": "phloem.sessions.output_parser",
    "ToolCallDelta": "phloem.sessions.output_parser",
    "ResponseFormat": "phloem.sessions.structured",
    "ToolChoice": "phloem.sessions.structured",
    "ParsedToolCall": "phloem.sessions.tool_parsers",
    "SessionStats": "phloem.sessions._events",
    "TierCounts": "phloem.sessions._events",
    "SessionInput": "phloem.sessions._inputs",
    "KEEP": "phloem.sessions.config",
    "SessionConfig": "phloem.sessions.config",
    "SessionManager": "phloem.sessions.manager",
    "FinishReason": "phloem.sessions.session",
    "SessionSnapshot": "phloem.sessions.session",
    "SessionStatus": "phloem.sessions.session",
    "TurnInfo": "phloem.sessions.session",
    "model_fingerprint": "phloem.sessions.store",
    "IncrementalDetokenizer": "phloem.sessions.tokenizer",
    "Message": "phloem.sessions.tokenizer",
    "Tokenizer": "phloem.sessions.tokenizer",
    "ToolSpec": "phloem.sessions.tokenizer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'phloem.sessions' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

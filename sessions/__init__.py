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

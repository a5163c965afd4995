"""The Python SDK of the native API: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Import it from ``phloem.api`` (``from phloem.api import Client``); docs/sdk.md is the guide.
``_transport`` holds everything the two clients share without I/O (requests, retries, error
mapping, stream events); ``_sync`` and ``_async`` are the I/O shells over it, independent of
each other; ``_errors`` holds the exceptions.

May import: ``phloem.api.schemas`` (the wire schemas it shares with the server), httpx,
websockets and msgspec. Never ``phloem.api.server``, ``phloem.sessions``, ``phloem.runtime``,
``phloem.engine`` or ``phloem.kernels`` (an import-linter contract): the SDK installs and imports
without torch.
"""

from phloem.api.schemas import (
    AppendResult, ChatMessage, DeltaEvent, FunctionCall, GenerateParams, SessionInfo,
    TokenLogprobs, ToolCall, Turn,
)
from phloem.api.sdk._async import AsyncClient, AsyncSession, AsyncSessions, AsyncStream
from phloem.api.sdk._errors import (
    APIConnectionError, ContextLengthExceeded, Forbidden, IdempotencyConflict, InternalError,
    InvalidRequest, NotFound, Overloaded, PayloadTooLarge, PhloemError, RateLimited, SessionBusy,
    SessionNotFound, Unauthorized,
)
from phloem.api.sdk._sync import Client, Session, Sessions, Stream

__all__ = [
    "APIConnectionError", "AppendResult", "AsyncClient", "AsyncSession", "AsyncSessions",
    "AsyncStream", "ChatMessage", "Client", "ContextLengthExceeded", "DeltaEvent", "Forbidden",
    "FunctionCall", "GenerateParams", "IdempotencyConflict", "InternalError", "InvalidRequest",
    "NotFound", "Overloaded", "PayloadTooLarge", "PhloemError", "RateLimited", "Session",
    "SessionBusy", "SessionInfo", "SessionNotFound", "Sessions", "Stream", "TokenLogprobs",
    "ToolCall", "Turn", "Unauthorized",
]

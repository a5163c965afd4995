"""The sessions layer's error hierarchy: one shallow family that ``api`` maps to HTTP statuses.

Every error a caller of ``SessionManager`` can act on is a ``SessionError``; the message states
what was expected and what was received. Only ``api`` knows HTTP: it maps each class to a wire
code (``SessionNotFound`` -> 404 ``session_not_found`` and so on) in one table.
"""

from __future__ import annotations

__all__ = [
    "ContextLengthExceeded",
    "GenerationFailed",
    "InvalidInput",
    "Overloaded",
    "SessionBusy",
    "SessionError",
    "SessionNotFound",
]


class SessionError(Exception):
    """Base class of every error the sessions layer raises on purpose."""


class SessionNotFound(SessionError):
    """No session with this id belongs to the caller (or it was deleted)."""


class SessionBusy(SessionError):
    """A generation (or another append) is already running on the session."""


class InvalidInput(SessionError, ValueError):
    """The input can never be served as given (bad token id, unknown turn, template misuse...)."""


class ContextLengthExceeded(InvalidInput):
    """The session's tokens plus the new input do not fit the model's context window."""


class Overloaded(SessionError):
    """No capacity now (too many generations in flight, or shutting down); retry later.

    Args:
        message: What ran out.
        retry_after: Seconds after which a retry is sensible.
    """

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class GenerationFailed(SessionError):
    """The engine or the session store failed mid-request; nothing was committed."""

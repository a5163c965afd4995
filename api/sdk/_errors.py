"""The SDK's exceptions: one class per wire ``ErrorCode``, built from a problem+json body.

Mapping is by ``code``, never by status, so a server that sends a code with another status still
raises the right type; a body that is not problem+json (a proxy's HTML page) falls back to the
status. Errors the SDK finds before sending (a bad ``GenerateParams``) are ``InvalidRequest`` with
``status=None``, and network failures after the last retry are ``APIConnectionError``.
"""

from __future__ import annotations

import email.utils
import time

import msgspec

from phloem.api.schemas import ERROR_STATUS, ErrorCode, ErrorEvent, Problem

__all__ = [
    "APIConnectionError", "ContextLengthExceeded", "Forbidden", "IdempotencyConflict",
    "InternalError", "InvalidRequest", "NotFound", "Overloaded", "PayloadTooLarge", "PhloemError",
    "RateLimited", "SessionBusy", "SessionNotFound", "Unauthorized", "error_from_event",
    "error_from_response", "parse_retry_after",
]


class PhloemError(Exception):
    """Base of every SDK error.

    Attributes:
        code: The stable error code (an ``ErrorCode`` value, or ``"connection_error"``).
        status: The HTTP status, or None when no response was received or the error came in-stream.
        detail: What went wrong, from the server's ``detail`` or ``message``.
        retry_after: Seconds the server asked to wait (``Retry-After``), if it did.
        request_id: The server's id of the failed request (its ``X-Request-Id``), to quote
            when reporting the error; None for in-stream errors and when unknown.
    """

    def __init__(
        self, detail: str, *, code: str, status: int | None = None, retry_after: float | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"[{code}] {detail}")
        self.code = code
        self.status = status
        self.detail = detail
        self.retry_after = retry_after
        self.request_id = request_id


class InvalidRequest(PhloemError):
    """The request was malformed or failed validation (400), or its body was not JSON (415)."""


class Unauthorized(PhloemError):
    """No API key, or an unknown one (401)."""


class Forbidden(PhloemError):
    """The API key may not do this (403)."""


class NotFound(PhloemError):
    """The route or resource does not exist (404)."""


class SessionNotFound(NotFound):
    """No session with this id belongs to the API key (404)."""


class SessionBusy(PhloemError):
    """The session already runs a generation (409)."""


class ContextLengthExceeded(InvalidRequest):
    """The session's tokens plus the new input do not fit the model's context window (400)."""


class PayloadTooLarge(PhloemError):
    """The request body exceeds the server's limit (413)."""


class IdempotencyConflict(PhloemError):
    """The ``Idempotency-Key`` was already used with a different request (422)."""


class RateLimited(PhloemError):
    """Too many requests for this API key (429); ``retry_after`` says when to come back."""


class InternalError(PhloemError):
    """The server failed (500)."""


class Overloaded(PhloemError):
    """The server has no capacity now (503); ``retry_after`` says when to come back."""


class APIConnectionError(PhloemError):
    """The server could not be reached, or a stream broke before its final event."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail, code="connection_error")


_BY_CODE: dict[str, type[PhloemError]] = {
    ErrorCode.INVALID_REQUEST: InvalidRequest,
    ErrorCode.UNAUTHORIZED: Unauthorized,
    ErrorCode.FORBIDDEN: Forbidden,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.SESSION_NOT_FOUND: SessionNotFound,
    ErrorCode.SESSION_BUSY: SessionBusy,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: ContextLengthExceeded,
    ErrorCode.PAYLOAD_TOO_LARGE: PayloadTooLarge,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: InvalidRequest,
    ErrorCode.IDEMPOTENCY_CONFLICT: IdempotencyConflict,
    ErrorCode.RATE_LIMITED: RateLimited,
    ErrorCode.INTERNAL_ERROR: InternalError,
    ErrorCode.OVERLOADED: Overloaded,
}
# For bodies that are not problem+json: the first (generic) code listed for a status wins.
_CODE_BY_STATUS = {status: code for code, status in reversed(list(ERROR_STATUS.items()))}
_problem_decoder = msgspec.json.Decoder(Problem)


def parse_retry_after(value: str | None) -> float | None:
    """Read a ``Retry-After`` header: delay seconds (integer or decimal) or an HTTP date.

    Args:
        value: The header value, or None when absent.

    Returns:
        Seconds to wait (never negative), or None when absent or unreadable.
    """
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def error_from_response(status: int, body: bytes, retry_after: str | None) -> PhloemError:
    """Build the exception for an error response.

    Args:
        status: The HTTP status (400 or more).
        body: The response body, normally ``application/problem+json``.
        retry_after: The ``Retry-After`` header, if any.

    Returns:
        The exception of the body's ``code``; when the body is not a Problem, the one of the
        status (``InternalError`` for other 5xx, plain ``PhloemError`` for other 4xx).
    """
    request_id = None
    try:
        problem = _problem_decoder.decode(body)
        code, detail, request_id = problem.code, problem.detail, problem.request_id
    except msgspec.DecodeError:
        fallback = ErrorCode.INTERNAL_ERROR if status >= 500 else f"http_{status}"
        code = _CODE_BY_STATUS.get(status, fallback)
        detail = body.decode("utf-8", "replace")[:500] or f"HTTP {status}"
    cls = _BY_CODE.get(code, PhloemError)
    return cls(detail, code=str(code), status=status, retry_after=parse_retry_after(retry_after),
               request_id=request_id)


def error_from_event(event: ErrorEvent) -> PhloemError:
    """Build the exception for an in-stream ``error`` event (SSE or WebSocket).

    Args:
        event: The decoded event.

    Returns:
        The exception of the event's ``code``, with ``status=None``.
    """
    cls = _BY_CODE.get(event.code, PhloemError)
    return cls(event.message, code=event.code, retry_after=event.retry_after)

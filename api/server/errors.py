"""The one map from exceptions to wire errors: problem+json (native) or OpenAI's envelope.

Only ``api`` knows HTTP. Every exception that reaches a route's caller is classified once
(``classify``) into an ``ErrorCode``, a human ``detail`` and an optional ``retry_after``; the
status follows from the code (``schemas.ERROR_STATUS``). Native routes answer
``application/problem+json``; the OpenAI-compatible routes (``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, ``/v1/responses``) answer ``{"error": {"message", "type",
"param", "code"}}``, which the stock ``openai`` client turns into its typed exceptions (its
``request_id`` comes from the ``X-Request-Id`` header; problem+json bodies also carry it); the
Anthropic route (``/v1/messages``) answers ``{"type": "error", "error": {"type", "message"}}``
with Anthropic's error types. WebSocket and SSE error events use the same classification.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import (
    ClientException, HTTPException, MethodNotAllowedException, NotFoundException,
    SerializationException, ValidationException,
)
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, OpenAPIType, Operation, Schema

from phloem.api.schemas import (
    ERROR_STATUS, PROBLEM_CONTENT_TYPE, ErrorCode, Problem, make_problem,
)
from phloem.api.server.anthropic.schemas import AnthropicError
from phloem.api.server.openai.schemas import OpenAIError
from phloem.runtime.logs import current_request_id
from phloem.sessions import (
    ContextLengthExceeded, GenerationFailed, InvalidInput, Overloaded, SessionBusy, SessionError,
    SessionNotFound,
)

__all__ = ["ANTHROPIC_PATHS", "OPENAI_PATHS", "ApiError", "StreamingOperation", "anthropic_error_type",
           "anthropic_errors", "classify", "error_response", "exception_handler", "malformed_json",
           "openai_errors", "problem_response", "problems"]

logger = logging.getLogger(__name__)

OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses")
ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


class ApiError(Exception):
    """An error the API layer itself raises (a bad header, an idempotency conflict...).

    Args:
        code: The wire code; it fixes the status.
        detail: What was expected and what was received.
        retry_after: Seconds to wait before retrying, for 429/503.
    """

    def __init__(self, code: ErrorCode, detail: str, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.retry_after = retry_after


_SESSION_CODES: tuple[tuple[type[SessionError], ErrorCode], ...] = (
    (SessionNotFound, ErrorCode.SESSION_NOT_FOUND),
    (SessionBusy, ErrorCode.SESSION_BUSY),
    (ContextLengthExceeded, ErrorCode.CONTEXT_LENGTH_EXCEEDED),
    (InvalidInput, ErrorCode.INVALID_REQUEST),
    (Overloaded, ErrorCode.OVERLOADED),
    (GenerationFailed, ErrorCode.INTERNAL_ERROR),
)
_CODE_BY_STATUS = {
    400: ErrorCode.INVALID_REQUEST, 401: ErrorCode.UNAUTHORIZED, 403: ErrorCode.FORBIDDEN,
    404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED,
    413: ErrorCode.PAYLOAD_TOO_LARGE, 415: ErrorCode.UNSUPPORTED_MEDIA_TYPE,
    429: ErrorCode.RATE_LIMITED, 503: ErrorCode.OVERLOADED,
}


def classify(exc: BaseException) -> tuple[ErrorCode, str, float | None]:
    """The wire code, detail and ``retry_after`` of an exception.

    Args:
        exc: Anything raised while serving a request.

    Returns:
        ``(code, detail, retry_after)``; unknown exceptions are ``internal_error`` (logged).
    """
    if isinstance(exc, ApiError):
        return exc.code, exc.detail, exc.retry_after
    if isinstance(exc, SessionError):
        code = next(c for kind, c in _SESSION_CODES if isinstance(exc, kind))
        retry_after = exc.retry_after if isinstance(exc, Overloaded) else None
        return code, str(exc), retry_after
    if isinstance(exc, ValidationException):
        return ErrorCode.INVALID_REQUEST, _validation_detail(exc), None
    if isinstance(exc, RecursionError):
        # msgspec refuses JSON nested beyond its limit (and a template would overflow on it).
        logger.warning("refused a request nested too deeply: %s", exc)
        return ErrorCode.INVALID_REQUEST, "the request is nested too deeply (JSON objects or arrays inside each other)", None
    if isinstance(exc, ClientException) and isinstance(exc.__cause__, SerializationException):
        # Litestar's own decoding of ``data`` found the body is not JSON.
        return ErrorCode.INVALID_REQUEST, malformed_json(str(exc.detail)), None
    if isinstance(exc, UnicodeDecodeError):
        # msgspec before 0.23 raises it (not a DecodeError) for a body that is not UTF-8.
        return ErrorCode.INVALID_REQUEST, malformed_json("Invalid UTF-8 encoded string"), None
    if isinstance(exc, NotFoundException):
        return ErrorCode.NOT_FOUND, "no such route", None
    if isinstance(exc, MethodNotAllowedException):
        return ErrorCode.METHOD_NOT_ALLOWED, str(exc.detail), None
    if isinstance(exc, HTTPException):
        status = exc.status_code
        code = _CODE_BY_STATUS.get(status, ErrorCode.INVALID_REQUEST if status < 500
                                   else ErrorCode.INTERNAL_ERROR)
        if code is ErrorCode.PAYLOAD_TOO_LARGE:
            return code, "the request body exceeds the server's limit", None
        return code, str(exc.detail), 1.0 if status in (429, 503) else None
    logger.error("unhandled error", exc_info=exc)
    return ErrorCode.INTERNAL_ERROR, f"internal error: {type(exc).__name__}", None


_BYTE_AT = re.compile(r"^(.*) \(byte (\d+)\)$")


def malformed_json(message: str, what: str = "body") -> str:
    """The one detail of a body (or WebSocket message) that is not JSON, whichever decoder
    (msgspec directly, or through Litestar) found it and however it put it.

    Args:
        message: msgspec's message: ``Input data was truncated`` or ``JSON is malformed: ... (byte N)``.
        what: What was decoded.

    Returns:
        ``<what>: expected a JSON object, got malformed JSON: <reason>[ at byte N]``.
    """
    reason = message.removeprefix("JSON is malformed: ")
    if reason == "Input data was truncated":
        # msgspec says so also of an unpaired UTF-16 surrogate escape, which a client rarely suspects.
        reason = "it ends early, or holds an invalid escape such as an unpaired UTF-16 surrogate (\\ud800)"
    if (at := _BYTE_AT.match(reason)) is not None:
        reason = f"{at[1]} at byte {at[2]}"
    return f"{what}: expected a JSON object, got malformed JSON: {reason}"


def _validation_detail(exc: ValidationException) -> str:
    extra: Any = exc.extra
    if not isinstance(extra, list) or not extra:
        return str(exc.detail)
    if any(item.get("key") == "data" for item in extra) and "missing required field `data`" in str(exc.__cause__):
        return "body: expected a JSON object, got an empty body"
    parts = []
    for item in extra:
        message, key, source = item.get("message"), item.get("key"), str(item.get("source", ""))
        if source.endswith("body") and key == "data" and message == "'data'":
            # Litestar's word for a required body that is empty.
            parts.append("body: expected a JSON object, got an empty body")
        elif source.endswith("body") and key not in (None, "data"):
            parts.append(f"{message} - at `$.{key}`")
        elif source.endswith("body"):
            parts.append(str(message))
        else:
            parts.append(f"{message} - at {source.rpartition('.')[2].lower() or 'query'} parameter `{key}`")
    return "; ".join(parts)


def _headers(code: ErrorCode, retry_after: float | None) -> dict[str, str]:
    headers = {}
    if retry_after is not None:
        headers["Retry-After"] = str(max(0, math.ceil(retry_after)))
    if code is ErrorCode.UNAUTHORIZED:
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def problem_response(code: ErrorCode, detail: str, retry_after: float | None = None) -> Response[bytes]:
    """A problem+json response for ``code``.

    Args:
        code: The wire code.
        detail: Human text.
        retry_after: Sent as ``Retry-After`` (whole seconds), if given.

    Returns:
        The response, with the code's status; the body's ``request_id`` is the id of the
        request being served (``X-Request-Id``).
    """
    body = msgspec.json.encode(make_problem(code, detail, current_request_id()))
    return Response(body, status_code=ERROR_STATUS[code], media_type=PROBLEM_CONTENT_TYPE,
                    headers=_headers(code, retry_after))


def openai_error_response(code: ErrorCode, detail: str,
                          retry_after: float | None = None) -> Response[bytes]:
    """The same error in OpenAI's ``{"error": {...}}`` envelope."""
    status = ERROR_STATUS[code]
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": detail, "type": kind, "param": None, "code": code.value}}
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json",
                    headers=_headers(code, retry_after))


def anthropic_error_type(code: ErrorCode) -> str:
    """Anthropic's error ``type`` for ``code`` (by its status; ``api_error`` for the rest)."""
    status = ERROR_STATUS[code]
    return _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_response(path: str, exc: BaseException) -> Response[bytes]:
    """The error response for ``exc`` raised while serving ``path``."""
    code, detail, retry_after = classify(exc)
    if path.startswith(OPENAI_PATHS):
        return openai_error_response(code, detail, retry_after)
    if path.startswith(ANTHROPIC_PATHS):
        body = {"type": "error", "error": {"type": anthropic_error_type(code), "message": detail}}
        return Response(msgspec.json.encode(body), status_code=ERROR_STATUS[code],
                        media_type="application/json", headers=_headers(code, retry_after))
    return problem_response(code, detail, retry_after)


def exception_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[bytes]:
    """Litestar's handler for every exception (registered for ``Exception``)."""
    return error_response(request.url.path, exc)


def problems(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI: the problem+json answers a native route may give (its ``responses=``)."""
    return {status: ResponseSpec(Problem, generate_examples=False, media_type=PROBLEM_CONTENT_TYPE,
                                 description=HTTPStatus(status).phrase) for status in statuses}


def openai_errors(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI: the error envelopes an OpenAI-compatible route may answer."""
    return {status: ResponseSpec(OpenAIError, generate_examples=False,
                                 description=HTTPStatus(status).phrase) for status in statuses}


def anthropic_errors(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI: the error envelopes an Anthropic-compatible route may answer."""
    return {status: ResponseSpec(AnthropicError, generate_examples=False,
                                 description=HTTPStatus(status).phrase) for status in statuses}


# One server-sent event: before OpenAPI 3.2 (``itemSchema``) the ``schema`` of a
# ``text/event-stream`` describes each event, which clients and checkers read as these fields.
_SSE_EVENT = Schema(type=OpenAPIType.OBJECT, properties={
    "data": Schema(type=OpenAPIType.STRING), "event": Schema(type=OpenAPIType.STRING),
    "id": Schema(type=OpenAPIType.STRING), "retry": Schema(type=OpenAPIType.INTEGER)})


@dataclass
class StreamingOperation(Operation):
    """OpenAPI operation whose 200 may also be a ``text/event-stream`` (``"stream": true``)."""

    def __post_init__(self) -> None:
        ok = (self.responses or {}).get("200")
        if isinstance(ok, OpenAPIResponse):
            ok.content = {**(ok.content or {}), "text/event-stream": OpenAPIMediaType(schema=_SSE_EVENT)}

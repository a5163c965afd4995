"""Process logs: one line per record, human ``text`` or ``json``; request ids; event records.

``phloem serve --log-format text|json --log-level LEVEL`` (``HttpConfig.log_format`` /
``log_level``) installs one stderr handler on the root logger for the life of the server
(``stderr_logging``); uvicorn's own loggers propagate to it, so every line has one format::

    text  2025-06-01T12:00:00.123Z INFO phloem.api.access [req_5f0c…] http.request method=POST path=/v1/sessions status=201 duration_ms=12.31
    json  {"ts": "2025-06-01T12:00:00.123Z", "level": "info", "logger": "phloem.api.access", "msg": "http.request", "request_id": "req_5f0c…", "method": "POST", ...}

Events (``log_event``) are the records meant for machines: a dotted name (``http.request``,
``session.created``, ``generation.finished``...) and fields. In text the message is the name
followed by ``key=value`` pairs (a value with spaces, quotes or control characters is written
as a JSON string, so a hostile path cannot forge a line; a list is comma-joined); in JSON the name is ``msg`` and the
fields are top-level keys.

Request ids: ``bind_request_id`` scopes the id of the request being served to the current
context (a ``ContextVar``). asyncio tasks copy the context they are created in, so work a
request starts (its generation) logs under that request's id; the engine thread logs without
one. Every record written by the handler carries ``request_id`` when there is one.

Third-party lines: uvicorn's propagate to the same handler (``uvicorn.error`` is renamed
``uvicorn``: it carries every uvicorn line but the access log, which ``phloem serve`` turns off);
libraries that write to stderr with a handler of their own (transformers) are adopted by
``adopt_library_loggers`` once imported, so they follow ``--log-format`` and ``--log-level`` too.

Decision: ``stderr_logging`` is a context manager that removes its handler on exit and is a
no-op when one is already installed, so the CLI and ``api.app.serve`` can both wrap the server
and tests that call them in process get their logging back unchanged. In ``json`` mode Python
warnings are routed through logging too (``logging.captureWarnings``), so stderr stays JSON.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any


__all__ = ["LOG_FORMATS", "LOG_LEVELS", "JsonFormatter", "TextFormatter", "adopt_library_loggers", "bind_request_id",
           "current_request_id", "log_event", "stderr_logging"]

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")

_REQUEST_ID: ContextVar[str | None] = ContextVar("phloem_request_id", default=None)
# A text value written bare; anything else is quoted as a JSON string.
_BARE = re.compile(r"[\w.:/{}@+=,-]+")
_BASE_KEYS = ("ts", "level", "logger", "msg", "request_id")


def current_request_id() -> str | None:
    """The id of the request being served in this context, if any."""
    return _REQUEST_ID.get()


@contextlib.contextmanager
def bind_request_id(request_id: str | None) -> Iterator[None]:
    """Make ``request_id`` the current request's id inside the block (and in the tasks it starts).

    Args:
        request_id: The id; None clears it.
    """
    token = _REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        _REQUEST_ID.reset(token)


def log_event(logger: logging.Logger, event: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event record: ``event`` and its ``fields`` (see the module docstring).

    Args:
        logger: Where to log.
        event: The dotted event name.
        level: The record's level.
        **fields: Plain values (str, int, float, bool, None, or lists of them); None values are
            left out.
    """
    if not logger.isEnabledFor(level):
        return
    kept = {k: v for k, v in fields.items() if v is not None}
    text = " ".join(f"{k}={_text_value(v)}" for k, v in kept.items())
    logger.log(level, "%s %s" if text else "%s%s", event, text,
               extra={"event": event, "event_fields": kept, "request_id": current_request_id()})


def _text_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        text = ",".join(str(v) for v in value)
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if _BARE.fullmatch(text) else json.dumps(text)


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


class TextFormatter(logging.Formatter):
    """``<UTC time> <LEVEL> <logger> [<request id>] <message>``, plus a traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        line = (f"{_timestamp(record.created)} {record.levelname} {record.name} "
                f"{f'[{request_id}] ' if request_id else ''}{record.getMessage()}")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``ts``, ``level``, ``logger``, ``msg``, ``request_id`` (when
    set), an event's fields, and ``exc`` (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        event = getattr(record, "event", None)
        out: dict[str, Any] = {"ts": _timestamp(record.created), "level": record.levelname.lower(),
                               "logger": record.name, "msg": event or record.getMessage()}
        request_id = getattr(record, "request_id", None)
        if request_id:
            out["request_id"] = request_id
        fields = getattr(record, "event_fields", None) or {}
        out.update({k: v for k, v in fields.items() if k not in _BASE_KEYS})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class _RequestIdFilter(logging.Filter):
    """Gives every record the current request id (events already carry theirs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id()
        return True


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of each record; remembers the library
    loggers it adopted (``adopt_library_loggers``) to give them back on exit."""

    def __init__(self) -> None:
        super().__init__()
        self.adopted: list[tuple[logging.Logger, list[logging.Handler], bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


class _LibraryNames(logging.Filter):
    """uvicorn logs everything but access lines as ``uvicorn.error`` (a historical name): it is
    ``uvicorn`` here, so an INFO line does not read as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":
            record.name = "uvicorn"
        return True


def adopt_library_loggers() -> None:
    """Route the records of libraries that write to stderr by themselves (transformers installs
    its own handler and stops propagation) through the handler of ``stderr_logging``: one format
    (text or JSON), one place. A no-op outside ``stderr_logging``; undone when it exits.

    Call it after those libraries are imported (their handlers exist only then).
    """
    ours = next((h for h in logging.getLogger().handlers if isinstance(h, _StderrHandler)), None)
    if ours is None:
        return
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or name.split(".")[0] == "phloem":
            continue
        own = [h for h in logger.handlers if type(h) is logging.StreamHandler]
        if own or not logger.propagate:
            ours.adopted.append((logger, own, logger.propagate))
            for handler in own:
                logger.removeHandler(handler)
            logger.propagate = True


@contextlib.contextmanager
def stderr_logging(log_format: str = "text", level: str = "info") -> Iterator[None]:
    """Log every record of ``level`` or above to stderr in ``log_format`` inside the block.

    Args:
        log_format: ``text`` or ``json``.
        level: ``debug``, ``info``, ``warning`` or ``error``.

    Raises:
        ValueError: An unknown format or level (named).
    """
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format: expected one of {LOG_FORMATS}, got {log_format!r}")
    if level not in LOG_LEVELS:
        raise ValueError(f"log_level: expected one of {LOG_LEVELS}, got {level!r}")
    root = logging.getLogger()
    if any(isinstance(h, _StderrHandler) for h in root.handlers):
        yield
        return
    handler = _StderrHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(_RequestIdFilter())
    handler.addFilter(_LibraryNames())
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(level.upper())
    if log_format == "json":
        logging.captureWarnings(True)
    adopt_library_loggers()
    try:
        yield
    finally:
        if log_format == "json":
            logging.captureWarnings(False)
        root.removeHandler(handler)
        root.setLevel(old_level)
        for logger, own, propagate in handler.adopted:
            logger.propagate = propagate
            for library_handler in own:
                logger.addHandler(library_handler)

"""``runtime.logs``: the two line formats, event fields, request ids, and a scoped handler."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from phloem.runtime.logs import bind_request_id, current_request_id, log_event, stderr_logging


def emit(capsys: pytest.CaptureFixture[str], log_format: str, level: str = "info") -> list[str]:
    logger = logging.getLogger("phloem.test.logs")
    with stderr_logging(log_format, level):
        with bind_request_id("req-7"):
            log_event(logger, "session.created", session_id="sess_1", num_tokens=12, owner=None)
            logger.debug("hidden at info")
        log_event(logger, "http.request", path="/v1/x\n2026 INFO forged line", status=404,
                  duration_ms=1.23456789, children=["a", "b"])
    return capsys.readouterr().err.splitlines()


def test_text_lines_quote_hostile_values(capsys: pytest.CaptureFixture[str]) -> None:
    first, second = emit(capsys, "text")
    assert first.endswith(" INFO phloem.test.logs [req-7] session.created session_id=sess_1 num_tokens=12")
    assert "owner" not in first, "None fields are left out"
    assert second.endswith(' http.request path="/v1/x\\n2026 INFO forged line" status=404 '
                           'duration_ms=1.23457 children=a,b')


def test_json_lines_carry_fields_and_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    first, second = (json.loads(line) for line in emit(capsys, "json"))
    assert {k: first[k] for k in ("level", "logger", "msg", "request_id", "session_id", "num_tokens")} == {
        "level": "info", "logger": "phloem.test.logs", "msg": "session.created", "request_id": "req-7",
        "session_id": "sess_1", "num_tokens": 12}
    assert first["ts"].endswith("Z") and "owner" not in first
    assert second["path"] == "/v1/x\n2026 INFO forged line" and second["children"] == ["a", "b"]
    assert "request_id" not in second


def test_debug_level_and_plain_records(capsys: pytest.CaptureFixture[str]) -> None:
    lines = emit(capsys, "json", "debug")
    assert [json.loads(line)["msg"] for line in lines] == ["session.created", "hidden at info", "http.request"]
    assert json.loads(lines[1])["request_id"] == "req-7", "plain records get the request id too"


def test_the_handler_is_scoped_and_nests(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    with stderr_logging("json", "warning"):
        with stderr_logging("text", "debug"):  # already installed: kept as it is
            logging.getLogger("phloem.test").warning("once")
        assert root.level == logging.WARNING
    assert (root.handlers, root.level) == (handlers, level)
    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line)["msg"] == "once"


def test_bad_format_or_level_is_named() -> None:
    with pytest.raises(ValueError, match="log_format: expected one of"):
        with stderr_logging("xml"):
            pass
    with pytest.raises(ValueError, match="log_level: expected one of"):
        with stderr_logging("text", "loud"):
            pass


def test_tasks_started_under_a_request_keep_its_id() -> None:
    async def main() -> list[str | None]:
        with bind_request_id("outer"):
            task = asyncio.ensure_future(asyncio.sleep(0, current_request_id()))
        return [await task, current_request_id()]

    assert asyncio.run(main()) == ["outer", None]

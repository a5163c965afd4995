"""Wire schemas and SDK pieces that need no server: validation, round trips, error mapping."""

from __future__ import annotations

import email.utils
import re
import subprocess
import sys
import time
from pathlib import Path
from types import GenericAlias
from typing import Any

import msgspec
import pytest

from phloem.api import schemas
from phloem.api import (
    Client, ContextLengthExceeded, Forbidden, IdempotencyConflict, InternalError, InvalidRequest,
    NotFound, Overloaded, PayloadTooLarge, PhloemError, RateLimited, Session, SessionBusy,
    SessionNotFound, Unauthorized,
)
from phloem.api.schemas import (
    ERROR_STATUS, AppendMessage, AppendRequest, AppendResult, CancelledEvent, CancelMessage,
    ClientMessage, CreateSessionRequest, DeltaEvent, DoneEvent, ErrorCode, ErrorEvent, ForkedEvent,
    ForkMessage, ForkRequest, GenerateParams, Problem, ServerEvent, SessionInfo, SessionList,
    TurnList, UpdateSessionRequest, Usage, make_problem,
)
from phloem.api.sdk import _transport
from phloem.api.sdk._errors import error_from_event, error_from_response, parse_retry_after

USAGE = Usage(prompt_tokens=12, cached_tokens=8, completion_tokens=3)
INFO = SessionInfo(id="s1", created_at=1_700_000_000, metadata={"agent": "a"}, status="active",
                   num_tokens=15, num_turns=2, parent_id=None, fork_turn=None, ttl=30.0)


def decode(kind: Any, payload: dict[str, Any]) -> Any:
    return msgspec.json.decode(msgspec.json.encode(payload), type=kind)


@pytest.mark.parametrize(("kind", "payload", "message"), [
    (AppendRequest, {"text": "hi", "temprature": 0.5}, "unknown field `temprature`"),
    (AppendRequest, {"text": "hi", "generate": {"max_tokens": "3"}}, "Expected `int | null`"),
    (AppendRequest, {"input_ids": [1, -2]}, "Expected `int` >= 0"),
    (AppendRequest, {"input_ids": []}, "length >= 1"),
    (AppendRequest, {"text": "a", "input_ids": [1]}, "at most one of"),
    (AppendRequest, {}, "expected one of"),
    (AppendRequest, {"text": "a", "stream": True}, "needs `generate`"),
    (AppendRequest, {"messages": [{"role": "user"}]}, "needs `content` or `tool_calls`"),
    (AppendRequest, {"messages": [{"role": "robot", "content": "x"}]}, "Invalid enum value"),
    (GenerateParams, {"max_tokens": 0}, ">= 1"),
    (GenerateParams, {"temperature": 2.5}, "<= 2.0"),
    (GenerateParams, {"temperature": -0.1}, ">= 0.0"),
    (GenerateParams, {"top_p": 0.0}, "> 0.0"),
    (GenerateParams, {"top_k": 0}, ">= 1"),
    (GenerateParams, {"stop": ["x"] * 17}, "length <= 16"),
    (GenerateParams, {"stop": [""]}, "length >= 1"),
    (GenerateParams, {"ignore_eos": "yes"}, "Expected `bool`"),
    (CreateSessionRequest, {"metadata": {f"k{i}": "v" for i in range(17)}}, "length <= 16"),
    (CreateSessionRequest, {"metadata": {"k": 1}}, "Expected `str`"),
    (CreateSessionRequest, {"ttl": -1}, ">= 0"),
    (CreateSessionRequest, {"text": "x", "tools": []}, "need `messages`"),
    (ForkRequest, {"n": 0}, ">= 1"),
    (ForkRequest, {"n": 65}, "<= 64"),
    (ForkRequest, {"at_turn": -1}, ">= 0"),
    (ClientMessage, {"type": "generate"}, "Invalid value 'generate'"),
    (ClientMessage, {"type": "append"}, "expected one of"),
])
def test_schema_rejects(kind: Any, payload: dict[str, Any], message: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=message.replace("|", r"\|")):
        decode(kind, payload)


def test_schema_accepts_minimal_and_full_requests() -> None:
    assert decode(AppendRequest, {"generate": {}}).generate == GenerateParams()
    full = {"messages": [{"role": "assistant", "tool_calls": [
                {"id": "c1", "function": {"name": "ls", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}],
            "generate": {"max_tokens": 8, "temperature": 0, "top_p": 0.9, "top_k": 20,
                         "seed": 7, "stop": ["\n"], "stop_token_ids": [2], "ignore_eos": True,
                         "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                         "logit_bias": {"42": -100.0}, "min_tokens": 2, "logprobs": 3,
                         "response_format": {"type": "json_schema", "json_schema": {
                             "name": "r", "schema": {"type": "object"}, "strict": True, "description": None}},
                         "tool_choice": {"type": "function", "function": {"name": "ls"}},
                         "parallel_tool_calls": False, "tool_call_constraint": "envelope"},
            "stream": True}
    request = decode(AppendRequest, full)
    assert msgspec.to_builtins(request)["generate"] == full["generate"]
    assert request.messages is not None and request.messages[0].tool_calls is not None


def test_update_request_tells_absent_from_null() -> None:
    assert msgspec.json.encode(UpdateSessionRequest()) == b"{}"
    assert decode(UpdateSessionRequest, {"ttl": None}).ttl is None
    assert decode(UpdateSessionRequest, {}).ttl is msgspec.UNSET


def test_structs_are_frozen() -> None:
    with pytest.raises(AttributeError):
        GenerateParams().max_tokens = 3


EVENTS = [
    DeltaEvent(sequence_number=0, text="He", token_ids=[9707], request_id="r1"),
    DoneEvent(sequence_number=1, turn=2, output_ids=[9707, 13], text="Hello.", finish_reason="stop",
              usage=USAGE, num_tokens=15),
    ErrorEvent(sequence_number=2, code="session_busy", message="a generation runs"),
    ForkedEvent(sequence_number=3, sessions=[INFO]),
    CancelledEvent(sequence_number=4, request_id="r2"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_server_event_round_trip(event: Any) -> None:
    wire = msgspec.json.encode(event)
    assert msgspec.json.decode(wire)["type"] == type(event).__struct_config__.tag
    assert msgspec.json.decode(wire, type=ServerEvent) == event
    assert _transport.decode_ws_event(wire.decode()) == event


@pytest.mark.parametrize("message", [
    AppendMessage(text="hi", generate=GenerateParams(max_tokens=4), request_id="r1"),
    CancelMessage(request_id="r1"),
    ForkMessage(n=3, at_turn=1),
], ids=lambda m: type(m).__name__)
def test_client_message_round_trip(message: Any) -> None:
    wire = msgspec.json.encode(message)
    assert msgspec.json.decode(wire)["type"] in {"append", "cancel", "fork"}
    assert msgspec.json.decode(wire, type=ClientMessage) == message


@pytest.mark.parametrize("value", [
    INFO, SessionList(sessions=[INFO], has_more=False), USAGE,
    AppendResult(turn=0, output_ids=[], text="", finish_reason=None, usage=USAGE, num_tokens=4),
    TurnList(turns=[]), make_problem(ErrorCode.SESSION_BUSY, "busy"),
], ids=lambda v: type(v).__name__)
def test_response_round_trip(value: Any) -> None:
    assert msgspec.json.decode(msgspec.json.encode(value), type=type(value)) == value


def test_sse_decoder_frames_events() -> None:
    done = msgspec.json.encode(EVENTS[1]).decode()
    lines = [": keep-alive", "", ": ping", "data: ", "", "event: delta", "id: 0",
             'data: {"type":"delta",',
             'data: "sequence_number":0,"text":"He","token_ids":[9707]}', "",
             "event: done", f"data:{done}", ""]
    decoder = _transport.SSEDecoder()
    events = [event for line in lines for event in decoder.feed(line)]
    assert events == [DeltaEvent(sequence_number=0, text="He", token_ids=[9707]), EVENTS[1]]


EXPECTED = {
    ErrorCode.INVALID_REQUEST: InvalidRequest, ErrorCode.UNAUTHORIZED: Unauthorized,
    ErrorCode.FORBIDDEN: Forbidden, ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.METHOD_NOT_ALLOWED: PhloemError,
    ErrorCode.SESSION_NOT_FOUND: SessionNotFound, ErrorCode.SESSION_BUSY: SessionBusy,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: ContextLengthExceeded,
    ErrorCode.PAYLOAD_TOO_LARGE: PayloadTooLarge, ErrorCode.UNSUPPORTED_MEDIA_TYPE: InvalidRequest,
    ErrorCode.IDEMPOTENCY_CONFLICT: IdempotencyConflict, ErrorCode.RATE_LIMITED: RateLimited,
    ErrorCode.INTERNAL_ERROR: InternalError, ErrorCode.OVERLOADED: Overloaded,
}


def test_every_error_code_has_a_status_and_an_exception() -> None:
    assert set(ERROR_STATUS) == set(ErrorCode) == set(EXPECTED)


@pytest.mark.parametrize("code", list(ErrorCode), ids=str)
def test_problem_maps_to_exception(code: ErrorCode) -> None:
    problem = make_problem(code, "what was expected, what was received")
    assert problem.status == ERROR_STATUS[code] and problem.type.endswith(code.value)
    error = error_from_response(problem.status, msgspec.json.encode(problem), "2")
    assert type(error) is EXPECTED[code]
    assert (error.code, error.status, error.retry_after) == (code.value, problem.status, 2.0)
    assert error.detail == "what was expected, what was received"


def test_error_maps_by_code_not_status() -> None:
    body = msgspec.json.encode(make_problem(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "too long"))
    error = error_from_response(413, body, None)
    assert isinstance(error, ContextLengthExceeded) and isinstance(error, InvalidRequest)
    assert error.status == 413
    future = Problem(type="urn:x", title="New", status=418, detail="d", code="brand_new")
    assert type(error_from_response(418, msgspec.json.encode(future), None)) is PhloemError


def test_error_from_non_problem_body_falls_back_to_status() -> None:
    assert type(error_from_response(503, b"<html>busy</html>", "1")) is Overloaded
    assert type(error_from_response(502, b"bad gateway", None)) is InternalError
    error = error_from_response(418, b"", None)
    assert type(error) is PhloemError and error.code == "http_418"


def test_error_from_event() -> None:
    event = ErrorEvent(sequence_number=5, code="rate_limited", message="slow", retry_after=1.5)
    error = error_from_event(event)
    assert type(error) is RateLimited and error.status is None and error.retry_after == 1.5


def test_parse_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after("0") == 0.0 and parse_retry_after("2.5") == 2.5
    assert parse_retry_after("-3") == 0.0 and parse_retry_after("soon") is None
    later = parse_retry_after(email.utils.formatdate(time.time() + 30, usegmt=True))
    assert later is not None and 25 < later <= 30


def test_retry_policy() -> None:
    policy = _transport.RetryPolicy(max_retries=2)
    post = _transport.prefetch("s1")
    bare_post: _transport.Call[None] = _transport.Call("POST", "/v1/x", None)
    assert policy.delay(post, 0, 503, "0") == 0.0
    assert policy.delay(post, 0, 429, "7") == 7.0
    assert policy.delay(post, 2, 503, "0") is None  # retries spent
    assert policy.delay(post, 0, 500, None) is None  # not transient
    assert policy.delay(post, 0, 503, "3600") is None  # too long to wait out
    assert policy.delay(bare_post, 0, None, None) is None  # unsafe to repeat
    assert 0.375 <= (policy.delay(_transport.get_session("s1"), 0, None, None) or 0) <= 0.625


def test_calls_carry_idempotency_keys_and_quote_ids() -> None:
    assert _transport.get_session("a/b").path == "/v1/sessions/a%2Fb"
    assert "Idempotency-Key" not in _transport.get_session("s").headers
    for call in (_transport.delete_session("s"), _transport.fork("s", 2, None, None),
                 _transport.update_session("s", {"ttl": 5.0}), _transport.offload("s", "disk")):
        assert len(call.headers["Idempotency-Key"]) == 32 and call.retryable
    assert _transport.fork("s", 1, 0, "mine").idempotency_key == "mine"
    assert _transport.ws_url("https://h:1/root/", "s") == "wss://h:1/root/v1/sessions/s/ws"
    with pytest.raises(ValueError, match="http:// or https://"):
        _transport.ws_url("ftp://h", "s")


def test_sdk_validates_before_sending() -> None:
    # Port 9 (discard) is never contacted: validation fails first.
    with Client("http://127.0.0.1:9", max_retries=0) as client:
        session = Session(client, INFO)
        with pytest.raises(InvalidRequest, match=">= 1") as info:
            session.append(text="hi", generate={"max_tokens": 0})
        assert info.value.status is None
        with pytest.raises(InvalidRequest, match="<= 2.0"):
            session.stream(text="hi", generate=GenerateParams(temperature=3.0))
        with pytest.raises(InvalidRequest, match="at most one of"):
            client.sessions.create(text="a", input_ids=[1])


DOCS = Path(__file__).parents[2] / "docs" / "api.md"


def test_docs_examples_decode_with_the_schemas() -> None:
    text = DOCS.read_text()
    examples = re.findall(r"<!-- schema: (\S+) -->\n```json\n(.*?)```", text, re.DOTALL)
    assert len(examples) == len(re.findall("^<!-- schema:", text, re.M)) >= 14
    for name, body in examples:
        inner = name.removeprefix("list[").removesuffix("]")
        kind = getattr(schemas, inner)
        msgspec.json.decode(body, type=GenericAlias(list, (kind,)) if inner != name else kind)
    sse = re.search(r"<!-- sse-example -->\n```text\n(.*?)```", text, re.DOTALL)
    assert sse is not None
    decoder = _transport.SSEDecoder()
    events = [event for line in sse.group(1).splitlines() for event in decoder.feed(line)]
    deltas = [e for e in events if isinstance(e, DeltaEvent)]
    assert len(deltas) == 2 and isinstance(events[2], DoneEvent) and len(events) == 3
    assert [i for e in deltas for i in e.token_ids] == events[2].output_ids


def test_client_import_pulls_no_torch() -> None:
    code = ("import sys, phloem.api\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'torch', 'triton', 'numpy', 'transformers', 'litestar'})\n"
            "ours = sorted(m for m in sys.modules if m.startswith('phloem.') "
            "and not m.startswith('phloem.api.'))\n"
            "print(heavy, ours)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] ['phloem.api']"

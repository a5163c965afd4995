"""The SDK against a real HTTP/WebSocket server: a toy Litestar app served by uvicorn in a thread.

The toy speaks the wire contract of docs/api.md just enough to drive the SDK's transport:
retries and ``Retry-After``, idempotency keys, problem+json errors, SSE framing, WebSocket
streaming and cancel. It echoes; it is not the real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import uvicorn
from litestar import Litestar, Request, Response, WebSocket, delete, get, patch, post, websocket
from litestar.exceptions import WebSocketDisconnect
from litestar.response import ServerSentEvent
from litestar.response.sse import ServerSentEventMessage

from phloem.api import (
    APIConnectionError, AsyncClient, AsyncSession, Client, Overloaded, RateLimited, Session,
    SessionNotFound,
)
from phloem.api.schemas import (
    PROBLEM_CONTENT_TYPE, AppendRequest, AppendResult, CancelMessage, ClientMessage,
    CreateSessionRequest, DeltaEvent, DoneEvent, ErrorCode, ErrorEvent, FinishReason, ForkRequest,
    ForkResult, OffloadRequest, ServerEvent, SessionInfo, SessionList, Turn, TurnList,
    UpdateSessionRequest, Usage, make_problem,
)
from phloem.api.sdk._transport import settle

WORDS = ["Hel", "lo", ",", " wor", "ld"]


def info(session_id: str) -> SessionInfo:
    return SessionInfo(id=session_id, created_at=0, metadata={}, status="active", num_tokens=0,
                       num_turns=0, parent_id=None, fork_turn=None, ttl=30.0)


def problem(code: ErrorCode, retry_after: str | None = None) -> Response[bytes]:
    body = make_problem(code, f"toy {code}")
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return Response(msgspec.json.encode(body), status_code=body.status,
                    media_type=PROBLEM_CONTENT_TYPE, headers=headers)


def done(seq: int, output_ids: list[int], reason: FinishReason) -> DoneEvent:
    usage = Usage(prompt_tokens=3, cached_tokens=0, completion_tokens=len(output_ids))
    return DoneEvent(sequence_number=seq, turn=1, output_ids=output_ids,
                     text="".join(WORDS[i % 5] for i in output_ids), finish_reason=reason,
                     usage=usage, num_tokens=3 + len(output_ids))


@dataclass
class Toy:
    """Failures queued per path, answered before the route runs; every request is logged."""

    failures: dict[str, list[tuple[ErrorCode, str | None]]] = field(default_factory=dict)
    log: list[tuple[str, str, str | None]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)

    def fail(self, path: str, code: ErrorCode, retry_after: str | None, times: int = 1) -> None:
        self.failures.setdefault(path, []).extend([(code, retry_after)] * times)

    def before_request(self, request: Request[Any, Any, Any]) -> Response[bytes] | None:
        self.log.append((request.method, request.url.path, request.headers.get("idempotency-key")))
        self.auth.append(request.headers.get("authorization"))
        queued = self.failures.get(request.url.path)
        return problem(*queued.pop(0)) if queued else None


def make_app(toy: Toy) -> Litestar:
    @post("/v1/sessions", status_code=201)
    async def create(data: CreateSessionRequest) -> SessionInfo:
        return info(f"s{len(toy.log)}")

    @get("/v1/sessions/{session_id:str}")
    async def read(session_id: str) -> SessionInfo | Response[bytes]:
        return problem(ErrorCode.SESSION_NOT_FOUND) if session_id == "gone" else info(session_id)

    @get("/v1/sessions")
    async def list_(limit: int, after: str | None = None) -> SessionList:
        start = int(after[1:]) + 1 if after else 0
        ids = [f"s{i}" for i in range(start, min(start + limit, 5))]
        return SessionList(sessions=[info(i) for i in ids], has_more=start + limit < 5)

    @patch("/v1/sessions/{session_id:str}")
    async def update(session_id: str, data: UpdateSessionRequest) -> SessionInfo:
        metadata = {} if isinstance(data.metadata, msgspec.UnsetType) else data.metadata
        return msgspec.structs.replace(info(session_id), metadata=metadata)

    @delete("/v1/sessions/{session_id:str}")
    async def remove(session_id: str) -> None:
        return None

    @post("/v1/sessions/{session_id:str}/fork", status_code=201)
    async def fork(session_id: str, data: ForkRequest) -> ForkResult:
        children = [msgspec.structs.replace(info(f"{session_id}.{i}"), parent_id=session_id,
                                            fork_turn=data.at_turn) for i in range(data.n)]
        return ForkResult(sessions=children)

    @get("/v1/sessions/{session_id:str}/turns")
    async def turns(session_id: str, include_tokens: bool = False) -> TurnList:
        turn = Turn(index=0, start=0, end=2, num_output_tokens=0, finish_reason=None,
                    created_at=0, token_ids=[1, 2] if include_tokens else None)
        return TurnList(turns=[turn])

    @post("/v1/sessions/{session_id:str}/{action:str}", status_code=202)
    async def move(session_id: str, action: str, request: Request[Any, Any, Any]) -> SessionInfo:
        body = await request.body()
        tier = msgspec.json.decode(body, type=OffloadRequest).tier if body else "active"
        return msgspec.structs.replace(info(session_id), status=tier)

    @post("/v1/sessions/{session_id:str}/append", status_code=200)
    async def append(session_id: str, data: AppendRequest) -> ServerSentEvent | AppendResult:
        if not data.stream:
            return settle(done(0, [0, 1], "stop"))  # type: ignore[return-value]

        async def events() -> AsyncIterator[ServerSentEventMessage]:
            yield ServerSentEventMessage(comment="keep-alive")
            for seq, word in enumerate(WORDS):
                event: ServerEvent = DeltaEvent(sequence_number=seq, text=word, token_ids=[seq])
                frame = msgspec.json.encode(event).decode()
                yield ServerSentEventMessage(event="delta", data=frame)
            last: ServerEvent = done(len(WORDS), list(range(len(WORDS))), "stop")
            if data.text == "boom":
                last = ErrorEvent(sequence_number=len(WORDS), code="overloaded", message="toy")
            yield ServerSentEventMessage(event=str(last.__struct_config__.tag),
                                         data=msgspec.json.encode(last).decode())

        return ServerSentEvent(events())

    @websocket("/v1/sessions/{session_id:str}/ws")
    async def ws(socket: WebSocket[Any, Any, Any], session_id: str) -> None:
        toy.auth.append(socket.headers.get("authorization"))
        await socket.accept()
        if session_id == "gone":  # a fatal error: one event, then close with 4000 + status
            refusal = ErrorEvent(sequence_number=0, code="session_not_found", message="toy")
            await socket.send_text(msgspec.json.encode(refusal).decode())
            await socket.close(code=4404)
            return
        decoder, seq = msgspec.json.Decoder(ClientMessage), itertools.count()
        decoder.decode(await socket.receive_text())  # the append; the toy ignores its input
        cancelled = asyncio.Event()

        async def read_cancel() -> None:
            if isinstance(decoder.decode(await socket.receive_text()), CancelMessage):
                cancelled.set()

        reader = asyncio.create_task(read_cancel())
        output: list[int] = []
        while not cancelled.is_set() and len(output) < 1000:
            output.append(len(output))
            event = DeltaEvent(sequence_number=next(seq), text=WORDS[output[-1] % 5],
                               token_ids=output[-1:])
            await socket.send_text(msgspec.json.encode(event).decode())
            await asyncio.sleep(0.005)
        reason: FinishReason = "cancelled" if cancelled.is_set() else "length"
        await socket.send_text(msgspec.json.encode(done(next(seq), output, reason)).decode())
        # Without a cancel, the reader ends when the client closes after `done`.
        with contextlib.suppress(WebSocketDisconnect):
            await reader

    handlers = [create, read, list_, update, remove, fork, turns, append, move, ws]
    return Litestar(handlers, before_request=toy.before_request)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Toy]]:
    toy = Toy()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(make_app(toy), log_level="warning", ws="websockets-sansio",
                            lifespan="off")
    runner = uvicorn.Server(config)
    thread = threading.Thread(target=runner.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not runner.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", toy
    runner.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def toy(server: tuple[str, Toy]) -> Toy:
    server[1].failures.clear()
    server[1].log.clear()
    server[1].auth.clear()
    return server[1]


@pytest.fixture
def client(server: tuple[str, Toy]) -> Iterator[Client]:
    with Client(server[0], api_key="k", timeout=10.0) as client:
        yield client


def test_retry_honours_retry_after_and_keeps_the_idempotency_key(client: Client, toy: Toy) -> None:
    toy.fail("/v1/sessions", ErrorCode.OVERLOADED, "0")
    toy.fail("/v1/sessions", ErrorCode.RATE_LIMITED, "0")
    started = time.monotonic()
    session = client.sessions.create(metadata={"agent": "a"})
    assert time.monotonic() - started < 1.0  # Retry-After: 0, not the backoff (>= 1.1 s here)
    keys = [key for method, _, key in toy.log]
    assert len(keys) == 3 and keys[0] is not None and len(set(keys)) == 1
    assert session.id == "s3"


def test_get_retries_without_a_key(client: Client, toy: Toy) -> None:
    toy.fail("/v1/sessions/s7", ErrorCode.OVERLOADED, "0")
    assert client.sessions.get("s7").id == "s7"
    assert toy.log == [("GET", "/v1/sessions/s7", None)] * 2


def test_retries_are_bounded(server: tuple[str, Toy], toy: Toy) -> None:
    toy.fail("/v1/sessions/s1", ErrorCode.OVERLOADED, "0", times=5)
    with Client(server[0], max_retries=1) as client, pytest.raises(Overloaded) as info:
        client.sessions.get("s1")
    assert len(toy.log) == 2 and info.value.status == 503 and info.value.retry_after == 0.0


def test_long_retry_after_is_raised_not_slept(client: Client, toy: Toy) -> None:
    toy.fail("/v1/sessions/s1", ErrorCode.RATE_LIMITED, "3600")
    started = time.monotonic()
    with pytest.raises(RateLimited) as info:
        client.sessions.get("s1")
    assert time.monotonic() - started < 1 and info.value.retry_after == 3600.0


def test_problem_json_raises_typed_error(client: Client, toy: Toy) -> None:
    with pytest.raises(SessionNotFound) as info:
        client.sessions.get("gone")
    assert (info.value.code, info.value.status) == ("session_not_found", 404)
    assert len(toy.log) == 1  # a 404 is final


@pytest.mark.slow  # backs off between retries
def test_connection_errors_are_retried_then_raised() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"  # bound, never listening
        with Client(url, max_retries=1) as client, pytest.raises(APIConnectionError):
            client.sessions.get("s1")


def test_list_follows_pages(client: Client, toy: Toy) -> None:
    assert [s.id for s in client.sessions.list(page_size=2)] == ["s0", "s1", "s2", "s3", "s4"]
    assert len(toy.log) == 3


def test_sse_stream(client: Client, toy: Toy) -> None:
    session = client.sessions.get("s1")
    with session.stream(text="hi", generate={"max_tokens": 5}) as stream:
        deltas = list(stream)
    assert "".join(d.text for d in deltas) == "Hello, world"
    assert stream.result is not None and stream.result.text == "Hello, world"
    assert [i for d in deltas for i in d.token_ids] == stream.result.output_ids
    assert [d.sequence_number for d in deltas] == list(range(5))
    assert toy.log[-1][2] is not None  # the append carried an Idempotency-Key


def test_leaving_a_stream_early_closes_it_quietly(client: Client, toy: Toy) -> None:
    session = client.sessions.get("s1")
    with session.stream(text="hi") as stream:
        for _ in stream:
            break
    assert stream.result is None
    unstarted = session.stream(text="hi", transport="websocket")
    unstarted.cancel()
    assert list(unstarted) == [] and len(toy.log) == 2  # the cancelled stream never connected


def test_sse_error_event_raises(client: Client) -> None:
    stream = client.sessions.get("s1").stream(text="boom")
    with pytest.raises(Overloaded) as info:
        list(stream)
    assert info.value.status is None and stream.result is None


def test_websocket_cancel_commits_what_the_client_saw(client: Client) -> None:
    session = client.sessions.get("s1")
    seen: list[int] = []
    with session.stream(text="go", transport="websocket") as stream:
        for delta in stream:
            seen += delta.token_ids
            if len(seen) == 3:
                stream.cancel()
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    assert stream.result.output_ids == seen and len(seen) >= 3


@pytest.mark.parametrize("delay", [0.0, 0.2], ids=["racing", "settled"])
def test_websocket_fatal_error_event_raises(client: Client, delay: float) -> None:
    stream = Session(client, info("gone")).stream(text="go", transport="websocket")
    with pytest.raises(SessionNotFound) as err:
        with stream:
            time.sleep(delay)  # let the server's error and close arrive before the client reads
            list(stream)
    assert err.value.status is None


@pytest.mark.slow
def test_async_client(server: tuple[str, Toy], toy: Toy) -> None:
    async def main() -> None:
        toy.fail("/v1/sessions", ErrorCode.OVERLOADED, "0")
        async with AsyncClient(server[0], api_key="k") as client:
            session = await client.sessions.create()
            async with session.stream(text="hi") as stream:
                text = "".join([delta.text async for delta in stream])
            assert text == "Hello, world" and stream.result is not None
            seen: list[int] = []
            async with session.stream(text="go", transport="websocket") as ws_stream:
                async for delta in ws_stream:
                    seen += delta.token_ids
                    if len(seen) == 2:
                        await ws_stream.cancel()
            assert ws_stream.result is not None and ws_stream.result.output_ids == seen
            with pytest.raises(SessionNotFound):
                await client.sessions.get("gone")
            with pytest.raises(SessionNotFound):
                async with AsyncSession(client, info("gone")).stream(transport="websocket") as gone:
                    await asyncio.sleep(0.1)
                    assert [delta async for delta in gone] == []
            await session.update(ttl=None)
            assert (await session.append(text="hi", generate={})).output_ids == [0, 1]
            assert [c.info.parent_id for c in await session.fork(2)] == [session.id] * 2
            assert len(await session.turns()) == 1
            assert (await session.offload()).status == "host"
            assert (await session.prefetch()).status == (await session.refresh()).status
            assert len(await client.sessions.list(page_size=3)) == 5
            await session.delete()
            await client.sessions.delete("s2")

    asyncio.run(main())
    assert toy.log[0][2] == toy.log[1][2] is not None
    assert set(toy.auth) == {"Bearer k"} and len(toy.auth) == len(toy.log) + 2  # 2 WebSockets


@pytest.mark.slow
def test_every_session_method(client: Client, toy: Toy) -> None:
    session = client.sessions.create(text="You are terse.", ttl=5)
    assert session.update(metadata={"phase": "plan"}).metadata == {"phase": "plan"}
    result = session.append(text="hi", generate={"max_tokens": 2, "temperature": 0})
    assert result.output_ids == [0, 1] and result.usage.completion_tokens == 2
    children = session.fork(2, at_turn=0)
    assert [(c.info.parent_id, c.info.fork_turn) for c in children] == [(session.id, 0)] * 2
    assert session.turns(include_tokens=True)[0].token_ids == [1, 2]
    assert session.offload("disk").status == "disk" and session.info.status == "disk"
    assert session.prefetch().status == "active"
    assert session.refresh().id == session.id
    session.delete()
    client.sessions.delete(children[0].id)
    methods = [(method, path.rsplit("/", 1)[-1]) for method, path, _ in toy.log]
    assert methods == [("POST", "sessions"), ("PATCH", session.id), ("POST", "append"),
                       ("POST", "fork"), ("GET", "turns"), ("POST", "offload"),
                       ("POST", "prefetch"), ("GET", session.id), ("DELETE", session.id),
                       ("DELETE", children[0].id)]
    keys = [key for method, _, key in toy.log if method != "GET"]
    assert all(keys) and len(set(keys)) == len(keys)  # a fresh key per call
    assert set(toy.auth) == {"Bearer k"}

"""The ``data:`` lines of a streamed chat or text completion with one choice or ``n``.

Each choice's deltas are read through ``ApiContext.paced`` on its own task and merged in
arrival order; each chunk carries one choice (its ``index``). A choice's last chunk has its
``finish_reason``; after every choice ended, a chunk with empty ``choices`` carries the usage
(with ``stream_options.include_usage``), then ``data: [DONE]``. A failure of any choice is sent
as one ``data: {"error": ...}`` line before ``[DONE]``; the others are then cancelled. The
client going away cancels every choice (what was generated is still settled).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from phloem.api.server.context import ApiContext
from phloem.api.server.errors import classify
from phloem.api.server.openai.output import finish_reason, usage
from phloem.sessions import Generation, GenerationResult, OutputDelta, SessionError

__all__ = ["ChoiceShape", "stream_lines"]

# (index, delta or None for its end) -> the choice object of one chunk, or None: send nothing.
ChoiceShape = Callable[[int, OutputDelta | None, GenerationResult | None], dict[str, Any] | None]
_KEEPALIVE = b": keep-alive\n\n"


def _line(value: Any) -> bytes:
    return b"data: " + msgspec.json.encode(value) + b"\n\n"


async def stream_lines(ctx: ApiContext, generations: Sequence[Generation], head: dict[str, Any],
                       include_usage: bool, shape: ChoiceShape,
                       first: Callable[[int], dict[str, Any] | None]) -> AsyncIterator[bytes]:
    """The stream's lines (see the module docstring).

    Args:
        ctx: The app context (pacing).
        generations: The choices, in ``index`` order.
        head: ``id``, ``object``, ``created``, ``model`` of every chunk.
        include_usage: Send the usage chunk.
        shape: A delta (or, with the settled result, a choice's end) as a choice object.
        first: Each choice's opening choice object (chat's ``role``), sent before its deltas.
    """
    chunk = {**head, **({"usage": None} if include_usage else {})}
    queue: asyncio.Queue[tuple[int, OutputDelta | None, bool]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(ctx, g, i, queue)) for i, g in enumerate(generations)]
    results: list[GenerationResult | None] = [None] * len(generations)
    try:
        for i in range(len(generations)):
            opening = first(i)
            if opening is not None:
                yield _line({**chunk, "choices": [opening]})
        for _ in range(len(generations)):
            while True:
                index, delta, done = await queue.get()
                if done:
                    break
                if delta is None:
                    yield _KEEPALIVE
                    continue
                choice = shape(index, delta, None)
                if choice is not None:
                    yield _line({**chunk, "choices": [choice]})
            try:
                results[index] = result = await generations[index].result()
            except SessionError as exc:
                code, detail, _ = classify(exc)
                yield _line({"error": {"message": detail, "type": "server_error", "code": code.value}})
                yield b"data: [DONE]\n\n"
                return
            end = shape(index, None, result)
            if end is not None:
                yield _line({**chunk, "choices": [{**end, "finish_reason": finish_reason(result)}]})
        if include_usage:
            yield _line({**chunk, "choices": [], "usage": usage([r for r in results if r is not None])})
        yield b"data: [DONE]\n\n"
    finally:
        for generation in generations:
            generation.cancel()
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(ctx: ApiContext, generation: Generation, index: int,
                queue: asyncio.Queue[tuple[int, OutputDelta | None, bool]]) -> None:
    """Forward one choice's paced deltas; a last item marks its end."""
    try:
        async for delta in ctx.paced(generation):
            queue.put_nowait((index, delta, False))
    finally:
        queue.put_nowait((index, None, True))

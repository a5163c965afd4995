"""The event stream of a streamed Anthropic message (``"stream": true``), in Anthropic's order::

    message_start                      (usage: the prompt, nothing cached yet known)
    per content block, in the order the model writes them:
      content_block_start, content_block_delta*, content_block_stop
        thinking: thinking_delta    text: text_delta    tool_use: input_json_delta
    message_delta                      (stop_reason, stop_sequence, the final usage)
    message_stop

Each event is ``event: <type>`` and ``data: <json>`` (whose ``type`` repeats it); ``ping``
events keep an idle stream open. A block opens with its first delta and closes when a block of
another kind starts, or at the end. A failure after the stream started is one ``error`` event.
The final usage (``message_delta``) replaces the opening one, as Anthropic's clients expect: the
cached part of the prompt is known only once the engine has matched it.
"""

from __future__ import annotations

from typing import Any

from phloem.sessions import ParsedDelta

__all__ = ["MessageEvents"]


class MessageEvents:
    """Turns parsed deltas into content-block events (see the module docstring)."""

    def __init__(self) -> None:
        self._index = -1
        self._open: str | None = None

    def delta(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        """The events of one parsed delta."""
        events: list[dict[str, Any]] = []
        if parsed.reasoning:
            events += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": parsed.reasoning}))
        if parsed.content:
            events += self._ensure("text", {"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": parsed.content}))
        for call in parsed.tool_calls:
            if call.id is not None:
                events += self.close()
                events += self._start("tool_use", {"type": "tool_use", "id": call.id,
                                                   "name": call.name, "input": {}})
            elif call.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events

    def close(self) -> list[dict[str, Any]]:
        """Close the open block, if any."""
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        if self._open == kind:
            return []
        return self.close() + self._start(kind, block)

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = kind
        self._index += 1
        return [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

"""The event stream of a streamed response (``"stream": true``), in OpenAI's documented order.

Each event is one SSE message, ``event: <type>`` and ``data: <json>`` whose ``type`` repeats it
and whose ``sequence_number`` counts from 0::

    response.created, response.in_progress
    per output item, in the order the model writes them:
      reasoning:     output_item.added, content_part.added, reasoning_text.delta*,
                     reasoning_text.done, content_part.done, output_item.done
      message:       output_item.added, content_part.added, output_text.delta*,
                     output_text.done, content_part.done, output_item.done
      function_call: output_item.added, function_call_arguments.delta,
                     function_call_arguments.done, output_item.done
    response.completed | response.incomplete | response.failed (the whole response)

(each ``output_item`` / ``content_part`` / ``*.delta`` event above is ``response.``-prefixed).
An item opens with its first delta and closes when an item of another kind starts, or at the
end. The last event's response lists the items as they were streamed (content that the model
writes after a call becomes a second message item). A failure after the stream started is
``response.failed`` with ``error: {code, message}``.
"""

from __future__ import annotations

from typing import Any

from phloem.api.server.responses.output import call_item, message_item, reasoning_item
from phloem.sessions import ParsedDelta

__all__ = ["ResponseEvents"]


class ResponseEvents:
    """Turns parsed deltas into the stream's events (see the module docstring).

    Args:
        rid: The response id.
        response: The response object as created (status ``in_progress``, no output).
    """

    def __init__(self, rid: str, response: dict[str, Any]) -> None:
        self._rid = rid
        self._response = response
        self._seq = 0
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._text = ""
        self._num_calls = 0

    def start(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        return [self._event("response.created", response=self._response),
                self._event("response.in_progress", response=self._response)]

    def delta(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        """The events of one parsed delta."""
        events: list[dict[str, Any]] = []
        if parsed.reasoning:
            events += self._text_delta("reasoning", parsed.reasoning)
        if parsed.content:
            events += self._text_delta("message", parsed.content)
        for call in parsed.tool_calls:
            if call.id is not None:
                events += self.close()
                item = call_item(self._rid, self._num_calls, call.id, call.name or "", "", "in_progress")
                self._num_calls += 1
                events += self._open_item(item)
            elif self._open is not None and call.arguments:
                self._text += call.arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=self._open["id"], output_index=len(self.items),
                                          delta=call.arguments))
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Close the open item, if any."""
        item, text = self._open, self._text
        if item is None:
            return []
        self._open, self._text = None, ""
        index = len(self.items)
        at = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "function_call":
            item.update(arguments=text, status="completed")
            events.append(self._event("response.function_call_arguments.done", **at,
                                      arguments=text, name=item["name"]))
        else:
            if item["type"] == "reasoning":
                done = reasoning_item(self._rid, text, status)
                events.append(self._event("response.reasoning_text.done", **at, content_index=0, text=text))
            else:
                done = message_item(self._rid, text, status)
                events.append(self._event("response.output_text.done", **at, content_index=0,
                                          text=text, logprobs=[]))
            item.update(done)
            events.append(self._event("response.content_part.done", **at, content_index=0,
                                      part=item["content"][0]))
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        self.items.append(item)
        return events

    def end(self, kind: str, response: dict[str, Any]) -> dict[str, Any]:
        """The last event: ``response.completed``, ``response.incomplete`` or ``response.failed``."""
        return self._event(kind, response=response)

    def _text_delta(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            empty = reasoning_item(self._rid, "", "in_progress") if kind == "reasoning" else \
                message_item(self._rid, "", "in_progress")
            if kind == "message" and any(i["type"] == "message" for i in self.items):
                empty["id"] += f"_{len(self.items)}"  # a second message item (after a call)
            events += self._open_item(empty)
        assert self._open is not None
        self._text += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, item_id=self._open["id"], output_index=len(self.items),
                                  content_index=0, delta=text, **extra))
        return events

    def _open_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = item
        index = len(self.items)
        events = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        if item["type"] != "function_call":
            part = dict(item["content"][0])
            item["content"] = []
            events[0]["item"]["content"] = []
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=index, content_index=0, part=part))
        return events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

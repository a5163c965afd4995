"""A Responses request as the sessions layer's input: ids, chat messages, tools and options.

A response is a session turn (docs/architecture.md, "Invariants"), and its id says which::

    resp_<session id without "sess_">_<turn index>      e.g. resp_01J0...Q7_3 -> sess_01J0...Q7, turn 3

A response that is not stored (``store: false``) gets ``resp_<32 hex digits>``, which names no
turn. Output items are named after their response: ``rs_...`` (reasoning), ``msg_...``
(message) and ``fc_..._<i>`` (the i-th function call), with the response id's body for ``...``.

Input items become chat messages for the template: a ``message`` its role and text
(``developer`` is ``system``); ``function_call`` items join the assistant message just before
them (or make one) as its ``tool_calls``; a ``function_call_output`` is a ``tool`` message; a
``reasoning`` item's text becomes the ``reasoning_content`` of the next assistant message.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import msgspec

from phloem.api.schemas import ErrorCode
from phloem.api.server.errors import ApiError
from phloem.api.server.responses.schemas import (
    FormatJsonObject, FormatJsonSchema, FunctionCallItem, FunctionCallOutputItem, FunctionChoice,
    FunctionTool, InputItem, MessageItem, ReasoningItem, ResponseCreateRequest,
)
from phloem.sessions import Message, ResponseFormat, ToolChoice, ToolSpec

__all__ = ["chat_messages", "chat_tools", "item_id", "locate", "response_format", "response_id",
           "stored_items", "temporary_response_id", "tool_choice"]

_SESSION_PREFIX = "sess_"
_RESPONSE = re.compile(r"resp_([A-Za-z0-9]{1,100})_([0-9]{1,9})")


def response_id(session_id: str, turn: int) -> str:
    """The id of the response that is turn ``turn`` of ``session_id``."""
    return f"resp_{session_id.removeprefix(_SESSION_PREFIX)}_{turn}"


def temporary_response_id() -> str:
    """The id of a response that is not stored (it names no turn)."""
    return f"resp_{uuid.uuid4().hex}"


def locate(rid: str) -> tuple[str, int]:
    """The session and turn a response id names.

    Raises:
        ApiError: ``not_found``: it names no turn (at most 64 characters of it are quoted).
    """
    match = _RESPONSE.fullmatch(rid)
    if match is None:
        raise ApiError(ErrorCode.NOT_FOUND, f"no response {rid[:64]!r}")
    return _SESSION_PREFIX + match.group(1), int(match.group(2))


def item_id(rid: str, kind: str, index: int | None = None) -> str:
    """The id of an item of response ``rid``: ``kind`` is ``rs``, ``msg``, ``fc`` or ``in``."""
    body = rid.removeprefix("resp_")
    return f"{kind}_{body}" if index is None else f"{kind}_{body}_{index}"


def chat_tools(tools: list[FunctionTool] | None) -> tuple[ToolSpec, ...] | None:
    """Function tools in the chat template's shape (None when there are none)."""
    if not tools:
        return None
    specs = []
    for tool in tools:
        function = {"name": tool.name, "description": tool.description,
                    "parameters": tool.parameters}
        specs.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return tuple(specs)


def tool_choice(body: ResponseCreateRequest) -> ToolChoice:
    """The sessions layer's tool choice; without tools nothing is parsed (``none``), and a
    forced call is the sessions layer's 400 (the same on every route)."""
    choice = body.tool_choice or "auto"
    if not body.tools and choice in ("auto", "none"):
        return ToolChoice("none")
    if isinstance(choice, FunctionChoice):
        return ToolChoice("function", choice.name)
    return ToolChoice(choice)


def response_format(body: ResponseCreateRequest) -> ResponseFormat | None:
    """``text.format`` as the sessions layer's response format (None: plain text)."""
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, FormatJsonSchema):
        return ResponseFormat("json_schema", fmt.schema)
    if isinstance(fmt, FormatJsonObject):
        return ResponseFormat("json_object")
    return None


def chat_messages(items: list[InputItem]) -> list[Message]:
    """The input items as chat messages (rules in the module docstring)."""
    out: list[dict[str, Any]] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            reasoning = "".join(p.text for p in parts) or reasoning
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            message: dict[str, Any] = {"role": role, "content": _text(item.content)}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            out.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant" or reasoning is not None:
                last = {"role": "assistant", "content": ""}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", None) or getattr(part, "refusal", "") for part in content)


def stored_items(rid: str, body: ResponseCreateRequest, items: list[InputItem]) -> list[dict[str, Any]]:
    """The request's input items as ``GET /v1/responses/{id}/input_items`` lists them: each
    with an ``id`` (its own, else ``in_<response>_<i>``); a string input is one user message."""
    if isinstance(body.input, str):
        items = [MessageItem(role="user", content=body.input)]
    stored = []
    for i, item in enumerate(items):
        value = {k: v for k, v in msgspec.to_builtins(item).items() if v is not None}
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            value["content"] = [{"type": kind, "text": item.content}]
        if isinstance(item, (MessageItem, FunctionCallOutputItem)):
            value.setdefault("status", "completed")
        value["id"] = value.get("id") or item_id(rid, "in", i)
        stored.append(value)
    return stored

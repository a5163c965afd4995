"""Render ``docs/reference/api.md`` from the server's OpenAPI document and a few code facts.

Pure rendering: ``generate.py`` gathers every input (``ApiFacts``) from the running code, this
module only formats it, in the order the inputs give (the OpenAPI document's keys are sorted
before they get here), so the same inputs always give the same bytes.

Layout: an endpoint index, one section per operation (parameters, request body, responses),
the WebSocket route (not expressible in OpenAPI), the schemas of the OpenAPI components, the
stream and WebSocket message schemas (msgspec's JSON Schema of ``phloem.api.schemas``), and the
error codes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from _schema_md import cell, constraints, field_table, schema_anchor, type_of

__all__ = ["ApiFacts", "ErrorRow", "render_api_md"]

_GROUPS = (
    ("Native sessions API", lambda path: path.startswith("/v1/sessions")),
    ("OpenAI-compatible API", lambda path: path.startswith("/v1/")),
    ("Operations", lambda path: True),
)


@dataclass(frozen=True, slots=True)
class ErrorRow:
    """One stable error code: its HTTP status, title and SDK exception class."""

    code: str
    status: int
    title: str
    exception: str


@dataclass(frozen=True, slots=True)
class ApiFacts:
    """Everything ``render_api_md`` needs.

    Args:
        openapi: The OpenAPI document (keys sorted).
        handler_docs: ``"METHOD /path"`` → the handler's docstring (the OpenAPI document
            carries only summaries).
        websockets: ``(path, docstring)`` of each WebSocket route.
        messages: msgspec JSON Schema components of the stream and WebSocket messages.
        message_roots: Title → the union schema of a message family (SSE events, client
            messages, server events).
        struct_docs: Schema name → docstring of the msgspec Struct behind it.
        errors: The error codes, in the order of ``ErrorCode``.
        command: The command that regenerates the page.
    """

    openapi: dict[str, Any]
    handler_docs: dict[str, str]
    websockets: tuple[tuple[str, str], ...]
    messages: dict[str, Any]
    message_roots: tuple[tuple[str, dict[str, Any]], ...]
    struct_docs: dict[str, str]
    errors: tuple[ErrorRow, ...]
    command: str


def _op_anchor(method: str, path: str) -> str:
    return "op-" + method.lower() + re.sub(r"[^a-z0-9_]+", "-", path.lower()).rstrip("-")


def _operations(openapi: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    order = ("get", "post", "put", "patch", "delete")
    ops = [(method.upper(), path, op) for path, item in openapi["paths"].items()
           for method, op in item.items() if method in order]
    return sorted(ops, key=lambda o: (o[1], order.index(o[0].lower())))


def _grouped(openapi: dict[str, Any]) -> list[tuple[str, list[tuple[str, str, dict[str, Any]]]]]:
    groups: dict[str, list[tuple[str, str, dict[str, Any]]]] = {title: [] for title, _ in _GROUPS}
    for method, path, op in _operations(openapi):
        title = next(t for t, matches in _GROUPS if matches(path))
        groups[title].append((method, path, op))
    return [(title, ops) for title, ops in groups.items() if ops]


def _first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


def _rst_to_md(text: str) -> str:
    """Docstrings use reStructuredText literals (````x````); Markdown wants ```x```."""
    return text.replace("``", "`")


def _index(facts: ApiFacts) -> list[str]:
    lines = ["## Endpoints", "", "| method | path | summary | success | error statuses |",
             "|---|---|---|---|---|"]
    for _, ops in _grouped(facts.openapi):
        for method, path, op in ops:
            statuses = sorted(op.get("responses", {}))
            ok = ", ".join(s for s in statuses if s.startswith("2"))
            errors = ", ".join(s for s in statuses if not s.startswith("2"))
            doc = _first_paragraph(_rst_to_md(facts.handler_docs.get(f"{method} {path}", "")))
            link = f"[`{path}`](#{_op_anchor(method, path)})"
            lines.append("| " + " | ".join(cell(x) for x in (method, link, doc, ok, errors)) + " |")
    for path, doc in facts.websockets:
        link = f"[`{path}`](#{_op_anchor('ws', path)})"
        lines.append("| " + " | ".join(cell(x) for x in (
            "GET (WebSocket)", link, _first_paragraph(_rst_to_md(doc)), "101", "")) + " |")
    return lines


def _parameters(op: dict[str, Any]) -> list[str]:
    params = op.get("parameters") or []
    if not params:
        return []
    lines = ["**Parameters**", "", "| name | in | type | required | default | constraints |",
             "|---|---|---|---|---|---|"]
    for p in params:
        schema = p.get("schema", {})
        default = f"`{json.dumps(schema['default'])}`" if "default" in schema else ""
        row = [f"`{p['name']}`", p["in"], type_of(schema), "yes" if p.get("required") else "no",
               default, constraints(schema)]
        lines.append("| " + " | ".join(cell(x) for x in row) + " |")
    return lines + [""]


def _content_types(content: dict[str, Any]) -> str:
    parts = []
    for media, body in content.items():
        schema = body.get("schema", {})
        parts.append(f"`{media}`: {type_of(schema) if schema.get('$ref') else _inline(schema)}")
    return "; ".join(parts)


def _inline(schema: dict[str, Any]) -> str:
    """An inline (unnamed) schema: its type, plus its fields when it is a small object."""
    fields = schema.get("properties")
    if fields:
        return "object {" + ", ".join(f"`{k}`: {type_of(v)}" for k, v in fields.items()) + "}"
    return type_of(schema)


def _operation(facts: ApiFacts, method: str, path: str, op: dict[str, Any]) -> list[str]:
    lines = [f'### <a id="{_op_anchor(method, path)}"></a>`{method} {path}`', ""]
    doc = facts.handler_docs.get(f"{method} {path}", "")
    if doc:
        lines += [" ".join(_rst_to_md(doc).split()), ""]
    lines += [f"Operation id `{op.get('operationId', '')}`.", ""]
    lines += _parameters(op)
    body = op.get("requestBody")
    if body:
        required = "required" if body.get("required") else "optional"
        lines += [f"**Request body** ({required}): {_content_types(body.get('content', {}))}", ""]
    lines += ["**Responses**", "", "| status | description | body |", "|---|---|---|"]
    for status, response in sorted(op.get("responses", {}).items()):
        row = [status, response.get("description", ""), _content_types(response.get("content", {}))]
        lines.append("| " + " | ".join(cell(x) for x in row) + " |")
    return lines + [""]


def _websocket(path: str, doc: str) -> list[str]:
    return [f'### <a id="{_op_anchor("ws", path)}"></a>`GET {path}` (WebSocket)', "",
            " ".join(_rst_to_md(doc).split()), "",
            "OpenAPI cannot describe a WebSocket, so this route is not in `openapi.json`. Client "
            "messages and server events are [below](#websocket-and-stream-messages); the protocol "
            "(sequence numbers, cancel, close codes) is in [docs/api.md](../api.md#websocket).", ""]


def _schema_section(name: str, schema: dict[str, Any], facts: ApiFacts) -> list[str]:
    lines = [f'### <a id="{schema_anchor(name)}"></a>`{name}`', ""]
    doc = schema.get("description") or facts.struct_docs.get(name, "")
    if doc:
        lines += [" ".join(_rst_to_md(doc).split()), ""]
    if schema.get("type") == "object" or "properties" in schema:
        lines += field_table(schema)
    else:
        lines.append(f"Type: {type_of(schema)}")
    return lines + [""]


def _messages(facts: ApiFacts) -> list[str]:
    lines = ["## WebSocket and stream messages", "",
             "Not part of the OpenAPI document: SSE `data:` payloads of a streamed append and the "
             "JSON text frames of the WebSocket. Generated from the msgspec Structs of "
             "`phloem.api.schemas` (`msgspec.json.schema_components`); every message is an object "
             "tagged by its `type` field.", ""]
    for title, root in facts.message_roots:
        lines.append(f"- **{title}**: {type_of(root)}")
    lines.append("")
    known = facts.openapi.get("components", {}).get("schemas", {})
    for name, schema in facts.messages.items():
        if name not in known:
            lines += _schema_section(name, schema, facts)
    return lines


def _errors(facts: ApiFacts) -> list[str]:
    lines = ["## Error codes", "",
             "Every error is `application/problem+json` (`Problem` above; OpenAI routes use "
             "OpenAI's `{\"error\": ...}` envelope, `OpenAIError`) with one of these stable `code`s. "
             "When each is raised: [docs/api.md](../api.md#errors).", "",
             "| code | status | title | SDK exception (`phloem.api`) |", "|---|---|---|---|"]
    for row in facts.errors:
        lines.append(f"| `{row.code}` | {row.status} | {row.title} | `{row.exception}` |")
    return lines + [""]


def render_api_md(facts: ApiFacts) -> str:
    """The whole page.

    Args:
        facts: The inputs (see ``ApiFacts``).

    Returns:
        Markdown text ending with one newline.
    """
    info = facts.openapi["info"]
    lines = [
        "# HTTP API reference", "",
        f"<!-- Generated by `{facts.command}` from the server's OpenAPI schema. Do not edit: "
        "change the code, then regenerate. -->", "",
        f"{info['title']} {info['version']} · OpenAPI {facts.openapi['openapi']} · the machine-"
        "readable document is [openapi.json](openapi.json) (what a server returns at "
        "`/schema/openapi.json`, without the random `examples` Litestar invents). What the "
        "routes mean (sessions, turns, forks, streaming, idempotency, limits) is in "
        "[docs/api.md](../api.md); this page is the exact shape of every request and response.",
        "", " ".join(info.get("description", "").split()), "",
        "Headers that the schema does not list: `Authorization: Bearer <key>` (every `/v1` "
        "route when the server has keys; or `x-api-key: <key>`), `Idempotency-Key` on `POST`, `PATCH` and `DELETE` "
        "under `/v1/sessions` (answered with `Idempotent-Replayed: true` on a replay; see "
        "[idempotency](../api.md#idempotency)), `Retry-After` on 429 and 503, and "
        "`Location` on `201` from `POST /v1/sessions`.", "",
    ]
    lines += _index(facts) + [""]
    for title, ops in _grouped(facts.openapi):
        lines += [f"## {title}", ""]
        for method, path, op in ops:
            lines += _operation(facts, method, path, op)
        if title == _GROUPS[0][0]:
            for path, doc in facts.websockets:
                lines += _websocket(path, doc)
    lines += ["## Schemas", ""]
    for name, schema in facts.openapi.get("components", {}).get("schemas", {}).items():
        lines += _schema_section(name, schema, facts)
    lines += _messages(facts) + _errors(facts)
    return "\n".join(lines).rstrip("\n") + "\n"

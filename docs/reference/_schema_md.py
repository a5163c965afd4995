"""JSON Schema → Markdown: types, constraints and field tables (used by ``_openapi_md``).

Every ``$ref`` must point into ``#/components/schemas/`` (OpenAPI's components, or msgspec's
``schema_components`` with that ``ref_template``); it becomes a link to the schema's section,
whose anchor is ``schema_anchor(name)``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["cell", "constraints", "field_table", "schema_anchor", "type_of"]

_REF_PREFIX = "#/components/schemas/"
_BOUNDS = (
    ("minimum", "≥ {}"), ("exclusiveMinimum", "> {}"), ("maximum", "≤ {}"),
    ("exclusiveMaximum", "< {}"), ("minLength", "length ≥ {}"), ("maxLength", "length ≤ {}"),
    ("minItems", "items ≥ {}"), ("maxItems", "items ≤ {}"), ("minProperties", "keys ≥ {}"),
    ("maxProperties", "keys ≤ {}"), ("pattern", "pattern `{}`"),
)


def schema_anchor(name: str) -> str:
    """The anchor of a schema's section (explicit, so every Markdown renderer agrees)."""
    return f"schema-{name.lower()}"


def cell(text: str) -> str:
    """Make ``text`` safe inside one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ").strip() or "—"


def _number(value: Any) -> str:
    """``1.0`` → ``1`` (Litestar writes integer bounds as floats), other values as JSON."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return json.dumps(value, ensure_ascii=False)


def type_of(schema: dict[str, Any]) -> str:
    """A short type expression: ``integer``, ``list[string]``, ``dict[str, string]``, ``A | null``,
    links for references.

    Args:
        schema: A JSON Schema node.

    Returns:
        Markdown (not yet escaped for a table cell).
    """
    if "$ref" in schema:
        name = schema["$ref"].removeprefix(_REF_PREFIX)
        return f"[`{name}`](#{schema_anchor(name)})"
    for key in ("oneOf", "anyOf"):
        if key in schema:
            # ``null`` last: the order of a union's parts differs between schema generators.
            return " | ".join(sorted((type_of(part) for part in schema[key]), key=lambda t: t == "null"))
    if "enum" in schema:
        return " | ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(type_of({**schema, "type": k}) for k in kind)
    if kind == "array":
        items = schema.get("items")
        return f"list[{type_of(items)}]" if items else "list"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        values = schema["additionalProperties"]
        return f"dict[string, {type_of(values) if values else 'any'}]"
    if kind is None:
        return "any"
    return str(kind)


def constraints(schema: dict[str, Any]) -> str:
    """The bounds of a node and of the parts of its union (``≥ 1``, ``length ≤ 128``...)."""
    found: list[str] = []
    nodes = [schema, *schema.get("oneOf", []), *schema.get("anyOf", [])]
    for node in nodes:
        items = node.get("items") if isinstance(node.get("items"), dict) else None
        for source, prefix in ((node, ""), (items or {}, "each item ")):
            for key, template in _BOUNDS:
                if key in source:
                    text = prefix + template.format(_number(source[key]) if key != "pattern"
                                                    else source[key])
                    if text not in found:
                        found.append(text)
    return ", ".join(found)


def _default(schema: dict[str, Any]) -> str:
    if "default" in schema:
        return f"`{json.dumps(schema['default'], ensure_ascii=False)}`"
    return ""


def field_table(schema: dict[str, Any], *, descriptions: dict[str, str] | None = None) -> list[str]:
    """The rows of an object schema's field table (header included).

    Args:
        schema: An object schema with ``properties``.
        descriptions: Per-field descriptions where the schema has none.

    Returns:
        Markdown lines; a single line saying so when the object has no fields.
    """
    properties = schema.get("properties") or {}
    if not properties:
        return ["No fields."]
    required = set(schema.get("required") or ())
    lines = ["| field | type | required | default | constraints | description |",
             "|---|---|---|---|---|---|"]
    for name, node in properties.items():
        description = node.get("description") or (descriptions or {}).get(name, "")
        row = [f"`{name}`", type_of(node), "yes" if name in required else "no", _default(node),
               constraints(node), description]
        lines.append("| " + " | ".join(cell(part) for part in row) + " |")
    return lines

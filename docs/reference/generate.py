"""Regenerate the reference docs from the code: ``docs/reference/api.md``, ``openapi.json`` and
the generated tables of ``docs/configuration.md``.

    python3 docs/reference/generate.py             # rewrite the committed files in place
    python3 docs/reference/generate.py --out DIR   # write all three into DIR instead

``tests/docs/test_reference.py`` runs the second form and fails when the committed files differ.

The OpenAPI document is the one the server serves at ``/schema/openapi.json``: the generator
builds the real app (``phloem.api.server.app.create_app``) over the built-in tiny model in a
temporary data directory, without API keys, and asks Litestar for its schema; nothing is
started or served. Decision: Litestar fills response schemas with random ``examples`` (polyfactory/Faker:
values that change with those packages' versions and often break the schema's own bounds); they
are removed, so the output depends only on the code and the Litestar and msgspec versions.
Keys keep the order Litestar gives (the declaration order of each Struct's fields).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec

from _config_md import MissingDoc, dataclass_table, env_table, fill_blocks, flag_tables
from _openapi_md import ApiFacts, ErrorRow, render_api_md

__all__ = ["main"]

COMMAND = "python3 docs/reference/generate.py"
DOCS = Path(__file__).resolve().parents[1]


def _strip_examples(node: Any, properties: bool = False) -> Any:
    """Drop the ``examples`` keyword everywhere (but keep a property that is named so)."""
    if isinstance(node, dict):
        return {k: _strip_examples(v, k == "properties" and not properties)
                for k, v in node.items() if properties or k != "examples"}
    if isinstance(node, list):
        return [_strip_examples(v) for v in node]
    return node


def _route_docs(app: Any) -> tuple[dict[str, str], tuple[tuple[str, str], ...]]:
    """``"METHOD /path"`` → handler docstring, and the WebSocket routes with theirs."""
    from litestar.routes import HTTPRoute, WebSocketRoute

    http: dict[str, str] = {}
    sockets: list[tuple[str, str]] = []
    for route in app.routes:
        if isinstance(route, HTTPRoute):
            for handler in route.route_handlers:
                for method in handler.http_methods:
                    http[f"{method} {route.path_format}"] = inspect.cleandoc(handler.fn.__doc__ or "")
        elif isinstance(route, WebSocketRoute):
            doc = inspect.cleandoc(route.route_handler.fn.__doc__ or "")
            sockets.append((route.path_format, doc))
    return http, tuple(sorted(sockets))


def build_app_schema() -> tuple[dict[str, Any], dict[str, str], tuple[tuple[str, str], ...]]:
    """The app's OpenAPI document (normalized) and its handlers' docstrings."""
    from litestar.serialization import encode_json

    from phloem.api.server.app import create_app
    from phloem.api.server.config import HttpConfig
    from phloem.runtime import EngineClient, ensure_default_model
    from phloem.sessions import SessionConfig, SessionManager, Tokenizer, model_fingerprint

    with tempfile.TemporaryDirectory(prefix="phloem-docs-") as tmp:
        data_dir = Path(tmp)
        model = ensure_default_model(data_dir)
        engine = EngineClient.from_pretrained(model)
        sessions = SessionConfig(data_dir=data_dir, redis_prefix="phloem-docs:")
        manager = SessionManager(engine, Tokenizer.from_pretrained(model), sessions,
                                 model_fingerprint=model_fingerprint(model))
        app = create_app(HttpConfig(), engine, manager, model=str(model))
        schema = json.loads(encode_json(app.openapi_schema.to_schema()))
        http, sockets = _route_docs(app)
    return _strip_examples(schema), http, sockets




def _struct_docs() -> dict[str, str]:
    from phloem.api import schemas
    from phloem.api.server.openai import schemas as _openai_schemas

    docs: dict[str, str] = {}
    for module in (schemas, _openai_schemas):
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, msgspec.Struct) and value.__doc__:
                docs[name] = inspect.cleandoc(value.__doc__)
    return docs


def _error_rows() -> tuple[ErrorRow, ...]:
    """Each ``ErrorCode`` with its status and the exception the SDK raises for it."""
    from phloem.api.sdk._errors import error_from_response
    from phloem.api.schemas import ERROR_STATUS, ErrorCode, make_problem

    rows = []
    for code in ErrorCode:
        problem = make_problem(code, "docs")
        exc = error_from_response(ERROR_STATUS[code], msgspec.json.encode(problem), None)
        rows.append(ErrorRow(code.value, ERROR_STATUS[code], problem.title, type(exc).__name__))
    return tuple(rows)


def api_facts() -> ApiFacts:
    """Gather every input of ``api.md`` from the code."""
    from phloem.api.schemas import ClientMessage, ServerEvent, StreamEvent

    openapi, http, sockets = build_app_schema()
    roots, components = msgspec.json.schema_components(
        [StreamEvent, ClientMessage, ServerEvent], ref_template="#/components/schemas/{name}")
    titles = ("SSE events of a streamed append", "WebSocket client messages",
              "WebSocket server events")
    return ApiFacts(openapi=openapi, handler_docs=http, websockets=sockets,
                    messages=dict(sorted(components.items())), message_roots=tuple(zip(titles, roots)),
                    struct_docs=_struct_docs(), errors=_error_rows(), command=COMMAND)


def _env_flags(parser_of: Any, env_type: type) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Which flags take their default from which ``PHLOEM_*`` variable (see ``_config_md``)."""
    from _config_md import commands

    from phloem.runtime.env import PREFIX

    by_flag: dict[str, str] = {}
    by_var: dict[str, list[str]] = {}
    for f in dataclasses.fields(env_type):
        var = PREFIX + f.name.upper()
        sentinel: object = 54321 if "int" in str(f.type) else f"@{var}@"
        sentinel = Path(f"/{var}") if "Path" in str(f.type) else sentinel
        parser = parser_of(env_type(**{f.name: sentinel}))
        for prog, sub in commands(parser):
            flags = [a.option_strings[-1] for a in sub._actions
                     if a.option_strings and a.default == sentinel]
            by_var.setdefault(var, []).extend(f"{prog} {flag}" for flag in flags)
            by_flag.update({f"{prog} {flag}": var for flag in flags})
            if any(v == sentinel for v in sub._defaults.values()) and not flags:
                by_var[var].append(prog)
    return by_flag, by_var


def config_blocks() -> dict[str, list[str]]:
    """The generated blocks of ``docs/configuration.md``, by name."""
    from phloem.api.server.config import HttpConfig
    from phloem.cli.config import ServerConfig
    from phloem.cli.main import build_parser
    from phloem.engine import config as engine_config
    from phloem.runtime import env
    from phloem.runtime.pd.roles import PDConfig
    from phloem.sessions.config import SessionConfig

    by_flag, by_var = _env_flags(build_parser, env.EnvSettings)
    blocks = {"cli": flag_tables(build_parser(env.EnvSettings()), by_flag),
              "env": env_table(env.VARIABLES, by_var)}
    for cls in (ServerConfig, HttpConfig, PDConfig, engine_config.EngineConfig, SessionConfig, engine_config.CacheConfig,
                engine_config.SchedulerConfig, engine_config.RunnerConfig,
                engine_config.ParallelConfig, engine_config.LoadConfig, engine_config.GrammarConfig,
                engine_config.SpeculativeConfig):
        blocks[cls.__name__] = dataclass_table(cls)
    blocks["ModelConfig"] = dataclass_table(
        engine_config.ModelConfig, fallback=lambda name: "read from `config.json` (see above)")
    return blocks


def generate(out: Path | None) -> list[Path]:
    """Write the three files (into ``out``, or over the committed ones); return their paths."""
    page = DOCS / "configuration.md"
    targets = {"api.md": DOCS / "reference" / "api.md",
               "openapi.json": DOCS / "reference" / "openapi.json",
               "configuration.md": page}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        targets = {name: out / name for name in targets}
    facts = api_facts()
    texts = {"api.md": render_api_md(facts),
             "openapi.json": json.dumps(facts.openapi, indent=2, ensure_ascii=False) + "\n",
             "configuration.md": fill_blocks(page.read_text(encoding="utf-8"), config_blocks(), page)}
    for name, path in targets.items():
        path.write_text(texts[name], encoding="utf-8")
    return list(targets.values())


def main(argv: list[str] | None = None) -> int:
    """Command line: ``[--out DIR]``; returns the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"examples:\n  {COMMAND}\n  {COMMAND} --out /tmp/docs   # compare with the committed files")
    parser.add_argument("--out", metavar="DIR", type=Path,
                        help="write into DIR instead of over the committed files")
    args = parser.parse_args(argv)
    try:
        written = generate(args.out)
    except MissingDoc as exc:
        sys.stderr.write(f"generate.py: {exc}\n")
        return 1
    sys.stdout.write("".join(f"wrote {p}\n" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())

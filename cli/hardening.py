"""``phloem serve``'s tenancy and hardening flags (docs/api.md, "Security model"), apart from
``cli.main`` so that it stays one page: the shared prefixes, the ``Host`` / ``Origin`` names
answered, the API pages, connection limits and the idempotency quota."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from phloem.runtime.shared_prefixes import read_shared_prefix_file

__all__ = ["add_hardening_flags", "hardening_config"]


def add_hardening_flags(serve: argparse.ArgumentParser, defaults: dict[str, object]) -> None:
    """Add the group to ``serve``; ``defaults`` are ``ServerConfig``'s field defaults."""
    group = serve.add_argument_group("tenancy and hardening", "docs/api.md, \"Security model\".")
    group.add_argument("--shared-prefix-file", metavar="FILE", type=Path,
                       help="JSON Lines of prefixes (system prompts) every key may hit in the "
                            "prefix cache, which is otherwise partitioned by key")
    group.add_argument("--allowed-host", metavar="HOST", action="append", default=[],
                       help="also accept this Host / Origin name (repeatable); without API keys "
                            "only loopback names are accepted otherwise")
    group.add_argument("--docs-ui", action="store_true", help="serve the interactive API pages under /schema")
    for flag, name, what in (("--header-timeout", "header_timeout_s", "that has not sent a whole request head"),
                             ("--keepalive-timeout", "keepalive_timeout_s", "idle between requests")):
        group.add_argument(flag, metavar="SECONDS", type=float, default=defaults[name],
                           help=f"close a connection {what} after this long (default: %(default)s)")
    group.add_argument("--max-connections", metavar="N", type=int, default=defaults["max_connections"],
                       help="open connections at most; more are closed at once (default: %(default)s)")
    group.add_argument("--idempotency-quota", metavar="N", type=int, default=defaults["idempotency_entries_per_key"],
                       help="Idempotency-Key outcomes one key keeps; beyond, its own oldest go (default: %(default)s)")


def hardening_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ServerConfig`` fields of those flags.

    Raises:
        ValueError: The shared-prefix file cannot be read or parsed (a usage error).
    """
    prefixes = read_shared_prefix_file(args.shared_prefix_file) if args.shared_prefix_file else ()
    return {"shared_prefixes": prefixes, "allowed_hosts": tuple(args.allowed_host), "docs_ui": args.docs_ui,
            "header_timeout_s": args.header_timeout, "keepalive_timeout_s": args.keepalive_timeout,
            "max_connections": args.max_connections, "idempotency_entries_per_key": args.idempotency_quota}

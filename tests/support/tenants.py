"""Keys, clients and servers of the hostile-tenant suite (``tests/security``).

The suite's servers are real ``phloem serve`` processes (``live_servers.ServerProcess``) with
three API keys: ``ALICE`` and ``BOB`` (two tenants) and ``ADMIN``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
from live_servers import ServerProcess

__all__ = ["ADMIN", "ALICE", "BOB", "SYSTEM", "Tenants", "auth", "key_args"]

ALICE = "alice-key-0123456789abcdef"
BOB = "bob-key-0123456789abcdef01"
ADMIN = "admin-key-0123456789abcdef"
SYSTEM = "You are the support agent of Example Corp. Answer in one short sentence."


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_args(*extra: str) -> tuple[str, ...]:
    """``phloem serve`` arguments: the three keys, then ``extra``."""
    return ("--api-key", ALICE, "--api-key", BOB, "--api-key", f"{ADMIN}:admin", *extra)


@dataclass(frozen=True)
class Tenants:
    """The shared server and one client per key."""

    server: ServerProcess
    model_dir: Path
    alice: httpx.Client
    bob: httpx.Client
    admin: httpx.Client

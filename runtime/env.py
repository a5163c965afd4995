"""The one place that reads environment variables; every one is spelled ``PHLOEM_<NAME>``.

    PHLOEM_DATA_DIR    data directory (models, spilled sessions, index)   default ~/.phloem
    PHLOEM_MODEL       model folder served by ``phloem serve``            default: built-in demo model
    PHLOEM_HOST        bind address of ``phloem serve``
    PHLOEM_PORT        port of ``phloem serve``
    PHLOEM_REDIS_URL   Redis index URL (unset: embedded SQLite index)
    PHLOEM_DEVICE      torch device of the engine
    PHLOEM_DTYPE       weight dtype of the engine
    PHLOEM_API_KEY     API key the SDK sends (``phloem demo``)

The variables only supply defaults: the CLI's flags win, and the config dataclasses never read
the environment themselves except ``ServerConfig.data_dir``'s default (``default_data_dir``).
A value that does not parse raises ``ValueError`` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PREFIX", "EnvSettings", "default_data_dir", "read_env"]

PREFIX = "PHLOEM_"


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """The ``PHLOEM_*`` variables that are set; ``None`` for each one that is not."""

    data_dir: Path | None = None
    model: str | None = None
    host: str | None = None
    port: int | None = None
    redis_url: str | None = None
    device: str | None = None
    dtype: str | None = None
    api_key: str | None = None


def read_env(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """Read every ``PHLOEM_*`` variable Phloem knows.

    Args:
        environ: The environment to read; ``os.environ`` when None (tests pass a dict).

    Returns:
        The settings; an unset or empty variable is ``None``.

    Raises:
        ValueError: ``PHLOEM_PORT`` is not an integer.
    """
    env = os.environ if environ is None else environ

    def get(name: str) -> str | None:
        return env.get(PREFIX + name) or None

    port = get("PORT")
    if port is not None and not port.strip().isdigit():
        raise ValueError(f"{PREFIX}PORT: expected an integer port, got {port!r}")
    data_dir = get("DATA_DIR")
    return EnvSettings(
        data_dir=Path(data_dir).expanduser() if data_dir else None,
        model=get("MODEL"),
        host=get("HOST"),
        port=int(port) if port is not None else None,
        redis_url=get("REDIS_URL"),
        device=get("DEVICE"),
        dtype=get("DTYPE"),
        api_key=get("API_KEY"),
    )


def default_data_dir() -> Path:
    """``$PHLOEM_DATA_DIR`` if set, else ``~/.phloem`` (not created here)."""
    return read_env().data_dir or Path("~/.phloem").expanduser()

"""The one place that reads environment variables; every one is spelled ``PHLOEM_<NAME>``.

    PHLOEM_DATA_DIR    data directory (models, spilled sessions, index)   default ~/.phloem
    PHLOEM_MODEL       model folder served by ``phloem serve``            default: built-in demo model
    PHLOEM_HOST        bind address of ``phloem serve``
    PHLOEM_PORT        port of ``phloem serve``
    PHLOEM_REDIS_URL   Redis index URL (unset: embedded SQLite index)
    PHLOEM_REDIS_PREFIX  namespace of the index's Redis keys                default phloem:
    PHLOEM_DEVICE      torch device of the engine
    PHLOEM_DTYPE       weight dtype of the engine
    PHLOEM_API_KEY     API key: the one ``phloem serve`` accepts (``KEY`` or ``KEY:admin``;
                       default of ``--api-key``) and the one the SDK sends (``phloem demo``)
    PHLOEM_API_KEYS_FILE  default of ``phloem serve --api-keys-file``
    PHLOEM_LOG_FORMAT  ``text`` or ``json``: default of ``phloem serve --log-format``
    PHLOEM_LOG_LEVEL   ``debug``/``info``/``warning``/``error``: default of ``--log-level``
    PHLOEM_NO_PROGRESS ``1``/``true``/``yes``: no progress bars (as ``--no-progress``);
                       ``0``/``false``/``no``: bars when stderr is a terminal

Two variables of other projects are set here (never overridden when already set), by
``use_kernel_caches``, so that compiled kernels persist with the data directory:

    TRITON_CACHE_DIR            Triton's compiled kernels       phloem serve: <data-dir>/kernel-cache/triton
    FLASHINFER_WORKSPACE_BASE   FlashInfer's JIT modules        phloem serve: <data-dir>/kernel-cache/flashinfer

The variables only supply defaults: the CLI's flags win, and the config dataclasses never read
the environment themselves except ``ServerConfig.data_dir``'s default (``default_data_dir``) and
``SessionConfig.redis_prefix``'s (``default_redis_prefix``).
A value that does not parse raises ``ValueError`` naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PREFIX", "EnvSettings", "default_data_dir", "default_redis_prefix", "read_env",
           "use_kernel_caches"]

PREFIX = "PHLOEM_"


@dataclass(frozen=True, slots=True)
class EnvSettings:
    """The ``PHLOEM_*`` variables that are set; ``None`` for each one that is not."""

    data_dir: Path | None = None
    model: str | None = None
    host: str | None = None
    port: int | None = None
    redis_url: str | None = None
    redis_prefix: str | None = None
    device: str | None = None
    dtype: str | None = None
    api_key: str | None = field(default=None, repr=False)
    api_keys_file: Path | None = None
    log_format: str | None = None
    log_level: str | None = None
    no_progress: bool = False


def read_env(environ: Mapping[str, str] | None = None) -> EnvSettings:
    """Read every ``PHLOEM_*`` variable Phloem knows.

    Args:
        environ: The environment to read; ``os.environ`` when None (tests pass a dict).

    Returns:
        The settings; an unset or empty variable is ``None``.

    Raises:
        ValueError: ``PHLOEM_PORT`` is not an integer, or ``PHLOEM_NO_PROGRESS`` not a boolean.
    """
    env = os.environ if environ is None else environ

    def get(name: str) -> str | None:
        return env.get(PREFIX + name) or None

    port = get("PORT")
    if port is not None and not port.strip().isdigit():
        raise ValueError(f"{PREFIX}PORT: expected an integer port, got {port!r}")
    data_dir = get("DATA_DIR")
    keys_file = get("API_KEYS_FILE")
    return EnvSettings(
        data_dir=Path(data_dir).expanduser() if data_dir else None,
        model=get("MODEL"),
        host=get("HOST"),
        port=int(port) if port is not None else None,
        redis_url=get("REDIS_URL"),
        redis_prefix=get("REDIS_PREFIX"),
        device=get("DEVICE"),
        dtype=get("DTYPE"),
        api_key=get("API_KEY"),
        api_keys_file=Path(keys_file).expanduser() if keys_file else None,
        log_format=get("LOG_FORMAT"),
        log_level=get("LOG_LEVEL"),
        no_progress=_flag("NO_PROGRESS", get("NO_PROGRESS")),
    )


def _flag(name: str, value: str | None) -> bool:
    if value is None or value.strip().lower() in ("0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{PREFIX}{name}: expected 1/true/yes/on or 0/false/no/off, got {value!r}")


def default_data_dir() -> Path:
    """``$PHLOEM_DATA_DIR`` if set, else ``~/.phloem`` (not created here)."""
    return read_env().data_dir or Path("~/.phloem").expanduser()


def default_redis_prefix() -> str:
    """``$PHLOEM_REDIS_PREFIX`` if set, else ``phloem:`` (several servers or tests can share a
    Redis server under distinct prefixes)."""
    return read_env().redis_prefix or "phloem:"


_KERNEL_CACHES = {"TRITON_CACHE_DIR": "triton", "FLASHINFER_WORKSPACE_BASE": "flashinfer"}


def use_kernel_caches(cache_dir: Path, environ: MutableMapping[str, str] | None = None) -> dict[str, Path]:
    """Keep Triton's and FlashInfer's compiled kernels under ``cache_dir``, unless their own
    variables already say where.

    Both read their variable when first imported, so this runs before anything imports torch;
    the tensor-parallel worker processes inherit it. Their defaults (``~/.triton/cache``,
    ``~/.cache/flashinfer``) live in the home directory, which a container loses on restart;
    the data directory is the volume that survives, so the second start compiles nothing.

    Args:
        cache_dir: The folder (``<data-dir>/kernel-cache`` for ``phloem serve``).
        environ: The environment to change; ``os.environ`` when None (tests pass a dict).

    Returns:
        Each variable and the folder it names now.
    """
    env = os.environ if environ is None else environ
    for name, sub in _KERNEL_CACHES.items():
        if not env.get(name):
            env[name] = str(cache_dir / sub)
    return {name: Path(env[name]) for name in _KERNEL_CACHES}

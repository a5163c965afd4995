"""The one place that reads environment variables; every one is spelled ``PHLOEM_<NAME>``.

``VARIABLES`` is the table of them (name, type, default, meaning, and where the value goes); each
variable is spelled once, in its row: ``EnvSettings`` (the server's and the CLI's variables) is
generated from the rows without a ``kernel_field``, ``read_env`` parses exactly those rows, and
``kernel_config`` the rows with one (``KernelConfig``). ``docs/configuration.md`` lists exactly
that table (``tests/docs/test_configuration.py``).

Three variables of other projects are set here (never overridden when already set): by
``use_kernel_caches``, so that compiled kernels persist with the data directory, and by
``use_nccl_defaults``, before the runtime builds an engine (the engine reads and writes no
environment; its tensor-parallel workers and PD links inherit this process's):

    TRITON_CACHE_DIR            Triton's compiled kernels       phloem serve: <data-dir>/kernel-cache/triton
    FLASHINFER_WORKSPACE_BASE   FlashInfer's JIT modules        phloem serve: <data-dir>/kernel-cache/flashinfer
    NCCL_NVLS_ENABLE            NCCL's NVLink multicast         0 (off)

The variables only supply defaults: the CLI's flags win, and the config dataclasses never read
the environment themselves except ``SessionConfig.data_dir``'s default (``default_data_dir``) and
``SessionConfig.redis_prefix``'s (``default_redis_prefix``).
A value that does not parse raises ``ValueError`` naming the variable.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from phloem.kernels.config import KernelConfig

__all__ = ["PREFIX", "VARIABLES", "EnvSettings", "EnvVar", "default_data_dir", "default_redis_prefix",
           "kernel_config", "read_env", "use_kernel_caches", "use_nccl_defaults"]

PREFIX = "PHLOEM_"

EnvType = Literal["str", "int", "path", "bool", "auto | torch | triton"]


def _tristate(name: str, value: str) -> bool:
    if value.strip().lower() in ("0", "false", "no", "off"):
        return False
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{name}: expected 1/true/yes/on or 0/false/no/off, got {value!r}")


def _integer(name: str, value: str) -> int:
    if not value.strip().isdigit():
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    return int(value)


def _port(name: str, value: str) -> int:
    if not value.strip().isdigit():
        raise ValueError(f"{name}: expected an integer port, got {value!r}")
    return int(value)


def _text(name: str, value: str) -> str:
    """The value as given (a ``path`` kept as text: ``PHLOEM_MODEL`` names a folder, unexpanded)."""
    return value


def _backend(name: str, value: str) -> str:
    backend = value.strip().lower() or "auto"
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"{name} must be 'auto', 'torch', 'triton' or unset, got {backend!r}")
    return backend


# How a non-empty value of each type is parsed (the variable's name is passed for the error).
_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "str": lambda name, value: value,
    "int": _integer,
    "path": lambda name, value: Path(value).expanduser(),
    "bool": _tristate,
    "auto | torch | triton": _backend,
}
_TYPES: dict[str, Any] = {"str": str, "int": int, "path": Path, "bool": bool}


@dataclass(frozen=True, slots=True)
class EnvVar:
    """One ``PHLOEM_*`` variable: its full name, the type of its value, its default (what applies
    when it is unset or empty) and what it means; where its value goes: the ``EnvSettings`` field
    named after it (``PHLOEM_DATA_DIR`` → ``data_dir``), or, with ``kernel_field``, that
    ``KernelConfig`` field. ``parse`` overrides the type's parser; ``secret`` keeps the value
    out of ``EnvSettings``' repr."""

    name: str
    type: EnvType
    default: str
    help: str
    kernel_field: str | None = None
    parse: Callable[[str, str], Any] | None = None
    secret: bool = False

    @property
    def field(self) -> str:
        """The ``EnvSettings`` field (or the ``KernelConfig`` one) the variable sets."""
        return self.kernel_field or self.name.removeprefix(PREFIX).lower()

    def read(self, env: Mapping[str, str]) -> Any:
        """The parsed value; None when unset or empty."""
        value = env.get(self.name) or None
        if value is None or not value.strip():
            return None
        return (self.parse or _PARSERS[self.type])(self.name, value)


VARIABLES: tuple[EnvVar, ...] = (
    EnvVar("PHLOEM_DATA_DIR", "path", "~/.phloem", "data directory (models, spilled sessions, index)"),
    EnvVar("PHLOEM_MODEL", "path", "built-in trained model", "model folder served by `phloem serve`",
           parse=_text),
    EnvVar("PHLOEM_HOST", "str", "127.0.0.1", "bind address of `phloem serve`"),
    EnvVar("PHLOEM_PORT", "int", "8000", "port of `phloem serve`", parse=_port),
    EnvVar("PHLOEM_REDIS_URL", "str", "embedded SQLite index", "Redis URL of the session index"),
    EnvVar("PHLOEM_REDIS_PREFIX", "str", "phloem:", "namespace of the index's Redis keys"),
    EnvVar("PHLOEM_DEVICE", "str", "cpu", "torch device of the engine"),
    EnvVar("PHLOEM_DTYPE", "str", "auto", "weight dtype of the engine"),
    EnvVar("PHLOEM_API_KEY", "str", "none",
           "API key: the one `phloem serve` accepts (`KEY` or `KEY:admin`; default of `--api-key`) "
           "and the one the SDK sends (`phloem demo`)", secret=True),
    EnvVar("PHLOEM_API_KEYS_FILE", "path", "none", "default of `phloem serve --api-keys-file`"),
    EnvVar("PHLOEM_LOG_FORMAT", "str", "text", "`text` or `json`: default of `phloem serve --log-format`"),
    EnvVar("PHLOEM_LOG_LEVEL", "str", "info", "`debug`/`info`/`warning`/`error`: default of `--log-level`"),
    EnvVar("PHLOEM_NO_PROGRESS", "bool", "0",
           "on: no progress bars (as `--no-progress`); off: bars when stderr is a terminal"),
    EnvVar("PHLOEM_KERNELS", "auto | torch | triton", "auto",
           "`KernelConfig.backend`: `torch` or `triton` forces the kernel backend; `auto` picks Triton on a "
           "CUDA device when `triton` imports, else the torch references (which run without CUDA graphs: they "
           "read values on the host). Forcing Triton off CUDA needs `TRITON_INTERPRET=1` (tests only)",
           kernel_field="backend"),
    EnvVar("PHLOEM_TRITON_GEMV", "bool", "1",
           "`KernelConfig.triton_gemv`: one-token `linear` calls (the LM head, the unfused projections) run "
           "the Triton GEMV of `kernels/linear/triton_gemv.py`; off: cuBLAS", kernel_field="triton_gemv"),
    EnvVar("PHLOEM_TRITON_DECODE_ATTENTION", "bool", "1",
           "`KernelConfig.triton_decode_attention`: pure-decode steps of fp16/bf16 models run the split-KV "
           "Triton kernel of `kernels/attention/triton_decode.py` (with the attention prologue inside it); "
           "off: FlashInfer's decode wrapper. Both serve the decode rows of mixed steps too; prefill chunks "
           "always run FlashInfer's prefill", kernel_field="triton_decode_attention"),
    EnvVar("PHLOEM_FUSED_DECODE", "bool", "1",
           "`KernelConfig.fused_decode`: a one-token decode step calls the fused projections of "
           "`kernels/linear/reference.py` (under TP with the all-reduce in front of each norm prologue) "
           "and, at TP=1, folds each MoE router into the projection before it "
           "(`kernels/moe/route_partial.py`); off: the unfused ops", kernel_field="fused_decode"),
    EnvVar("PHLOEM_PDL", "bool", "auto (on for sm_90+)",
           "`KernelConfig.pdl`: the decode Triton kernels launch with programmatic dependent launch "
           "(`kernels/common/pdl.py`; the same results bit for bit); unset: on where the GPU is sm_90 or newer",
           kernel_field="pdl"),
    EnvVar("PHLOEM_ONE_SHOT_ALLREDUCE", "bool", "0",
           "`KernelConfig.one_shot_allreduce`: tensor parallelism's small all-reduces on GPUs run the "
           "one-shot NVLink all-reduce + add + RMSNorm kernel (`engine/parallel/one_shot_allreduce.py`); off: NCCL, then "
           "the `add_rms_norm` kernel", kernel_field="one_shot_allreduce"),
    EnvVar("PHLOEM_FP8_W8A8", "bool", "0",
           "`KernelConfig.fp8_w8a8`: prefill and batched steps of block-FP8 weights quantize the activations "
           "per token and 128-column group and run the FP8 tensor-core GEMMs of `kernels/linear/triton_w8a8.py` "
           "(dense projections) and `kernels/moe/triton_grouped_w8a8.py` (MoE experts, grouped by expert); "
           "off: the weights dequantized to the model dtype, then a bf16 matmul", kernel_field="fp8_w8a8"),
)

_SETTINGS = tuple(v for v in VARIABLES if v.kernel_field is None)
_KERNEL_VARIABLES = tuple(v for v in VARIABLES if v.kernel_field is not None)


def _settings_field(var: EnvVar) -> tuple[str, Any, Any]:
    if var.type == "bool":  # a switch: unset is off
        return var.field, bool, dataclasses.field(default=False)
    kind = str if var.parse is _text else _TYPES[var.type]
    return var.field, kind | None, dataclasses.field(default=None, repr=not var.secret)


EnvSettings = dataclasses.make_dataclass(
    "EnvSettings", [_settings_field(v) for v in _SETTINGS], frozen=True, slots=True)
EnvSettings.__module__ = __name__
EnvSettings.__doc__ = """The ``PHLOEM_*`` variables that are set (one field per ``VARIABLES`` row without a
``kernel_field``, named after it); ``None`` (a switch: False) for each one that is not."""


def read_env(environ: Mapping[str, str] | None = None) -> Any:
    """Read every ``PHLOEM_*`` variable of ``EnvSettings``.

    Args:
        environ: The environment to read; ``os.environ`` when None (tests pass a dict).

    Returns:
        The ``EnvSettings``; an unset or empty variable is ``None`` (a switch: False).

    Raises:
        ValueError: A variable does not parse as its type (``PHLOEM_PORT`` not an integer,
            ``PHLOEM_NO_PROGRESS`` not a boolean); the message names it.
    """
    env = os.environ if environ is None else environ
    values = {v.field: v.read(env) for v in _SETTINGS}
    return EnvSettings(**{name: value for name, value in values.items() if value is not None})


def kernel_config(environ: Mapping[str, str] | None = None) -> KernelConfig:
    """The kernel choices of the ``PHLOEM_*`` kernel variables (the ``VARIABLES`` rows with a
    ``kernel_field``); each one unset or empty keeps ``KernelConfig``'s default.

    Args:
        environ: The environment to read; ``os.environ`` when None (tests pass a dict).

    Returns:
        The config for ``kernels.dispatch.get_ops`` and the engine.

    Raises:
        ValueError: ``PHLOEM_KERNELS`` is not ``auto``, ``torch`` or ``triton``, or a boolean
            variable is not one.
    """
    env = os.environ if environ is None else environ
    values = {v.field: v.read(env) for v in _KERNEL_VARIABLES}
    return KernelConfig(**{name: value for name, value in values.items() if value is not None})


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


# NVLink multicast (NVLS) stays off: the machines we run on do not support it (docs/decisions.md).
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0"}


def use_nccl_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set NCCL's process-level settings (``NCCL_DEFAULTS``) that are not already set.

    NCCL reads its variables when a communicator is created: rank 0's tensor-parallel group and
    a PD link's data group in this process, and the worker ranks, which ``torch.multiprocessing``
    spawns with this process's environment. So the runtime calls this before it builds an
    engine; a program that uses ``Engine`` directly on several GPUs calls it too (or exports the
    variables). A value already set wins.

    Args:
        environ: The environment to change; ``os.environ`` when None (tests pass a dict).

    Returns:
        Each variable and its value now.
    """
    env = os.environ if environ is None else environ
    for name, value in NCCL_DEFAULTS.items():
        env.setdefault(name, value)
    return {name: env[name] for name in NCCL_DEFAULTS}

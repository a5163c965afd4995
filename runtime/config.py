"""Configuration of the processes: the server (``ServerConfig``) and its engine (``EngineOptions``).

Both are frozen, slotted and validated in ``__post_init__`` (a ``ValueError`` names the field and
the value). Neither reads the environment, except the default of ``ServerConfig.data_dir``
(``runtime.env``). The engine's own dataclasses (``engine.config``) validate the engine knobs a
second time when ``Engine.from_pretrained`` builds them; the checks here only catch what would
otherwise fail late, in the engine thread, after the server has started.

Decision: ``ServerConfig.device`` / ``dtype`` / ``tensor_parallel_size`` are the server's flags;
``ServerConfig.engine`` optionally carries every other engine knob, and must then agree on them (two
different answers are an error, never silently resolved). ``ServerConfig.engine_options`` is what
to pass on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from phloem.runtime.env import default_data_dir

__all__ = ["DTYPES", "LOAD_FORMATS", "EngineOptions", "ServerConfig"]

DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("safetensors", "dummy")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# engine.config.MAX_TP_SIZE, repeated: importing phloem.engine would import torch.
_MAX_TP_SIZE = 8
_POSITIVE_OPTIONS = (
    "page_size",
    "num_pages",
    "num_state_slots",
    "cpu_pool_bytes",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
)


def _check_tp_size(name: str, size: int | None) -> None:
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= _MAX_TP_SIZE):
        raise ValueError(f"{name}: expected an integer in [1, {_MAX_TP_SIZE}], got {size!r}")


def _check_device(name: str, device: str) -> None:
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda") or (":" in device and not device.split(":", 1)[1].isdigit()):
        raise ValueError(f"{name}: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Keyword options of ``Engine.from_pretrained``; ``None`` keeps the engine's own default.

    Args:
        load_format: ``"safetensors"`` (read the folder) or ``"dummy"`` (random weights of the
            real shapes, for benchmarks).
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: one of ``DTYPES``; ``"auto"`` takes the checkpoint's dtype.
        seed: seed of dummy weights.
        page_size: tokens per KV page (a power of two).
        num_pages / num_state_slots: explicit pool sizes (else sized from free memory).
        cpu_pool_bytes: pool budget on CPU.
        enable_prefix_caching: keep finished prefixes in the radix cache.
        checkpoint_interval: GDN checkpoint every this many prefill tokens (0 disables).
        max_num_batched_tokens / max_num_seqs / max_model_len: scheduler limits.
        tensor_parallel_size: ranks (processes; GPUs on CUDA) running the model, 1 to 8.
    """

    load_format: str = "safetensors"
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 0
    page_size: int | None = None
    num_pages: int | None = None
    num_state_slots: int | None = None
    cpu_pool_bytes: int | None = None
    enable_prefix_caching: bool = True
    checkpoint_interval: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: expected one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        _check_device("device", self.device)
        if self.seed < 0:
            raise ValueError(f"seed: expected >= 0, got {self.seed}")
        for name in _POSITIVE_OPTIONS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")
        if self.checkpoint_interval is not None and self.checkpoint_interval < 0:
            raise ValueError(f"checkpoint_interval: expected >= 0 or None, got {self.checkpoint_interval}")
        _check_tp_size("tensor_parallel_size", self.tensor_parallel_size)

    def as_kwargs(self) -> dict[str, object]:
        """The keyword arguments for ``Engine.from_pretrained`` (``None`` fields left out)."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything ``phloem serve`` needs.

    Args:
        host: bind address.
        port: TCP port (0: any free port).
        model: Hugging Face model folder; ``None`` means the built-in demo model with random
            weights (``runtime.default_model.ensure_default_model(data_dir)``).
        data_dir: models, spilled sessions and the embedded index live here.
        redis_url: ``redis://``, ``rediss://`` or ``unix://`` URL of the session index;
            ``None`` uses the embedded SQLite index in ``data_dir``.
        device: torch device of the engine.
        dtype: weight dtype (one of ``DTYPES``).
        default_ttl_s: seconds a session stays pinned after a turn when it names no TTL.
        max_body_bytes: largest accepted request body.
        tensor_parallel_size: ranks running the model (``--tp``), 1 to 8.
        engine: every other engine knob; its ``device``, ``dtype`` and ``tensor_parallel_size``
            must equal the fields above.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    data_dir: Path = field(default_factory=default_data_dir)
    redis_url: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    default_ttl_s: float = 300.0
    max_body_bytes: int = 8 * 1024 * 1024
    tensor_parallel_size: int = 1
    engine: EngineOptions | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError(f"host: expected a host name or address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected an integer in [0, 65535], got {self.port!r}")
        if self.model is not None and not self.model:
            raise ValueError("model: expected a model folder or None, got ''")
        if not isinstance(self.data_dir, Path):
            raise ValueError(f"data_dir: expected a pathlib.Path, got {self.data_dir!r}")
        if self.redis_url is not None and not self.redis_url.startswith(_REDIS_SCHEMES):
            raise ValueError(f"redis_url: expected a URL starting with {_REDIS_SCHEMES}, got {self.redis_url!r}")
        _check_device("device", self.device)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        if not 0.0 <= self.default_ttl_s <= 86_400.0:
            raise ValueError(f"default_ttl_s: expected seconds in [0, 86400], got {self.default_ttl_s!r}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes: expected > 0, got {self.max_body_bytes}")
        _check_tp_size("tensor_parallel_size", self.tensor_parallel_size)
        if self.engine is not None and (self.engine.device, self.engine.dtype) != (self.device, self.dtype):
            raise ValueError(
                f"engine: its device/dtype ({self.engine.device!r}, {self.engine.dtype!r}) must equal "
                f"ServerConfig.device/dtype ({self.device!r}, {self.dtype!r})"
            )
        if self.engine is not None and (self.engine.tensor_parallel_size or 1) != self.tensor_parallel_size:
            raise ValueError(
                f"engine: its tensor_parallel_size ({self.engine.tensor_parallel_size!r}) must equal "
                f"ServerConfig.tensor_parallel_size ({self.tensor_parallel_size!r})"
            )

    @property
    def engine_options(self) -> EngineOptions:
        """The options to build the engine with."""
        if self.engine is not None:
            return self.engine
        tp = self.tensor_parallel_size if self.tensor_parallel_size > 1 else None
        return EngineOptions(device=self.device, dtype=self.dtype, tensor_parallel_size=tp)

    @property
    def models_dir(self) -> Path:
        """Where downloaded and built-in models live: ``data_dir / "models"``."""
        return self.data_dir / "models"

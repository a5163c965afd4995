"""Configuration of the server process (``ServerConfig``) and of its engine (``EngineConfig``).

Both are frozen, slotted and validated in ``__post_init__`` (a ``ValueError`` names the field and
the value), so a bad flag fails before the server starts, never in the engine thread. Neither
reads the environment, except the default of ``ServerConfig.data_dir`` (``runtime.env``).
``engine.config`` imports without torch, so the CLI builds the ``EngineConfig`` itself.

Decision: without API keys the server serves one anonymous owner, so ``ServerConfig`` refuses a
non-loopback ``host`` unless ``allow_remote_without_auth`` says so explicitly. API keys are
``ApiKey`` values whose ``repr`` hides the secret, so printing a config never leaks one.

Decision: ``ServerConfig.device`` / ``dtype`` / ``tensor_parallel_size`` / ``max_context_len`` are
the server's flags; ``ServerConfig.engine`` optionally carries every other engine option, and must
then agree on them (two different answers are an error, never silently resolved).
``ServerConfig.engine_config`` is what to build the engine from.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from phloem.engine.config import MAX_TP_SIZE, EngineConfig, LoadConfig, ParallelConfig, SchedulerConfig
from phloem.runtime.env import default_data_dir
from phloem.runtime.pd.roles import PDConfig
from phloem.runtime.shared_prefixes import SharedPrefix

__all__ = ["DTYPES", "LOAD_FORMATS", "LOG_FORMATS", "LOG_LEVELS", "ApiKey", "EngineConfig",
           "ServerConfig", "is_loopback", "parse_api_key", "read_api_keys_file"]

DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("safetensors", "dummy")
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


# RFC 6750 b64token characters, no ':' (it separates the role in `key:admin`).
_API_KEY_RE = re.compile(r"[A-Za-z0-9._~+/=-]+")
MIN_API_KEY_LEN = 16
MAX_API_KEY_LEN = 256


# Seconds an idle keep-alive connection stays open by default. Longer than any client keeps one
# idle (httpx, so the SDK and openai: 5 s; a load balancer: 60 s): when both sides expire it after
# the same time, a client reuses it just as the server closes it, and the request it sent is lost
# (ECONNRESET, httpx.ReadError). uvicorn's default is 5 s.
DEFAULT_KEEPALIVE_S = 75.0

@dataclass(frozen=True, slots=True)
class ApiKey:
    """One API key the server accepts (``Authorization: Bearer <secret>``).

    Args:
        secret: The key itself: 16-256 characters of ``[A-Za-z0-9._~+/=-]``. Never in ``repr``
            and never in an error message.
        admin: The key may also list every owner's sessions (``GET /v1/sessions?all=true``).

    Raises:
        ValueError: The secret is malformed (the message gives its length, never its text).
    """

    secret: str = field(repr=False)
    admin: bool = False

    def __post_init__(self) -> None:
        expected = f"expected {MIN_API_KEY_LEN}-{MAX_API_KEY_LEN} characters of [A-Za-z0-9._~+/=-]"
        if not isinstance(self.secret, str):
            raise ValueError(f"api_keys: {expected}, got a {type(self.secret).__name__}")
        if not MIN_API_KEY_LEN <= len(self.secret) <= MAX_API_KEY_LEN:
            raise ValueError(f"api_keys: {expected}, got a key of {len(self.secret)} characters")
        if _API_KEY_RE.fullmatch(self.secret) is None:
            raise ValueError(f"api_keys: {expected}, got a key with other characters")


def parse_api_key(text: str, where: str = "api key") -> ApiKey:
    """Parse ``key`` or ``key:admin``.

    Args:
        text: The key, optionally followed by ``:admin``.
        where: Names the source in an error message (a flag, or ``file:line``).

    Returns:
        The key.

    Raises:
        ValueError: A role other than ``admin``, or a malformed key; the message names ``where``
            and never contains the key.
    """
    secret, sep, role = text.strip().rpartition(":")
    if not sep:
        secret, role = role, ""
    if sep and role != "admin":
        raise ValueError(f"api_keys: {where}: expected `KEY` or `KEY:admin`, got another role "
                         f"after ':' ({len(role)} characters)")
    try:
        return ApiKey(secret, admin=role == "admin")
    except ValueError as exc:
        raise ValueError(f"{exc} ({where})") from None


def read_api_keys_file(path: Path) -> tuple[ApiKey, ...]:
    """Read one ``key[:admin]`` per line; blank lines and lines starting with ``#`` are skipped.

    Args:
        path: The keys file.

    Returns:
        The keys, in file order.

    Raises:
        OSError: The file cannot be read.
        ValueError: A line is malformed, or a key is repeated (named by ``file:line``).
    """
    keys: list[ApiKey] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip() and not line.lstrip().startswith("#"):
            keys.append(parse_api_key(line, f"{path}:{number}"))
    if len({k.secret for k in keys}) != len(keys):
        raise ValueError(f"api_keys: {path}: a key is listed twice")
    return tuple(keys)


def is_loopback(host: str) -> bool:
    """``localhost``, or an address in 127.0.0.0/8 or ``::1``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_tp_size(name: str, size: int | None) -> None:
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= MAX_TP_SIZE):
        raise ValueError(f"{name}: expected an integer in [1, {MAX_TP_SIZE}], got {size!r}")


def _check_device(name: str, device: str) -> None:
    kind = device.split(":", 1)[0]
    if kind not in ("cpu", "cuda") or (":" in device and not device.split(":", 1)[1].isdigit()):
        raise ValueError(f"{name}: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything ``phloem serve`` needs.

    Args:
        host: bind address.
        port: TCP port (0: any free port).
        model: Hugging Face model folder; ``None`` means the trained built-in model, served
            from the package (``runtime.builtin_model.trained_model_path()``).
        data_dir: models, spilled sessions and the embedded index live here.
        redis_url: ``redis://``, ``rediss://`` or ``unix://`` URL of the session index;
            ``None`` uses the embedded SQLite index in ``data_dir``.
        device: torch device of the engine.
        dtype: weight dtype (one of ``DTYPES``).
        default_ttl_s: seconds a session stays pinned after a turn when it names no TTL.
        max_body_bytes: largest accepted request body (larger: 413 ``payload_too_large``).
        tensor_parallel_size: ranks running the model (``--tp``), 1 to 8.
        api_keys: accepted keys; empty: no authentication, one anonymous owner for every request.
        allow_remote_without_auth: permit a non-loopback ``host`` without ``api_keys``.
        max_context_len: longest token history of a session or request (the engine's
            ``max_model_len``); None: the model's own limit. Beyond it: 400
            ``context_length_exceeded``.
        max_sessions_per_key: sessions one key may hold (create and fork; beyond: 429).
        max_generations_per_key: generations one key may run at once (beyond: 429).
        max_num_generations: generations in flight on the whole server (beyond: 503).
        stream_idle_timeout_s: a streamed generation (SSE or WebSocket) that produces nothing for
            this long is cancelled; an idle WebSocket (no generation, no message) is closed.
        retry_after_s: the ``Retry-After`` of 429 and 503 answers.
        log_format: ``text`` (human lines) or ``json`` (one object per line); see
            ``runtime.logs``.
        log_level: the least severe level logged: ``debug``, ``info``, ``warning``, ``error``.
        engine: every other engine option; its ``load.device``, ``load.dtype``,
            ``parallel.tensor_parallel_size`` and ``scheduler.max_model_len`` (when set) must
            equal the fields above.
        pd: prefill/decode disaggregation (``--role``, ``--pd-peer``; ``runtime.pd.roles``); a
            prefill or decode instance needs the prefix cache (any ``tensor_parallel_size``).
        shared_prefixes: prefixes every key's requests may hit in the prefix cache (which is
            otherwise partitioned by key; ``runtime.shared_prefixes``).
        allowed_hosts: ``Host`` names (and browser ``Origin`` hosts) accepted besides the
            loopback ones; checked without API keys, and with keys when given.
        docs_ui: serve the interactive API pages under ``/schema`` (the JSON schema at
            ``/schema/openapi.json`` is always served).
        header_timeout_s: a connection that has not sent a whole request head this long after
            it opened (or after its previous response) is closed.
        keepalive_timeout_s: an idle keep-alive connection is closed after this long
            (``DEFAULT_KEEPALIVE_S`` says why the default is long).
        max_connections: open connections at most; more are closed at once.
        tokenize_workers: threads that tokenize and render chat templates, off the event loop;
            0: sized to the machine's CPUs.
        max_tokenizations_per_key: tokenizations one key runs at once (more wait their turn).
        idempotency_entries_per_key: ``Idempotency-Key`` outcomes one key may keep; beyond it
            (or ``idempotency_bytes_per_key``), its own oldest finished ones are dropped.
        idempotency_bytes_per_key: bytes of outcomes one key may keep (bodies, texts, ids).
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
    engine: EngineConfig | None = None
    api_keys: tuple[ApiKey, ...] = ()
    allow_remote_without_auth: bool = False
    max_context_len: int | None = None
    max_sessions_per_key: int = 4096
    max_generations_per_key: int = 128
    max_num_generations: int = 256
    stream_idle_timeout_s: float = 300.0
    retry_after_s: float = 1.0
    log_format: str = "text"
    log_level: str = "info"
    pd: PDConfig = field(default_factory=PDConfig)
    shared_prefixes: tuple[SharedPrefix, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    docs_ui: bool = False
    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_S
    max_connections: int = 1024
    tokenize_workers: int = 0
    max_tokenizations_per_key: int = 2
    idempotency_entries_per_key: int = 10_000
    idempotency_bytes_per_key: int = 64 << 20

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
        _check_tp_size("tensor_parallel_size", self.tensor_parallel_size)
        self._check_auth()
        self._check_limits()
        self._check_pd()
        self._check_engine()

    def _check_engine(self) -> None:
        if self.engine is None:
            return
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine: expected an EngineConfig or None, got {type(self.engine).__name__}")
        load, tp = self.engine.load, self.engine.parallel.tensor_parallel_size
        if (load.device, load.dtype) != (self.device, self.dtype):
            raise ValueError(
                f"engine: its device/dtype ({load.device!r}, {load.dtype!r}) must equal "
                f"ServerConfig.device/dtype ({self.device!r}, {self.dtype!r})"
            )
        if tp != self.tensor_parallel_size:
            raise ValueError(
                f"engine: its tensor_parallel_size ({tp!r}) must equal "
                f"ServerConfig.tensor_parallel_size ({self.tensor_parallel_size!r})"
            )
        max_model_len = self.engine.scheduler.max_model_len
        if self.max_context_len is not None and max_model_len not in (None, self.max_context_len):
            raise ValueError(
                f"engine: its max_model_len ({max_model_len!r}) must equal "
                f"ServerConfig.max_context_len ({self.max_context_len!r})"
            )

    def _check_auth(self) -> None:
        if not all(isinstance(k, ApiKey) for k in self.api_keys):
            raise ValueError("api_keys: expected a tuple of ApiKey")
        if len({k.secret for k in self.api_keys}) != len(self.api_keys):
            raise ValueError("api_keys: a key is given twice")
        if not self.api_keys and not self.allow_remote_without_auth and not is_loopback(self.host):
            raise ValueError(
                f"host: without API keys the server only binds to loopback (127.0.0.1, ::1, "
                f"localhost), got {self.host!r}; give --api-key / --api-keys-file / "
                "$PHLOEM_API_KEY, or pass --allow-remote-without-auth to serve the network "
                "unauthenticated"
            )

    def _check_limits(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes: expected > 0, got {self.max_body_bytes}")
        if self.max_context_len is not None and self.max_context_len < 2:
            raise ValueError(f"max_context_len: expected >= 2 or None, got {self.max_context_len}")
        for name in ("max_sessions_per_key", "max_generations_per_key", "max_num_generations", "max_connections",
                     "max_tokenizations_per_key", "idempotency_entries_per_key", "idempotency_bytes_per_key"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if not self.stream_idle_timeout_s > 0:
            raise ValueError(f"stream_idle_timeout_s: expected seconds > 0, got {self.stream_idle_timeout_s!r}")
        for name in ("retry_after_s", "header_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected seconds > 0, got {getattr(self, name)!r}")
        if isinstance(self.tokenize_workers, bool) or not isinstance(self.tokenize_workers, int) or self.tokenize_workers < 0:
            raise ValueError(f"tokenize_workers: expected an integer >= 0, got {self.tokenize_workers!r}")
        if any(not h or "/" in h for h in self.allowed_hosts):
            raise ValueError(f"allowed_hosts: expected host names, got {self.allowed_hosts!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format: expected one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {LOG_LEVELS}, got {self.log_level!r}")

    def _check_pd(self) -> None:
        if not isinstance(self.pd, PDConfig):
            raise ValueError(f"pd: expected a PDConfig, got {type(self.pd).__name__}")
        if not self.pd.is_disaggregated:
            return
        if self.engine is not None and not self.engine.cache.enable_prefix_caching:
            raise ValueError(f"pd: --role {self.pd.role} needs the prefix cache (drop --no-prefix-cache)")

    @property
    def auth_enabled(self) -> bool:
        """Requests must carry one of ``api_keys``."""
        return bool(self.api_keys)

    @property
    def engine_config(self) -> EngineConfig:
        """The configuration to build the engine from."""
        engine = self.engine
        if engine is None:
            return EngineConfig(load=LoadConfig(device=self.device, dtype=self.dtype),
                                scheduler=SchedulerConfig(max_model_len=self.max_context_len),
                                parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size))
        if self.max_context_len is not None and engine.scheduler.max_model_len is None:
            scheduler = dataclasses.replace(engine.scheduler, max_model_len=self.max_context_len)
            return dataclasses.replace(engine, scheduler=scheduler)
        return engine

    @property
    def models_dir(self) -> Path:
        """Where downloaded models and the random-weight test model live: ``data_dir / "models"``."""
        return self.data_dir / "models"

"""The HTTP server's section of the configuration (``HttpConfig``), and its API keys.

``HttpConfig`` holds what only the HTTP/WebSocket server uses: the socket (``host``, ``port``),
authentication, the per-key limits, timeouts, connection limits, the ``Host`` names answered,
the API pages, the idempotency quota and the process's logging. The engine's options live in
``engine.config.EngineConfig``, the sessions layer's in ``sessions.config.SessionConfig``; the
whole server's configuration (``cli.config.ServerConfig``) is made of those sections. Frozen,
slotted and validated in ``__post_init__`` (a ``ValueError`` names the field and the value);
nothing here reads the environment or imports torch.

Decision: without API keys the server serves one anonymous owner, so ``HttpConfig`` refuses a
non-loopback ``host`` unless ``allow_remote_without_auth`` says so explicitly. API keys are
``ApiKey`` values whose ``repr`` hides the secret, so printing a config never leaks one.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from phloem.runtime.logs import LOG_FORMATS, LOG_LEVELS

__all__ = ["DEFAULT_KEEPALIVE_S", "ApiKey", "HttpConfig", "is_loopback", "parse_api_key",
           "read_api_keys_file"]

# Seconds an idle keep-alive connection stays open by default. Longer than any client keeps one
# idle (httpx, so the SDK and openai: 5 s; a load balancer: 60 s): when both sides expire it after
# the same time, a client reuses it just as the server closes it, and the request it sent is lost
# (ECONNRESET, httpx.ReadError). uvicorn's default is 5 s.
DEFAULT_KEEPALIVE_S = 75.0

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



@dataclass(frozen=True, slots=True)
class HttpConfig:
    """The HTTP/WebSocket server's options.

    Args:
        host: bind address.
        port: TCP port (0: any free port).
        api_keys: accepted keys; empty: no authentication, one anonymous owner for every request.
        allow_remote_without_auth: permit a non-loopback ``host`` without ``api_keys``.
        max_body_bytes: largest accepted request body or WebSocket frame (larger: 413
            ``payload_too_large``).
        max_sessions_per_key: sessions one key may hold (create and fork; beyond: 429).
        max_generations_per_key: generations one key may run at once (beyond: 429).
        stream_idle_timeout_s: a streamed generation (SSE or WebSocket) that produces nothing for
            this long is cancelled; an idle WebSocket (no generation, no message) is closed.
        log_format: ``text`` (human lines) or ``json`` (one object per line); see
            ``runtime.logs``.
        log_level: the least severe level logged: ``debug``, ``info``, ``warning``, ``error``.
        allowed_hosts: ``Host`` names (and browser ``Origin`` hosts) accepted besides the
            loopback ones; checked without API keys, and with keys when given.
        docs_ui: serve the interactive API pages under ``/schema`` (the JSON schema at
            ``/schema/openapi.json`` is always served).
        header_timeout_s: a connection that has not sent a whole request head this long after
            it opened (or after its previous response) is closed.
        keepalive_timeout_s: an idle keep-alive connection is closed after this long
            (``DEFAULT_KEEPALIVE_S`` says why the default is long).
        max_connections: open connections at most; more are closed at once.
        idempotency_entries_per_key: ``Idempotency-Key`` outcomes one key may keep; beyond it
            (or ``idempotency_bytes_per_key``), its own oldest finished ones are dropped.
        idempotency_bytes_per_key: bytes of outcomes one key may keep (bodies, texts, ids).
        served_model_names: the names the API serves the model under: the first is reported
            (``/v1/models``, the ``model`` of responses), each is accepted in a request's
            ``model``; empty: the model folder's name.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[ApiKey, ...] = ()
    allow_remote_without_auth: bool = False
    max_body_bytes: int = 8 * 1024 * 1024
    max_sessions_per_key: int = 4096
    max_generations_per_key: int = 128
    stream_idle_timeout_s: float = 300.0
    log_format: str = "text"
    log_level: str = "info"
    allowed_hosts: tuple[str, ...] = ()
    docs_ui: bool = False
    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = DEFAULT_KEEPALIVE_S
    max_connections: int = 1024
    idempotency_entries_per_key: int = 10_000
    idempotency_bytes_per_key: int = 64 << 20
    served_model_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError(f"host: expected a host name or address, got {self.host!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port: expected an integer in [0, 65535], got {self.port!r}")
        self._check_auth()
        self._check_limits()

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
        for name in ("max_sessions_per_key", "max_generations_per_key", "max_connections",
                     "idempotency_entries_per_key", "idempotency_bytes_per_key"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if not self.stream_idle_timeout_s > 0:
            raise ValueError(f"stream_idle_timeout_s: expected seconds > 0, got {self.stream_idle_timeout_s!r}")
        for name in ("header_timeout_s", "keepalive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: expected seconds > 0, got {getattr(self, name)!r}")
        if any(not h or "/" in h for h in self.allowed_hosts):
            raise ValueError(f"allowed_hosts: expected host names, got {self.allowed_hosts!r}")
        if any(not isinstance(n, str) or not n.strip() or n != n.strip() for n in self.served_model_names):
            raise ValueError(f"served_model_names: expected non-empty names, got {self.served_model_names!r}")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError(f"served_model_names: a name is given twice: {self.served_model_names!r}")
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format: expected one of {LOG_FORMATS}, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level: expected one of {LOG_LEVELS}, got {self.log_level!r}")

    @property
    def auth_enabled(self) -> bool:
        """Requests must carry one of ``api_keys``."""
        return bool(self.api_keys)

"""The Litestar application (``create_app``) and ``phloem serve`` (``serve``).

Routes: the native sessions API (``native.routes``, ``native.ws``), the OpenAI-compatible routes
(``openai.routes``; the Responses API, a view of sessions: ``responses.routes``), Anthropic's
Messages API (``anthropic.routes``), ``GET /health``, ``GET /metrics`` (Prometheus,
``metrics``) and Litestar's OpenAPI schema (``/schema``, JSON at ``/schema/openapi.json``).
Every error, the framework's included, goes through ``errors.exception_handler``. Every request and socket passes
``observe.RequestObserver`` (request id, one log line, HTTP metrics), which wraps the whole
handler so that even unrouted requests are seen.

Every route under ``/v1/`` is authenticated by ``auth.AuthMiddleware`` when API keys are
configured (``/health`` and the schema stay public); ``/metrics`` then needs an admin key, since
its counters (cached tokens, requests by route) sum up every key's traffic. ``guard`` refuses
foreign ``Host`` / ``Origin`` names and non-JSON bodies before that (docs/api.md, "Security
model"); the interactive ``/schema`` pages are served only with ``ServerConfig.docs_ui``
(they load scripts from a CDN). Limits (docs/api.md,
"Limits"): bodies larger than ``ServerConfig.max_body_bytes`` are 413 ``payload_too_large`` (Litestar's
``request_max_body_size``, whether or not the request announces its length), and WebSocket
frames are limited to the same size by uvicorn (``ws_max_size``: the socket closes with 1009);
per-key quotas are ``limits``; the server-wide limit on generations is the sessions layer's
admission (``max_num_generations``, 503); the context window is the engine's ``max_model_len``
(``max_context_len``, 400); idle streams are cancelled (``pacing``).

Logs: ``serve`` logs to stderr in ``config.log_format`` at ``config.log_level``
(``runtime.logs``); uvicorn's loggers go through the same handler, and its access log is off
(``RequestObserver`` writes one line per request instead).

Lifecycle: ``create_app`` starts the manager on startup (loading the journaled sessions) and
closes it on shutdown; ``serve`` owns the engine: it builds and starts it, and stops it after
the manager. On SIGINT/SIGTERM uvicorn stops accepting, gives open responses (streams) up to
``_GRACE_S`` seconds, then cancels them, which cancels their generations (the partial output is
committed, as for a client that went away); the manager then cancels what is left, the engine
stops, and ``serve`` returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
from typing import Any

import uvicorn
from litestar import Litestar, Request, Response, get
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme

from phloem import __version__
from phloem.api.schemas import ErrorCode
from phloem.api.server.anthropic.routes import ANTHROPIC_ROUTES
from phloem.api.server.auth import AuthMiddleware, KeyRing, principal_of
from phloem.api.server.context import ApiContext
from phloem.api.server.errors import ApiError, error_response, exception_handler, problems
from phloem.api.server.guard import RequestGuard
from phloem.api.server.health import health_body
from phloem.api.server.idempotency import IdempotencyStore
from phloem.api.server.limits import OwnerLimits
from phloem.api.server.metrics import METRICS_CONTENT_TYPE, ApiMetrics
from phloem.api.server.native.routes import SESSION_ROUTES
from phloem.api.server.native.ws import session_socket
from phloem.api.server.observe import RequestObserver
from phloem.api.server.openai.routes import OPENAI_ROUTES
from phloem.api.server.protocol import guarded_http_protocol
from phloem.api.server.responses.routes import RESPONSES_ROUTES
from phloem.runtime import EngineClient, EngineConfig, ServerConfig
from phloem.runtime.config import DEFAULT_KEEPALIVE_S
from phloem.runtime.builtin_model import DEFAULT_MODEL_NAME, served_model_name, trained_model_path
from phloem.runtime.default_model import RANDOM_MODEL_NAME
from phloem.runtime.logs import adopt_library_loggers, stderr_logging
from phloem.runtime.pd.decode import engine_client_for
from phloem.runtime.startup import StartupLog
from phloem.sessions import SessionConfig, SessionManager, Tokenizer, model_fingerprint
from phloem.storage import server_secret

__all__ = ["KEEP_ALIVE_S", "create_app", "serve"]

logger = logging.getLogger(__name__)
_GRACE_S = 10
KEEP_ALIVE_S = DEFAULT_KEEPALIVE_S


def create_app(config: ServerConfig, engine_client: EngineClient,
               manager: SessionManager) -> Litestar:
    """Build the HTTP/WebSocket application.

    Args:
        config: The server config (API keys, limits; ``model`` names the served model). The
            server-wide generation limit belongs to ``manager``'s ``SessionConfig``.
        engine_client: The engine (its state answers ``/health``); not started or stopped here.
        manager: The session manager; started on the app's startup, closed on its shutdown.

    Returns:
        The Litestar app.
    """
    model_id = served_model_name(config.model) if config.model else DEFAULT_MODEL_NAME
    if model_id == DEFAULT_MODEL_NAME:
        owned_by = "phloem (built-in 4M-parameter test model: it writes tool calls, it knows nothing)"
    elif model_id == RANDOM_MODEL_NAME:
        owned_by = "phloem (built-in test model with RANDOM weights: its output is gibberish)"
    elif config.engine_config.load.load_format == "dummy":
        owned_by = "phloem (DUMMY random weights of this shape, for benchmarks: its output is gibberish)"
    else:
        owned_by = "phloem"
    keys = KeyRing(config.api_keys, server_secret(config.data_dir))
    limits = OwnerLimits(manager, config.max_sessions_per_key, config.max_generations_per_key,
                         config.retry_after_s)
    idempotency = IdempotencyStore(max_entries=config.idempotency_entries_per_key,
                                   max_bytes=config.idempotency_bytes_per_key)
    ctx = ApiContext(manager, model_id, owned_by, keys, limits, config.stream_idle_timeout_s,
                     idempotency)

    @get("/health", include_in_schema=True, responses={
        200: ResponseSpec(dict[str, str], description="The engine runs"), **problems(503)})
    async def health() -> Response[Any]:
        """200 ``ok`` (or ``degraded`` with a ``reason``, e.g. the index is unreachable) while the
        engine runs; 503 (with ``Retry-After``) otherwise."""
        if not engine_client.is_running:
            return error_response("/health", ApiError(
                ErrorCode.OVERLOADED, "the engine is not running", retry_after=5.0))
        return Response(health_body(manager, model_id))

    metrics = ApiMetrics(engine_client, manager)

    @get("/metrics", include_in_schema=True, media_type="text/plain", responses={
        200: ResponseSpec(str, media_type="text/plain", generate_examples=False,
                          description="Prometheus text format"), **problems(401, 403)})
    async def metrics_text(request: Request[Any, Any, Any]) -> Response[bytes]:
        """The server's counters in the Prometheus text format (docs/api.md, "Observability"):
        HTTP requests, tokens, sessions by status, spills and resumes, pages and state slots,
        queue depth, engine step times. With API keys: an admin key only."""
        if not principal_of(request).admin:
            raise ApiError(ErrorCode.FORBIDDEN, "/metrics: every key's traffic is counted there: "
                                                "it needs an admin API key")
        return Response(await metrics.render(), media_type=METRICS_CONTENT_TYPE)

    # NOTE: Litestar passes the app to a lifespan hook that takes an argument: wrap them.
    async def start_sessions() -> None:
        await manager.start()
        await manager.rename_owners(keys.renames())

    async def close_sessions() -> None:
        await manager.close()

    app = Litestar(
        route_handlers=[*SESSION_ROUTES, session_socket, *OPENAI_ROUTES, *RESPONSES_ROUTES,
                        *ANTHROPIC_ROUTES, health, metrics_text],
        dependencies={"ctx": Provide(lambda: ctx, sync_to_thread=False, use_cache=True)},
        exception_handlers={Exception: exception_handler},
        middleware=[RequestGuard(not keys.enabled or bool(config.allowed_hosts), config.allowed_hosts),
                    AuthMiddleware(keys)],
        request_max_body_size=config.max_body_bytes,
        # Process logging belongs to ``serve`` (runtime.logs), never to the app: Litestar's
        # default would replace the root logger's handlers on startup.
        logging_config=None,
        on_startup=[start_sessions],
        on_shutdown=[close_sessions],
        openapi_config=OpenAPIConfig(
            title="Phloem", version=__version__,
            render_plugins=[] if config.docs_ui else [JsonRenderPlugin()],
            description="Sessions, streaming and OpenAI-compatible routes of a Phloem server "
                        "(docs/api.md). Routes under /v1 need `Authorization: Bearer <key>` when "
                        "the server has API keys.",
            components=Components(security_schemes={
                "apiKey": SecurityScheme(type="http", scheme="bearer",
                                         description="An API key of the server")}),
            security=[{"apiKey": []}] if keys.enabled else None),
    )
    # Around routing and the exception handlers (a middleware would miss unrouted requests).
    app.asgi_handler = RequestObserver(app.asgi_handler, metrics)
    return app


def serve(config: ServerConfig, sock: socket.socket | None = None, startup: StartupLog | None = None) -> None:
    """Run ``phloem serve``: load the model, warm it up, serve until SIGINT/SIGTERM.

    The caller holds the data directory's lock (``storage.lock_data_dir``; ``phloem serve``
    takes it first), so that no second server loads the same sessions.

    Args:
        config: The server config; ``model`` None serves the trained built-in model from the
            package (``runtime.builtin_model``).
        sock: The bound socket to serve (``runtime.preflight.bind_port``, so a taken port is
            found before the model loads); None: uvicorn binds ``host:port`` itself.
        startup: The start-up's phase log, begun by the caller; None: begun here.

    Raises:
        ValueError: The model folder or an engine option is invalid.
        OSError: The model folder or the data directory cannot be read or written.
    """
    with stderr_logging(config.log_format, config.log_level):
        _serve(config, sock, startup or StartupLog())


def _serve(config: ServerConfig, sock: socket.socket | None, startup: StartupLog) -> None:
    adopt_library_loggers()  # transformers, imported by now, logs through our handler too
    if config.model is None:
        config = dataclasses.replace(config, model=str(trained_model_path()))
    assert config.model is not None
    config.data_dir.mkdir(parents=True, exist_ok=True)
    load = config.engine_config.load
    with startup.phase("model", f"loading the model from {config.model} on {load.device} ({load.dtype})"):
        # A decode instance's client sends prompts to its prefill instance (``--role decode``).
        engine = engine_client_for(config)
    _warm_up(engine, config.engine_config, startup)
    sessions = SessionConfig(data_dir=config.data_dir, model_fingerprint=model_fingerprint(config.model),
                             redis_url=config.redis_url, default_ttl_s=config.default_ttl_s,
                             max_num_generations=config.max_num_generations,
                             retry_after_s=config.retry_after_s,
                             tokenize_workers=config.tokenize_workers,
                             max_tokenizations_per_owner=config.max_tokenizations_per_key,
                             shared_prefixes=config.shared_prefixes)
    with startup.phase("tokenizer", "loading the tokenizer"):
        tokenizer = Tokenizer.from_pretrained(config.model)
    manager = SessionManager(engine, tokenizer, sessions)
    app = create_app(config, engine, manager)
    _log_auth(config)

    async def stop_engine() -> None:
        await engine.shutdown()

    app.on_shutdown.append(stop_engine)
    server = _Server(uvicorn.Config(
        app, host=config.host, port=config.port, ws_max_size=config.max_body_bytes,
        lifespan="on", timeout_graceful_shutdown=_GRACE_S, log_level=config.log_level,
        log_config=None, access_log=False, timeout_keep_alive=config.keepalive_timeout_s,
        http=guarded_http_protocol(config.header_timeout_s, config.max_connections)), startup)
    engine.start()
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal with the
    # handler it found: make SIGTERM end in KeyboardInterrupt too, so serve() returns normally.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run(sockets=[sock] if sock is not None else None)
    except KeyboardInterrupt:
        logger.info("phloem serve: stopped")
    finally:
        signal.signal(signal.SIGTERM, previous)
        if engine.is_running:
            asyncio.run(engine.shutdown())


def _warm_up(engine: EngineClient, config: EngineConfig, startup: StartupLog) -> None:
    """Compile on a GPU what the first requests would (``engine.warmup``); on CPU nothing
    compiles (torch kernels), so there is nothing to wait for."""
    if not config.load.device.startswith("cuda"):
        logger.info("startup: no kernel warm-up on %s (nothing compiles there)", config.load.device)
        return
    with startup.phase("warm_up", "warming up kernels: a few requests compile what serving uses"):
        report = engine.warm_up(config.load.show_progress)
    logger.info("startup: warm-up ran %d requests, %d steps, %d prompt tokens",
                report.num_requests, report.num_steps, report.num_prompt_tokens)


class _Server(uvicorn.Server):
    """uvicorn's server, timing its own start (the app's startup hooks restore the journaled
    sessions) and logging ``startup.ready`` once it accepts connections."""

    def __init__(self, config: uvicorn.Config, startup: StartupLog) -> None:
        super().__init__(config)
        self._startup = startup

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        with self._startup.phase("http", "restoring sessions and opening the port"):
            await super().startup(sockets)
        if self.started:
            listening = self.servers[0].sockets[0].getsockname() if self.servers else None
            host, port = (listening[0], listening[1]) if listening else (self.config.host, self.config.port)
            self._startup.ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")


def _log_auth(config: ServerConfig) -> None:
    """Say at start who may use the server (counts only: a key never reaches a log)."""
    if config.api_keys:
        num_admin = sum(k.admin for k in config.api_keys)
        logger.info("auth: %d API key(s) (%d admin); /v1 routes need `Authorization: Bearer`",
                    len(config.api_keys), num_admin)
    elif config.allow_remote_without_auth:
        logger.warning("auth: DISABLED and serving %s (--allow-remote-without-auth): anyone who "
                       "reaches port %d can read, change and delete every session",
                       config.host, config.port)
    else:
        logger.warning("auth: no API keys: every request is one anonymous owner; serving loopback "
                       "only (%s). Give --api-key / --api-keys-file / $PHLOEM_API_KEY to serve "
                       "the network", config.host)

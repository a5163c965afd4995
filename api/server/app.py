"""The Litestar application (``create_app``), over an engine client and a session manager built
by the caller (``phloem serve``'s composition root, ``cli.compose``, which also runs uvicorn).

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
model"); the interactive ``/schema`` pages are served only with ``HttpConfig.docs_ui``
(they load scripts from a CDN). Limits (docs/api.md,
"Limits"): bodies larger than ``HttpConfig.max_body_bytes`` are 413 ``payload_too_large`` (Litestar's
``request_max_body_size``, whether or not the request announces its length), and WebSocket
frames are limited to the same size by uvicorn (``ws_max_size``: the socket closes with 1009);
per-key quotas are ``limits``; the server-wide limit on generations is the sessions layer's
admission (``SessionConfig.max_num_generations``, 503, with its ``retry_after_s``, also the
``Retry-After`` of the 429s); the context window is the engine's ``max_model_len`` (400); idle
streams are cancelled (``pacing``).

Logs: the app installs no logging (``logging_config=None``); the process's is ``runtime.logs``'s.

Lifecycle: ``create_app`` starts the manager on startup (loading the journaled sessions) and
closes it on shutdown; the engine belongs to the caller, which starts it and stops it after the
manager (``cli.compose``).
"""

from __future__ import annotations

import logging
from typing import Any

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
from phloem.api.server.config import DEFAULT_KEEPALIVE_S, HttpConfig
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
from phloem.api.server.responses.routes import RESPONSES_ROUTES
from phloem.runtime import EngineClient
from phloem.runtime.builtin_model import DEFAULT_MODEL_NAME, served_model_name
from phloem.runtime.default_model import RANDOM_MODEL_NAME
from phloem.sessions import SessionManager
from phloem.storage import server_secret

__all__ = ["KEEP_ALIVE_S", "create_app"]

logger = logging.getLogger(__name__)
KEEP_ALIVE_S = DEFAULT_KEEPALIVE_S


def create_app(config: HttpConfig, engine_client: EngineClient, manager: SessionManager, *,
               model: str | None = None, load_format: str = "safetensors") -> Litestar:
    """Build the HTTP/WebSocket application over objects built by the caller.

    Args:
        config: The HTTP section (API keys, per-key limits, timeouts). The server-wide limit on
            generations, the ``Retry-After`` and the data directory (its secret keys the owner
            ids) are ``manager``'s ``SessionConfig``.
        engine_client: The engine (its state answers ``/health``); not started or stopped here.
        manager: The session manager; started on the app's startup, closed on its shutdown.
        model: The served model's folder, which names it in ``/v1/models`` unless
            ``config.served_model_names`` does; None: the built-in one.
        load_format: The engine's ``LoadConfig.load_format`` (``dummy``: random weights, said so
            in ``/v1/models``).

    Returns:
        The Litestar app.
    """
    model_id = served_model_name(model) if model else DEFAULT_MODEL_NAME
    if model_id == DEFAULT_MODEL_NAME:
        owned_by = "phloem (built-in 4M-parameter test model: it writes tool calls, it knows nothing)"
    elif model_id == RANDOM_MODEL_NAME:
        owned_by = "phloem (built-in test model with RANDOM weights: its output is gibberish)"
    elif load_format == "dummy":
        owned_by = "phloem (DUMMY random weights of this shape, for benchmarks: its output is gibberish)"
    else:
        owned_by = "phloem"
    sessions = manager.config
    keys = KeyRing(config.api_keys, server_secret(sessions.data_dir))
    limits = OwnerLimits(manager, config.max_sessions_per_key, config.max_generations_per_key,
                         sessions.retry_after_s)
    idempotency = IdempotencyStore(max_entries=config.idempotency_entries_per_key,
                                   max_bytes=config.idempotency_bytes_per_key)
    if config.served_model_names:  # --served-model-name: these names instead of the folder's
        model_id, *aliases = config.served_model_names
    else:
        aliases = []
    ctx = ApiContext(manager, model_id, owned_by, keys, limits, config.stream_idle_timeout_s,
                     idempotency, model_aliases=tuple(aliases))

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
        # Process logging belongs to the process (runtime.logs), never to the app: Litestar's
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

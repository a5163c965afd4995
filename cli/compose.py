"""The composition root of ``phloem serve``: from a ``ServerConfig``, build the engine client,
the tokenizer, the ``SessionManager`` and the Litestar app, and run them under uvicorn.

Each layer gets its own section and nothing else: the engine ``config.engine`` (through
``runtime.pd.decode.engine_client_for``, which gives a decode instance its ``PDEngineClient``),
the sessions layer ``config.sessions`` plus the fingerprint measured here from the model folder
(never configured), the app (``api.server.app.create_app``) ``config.http`` with the built
engine client and manager. ``cli.main`` builds the config and runs the process-level checks
first; tests and tools reuse ``build_engine`` / ``build_sessions`` / ``build_app``.

Lifecycle: ``serve`` owns the engine: it builds and starts it, and stops it after the manager
(which the app closes on shutdown). On SIGINT/SIGTERM uvicorn stops accepting, gives open
responses (streams) up to ``_GRACE_S`` seconds, then cancels them, which cancels their
generations (the partial output is committed, as for a client that went away); the manager then
cancels what is left, the engine stops, and ``serve`` returns. Logs go to stderr in
``config.http.log_format`` at ``log_level`` (``runtime.logs``); uvicorn's loggers go through the
same handler, and its access log is off (the app's ``RequestObserver`` writes one line per
request instead).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket

import torch
import uvicorn
from litestar import Litestar

from phloem.api.server.app import create_app
from phloem.api.server.config import HttpConfig
from phloem.api.server.protocol import guarded_http_protocol
from phloem.cli.config import ServerConfig
from phloem.runtime import EngineClient, EngineConfig
from phloem.runtime.builtin_model import trained_model_path
from phloem.runtime.logs import adopt_library_loggers, stderr_logging
from phloem.runtime.pd.decode import engine_client_for
from phloem.runtime.preflight import StartupError
from phloem.runtime.startup import StartupLog
from phloem.sessions import SessionManager, Tokenizer, model_fingerprint

__all__ = ["build_app", "build_engine", "build_sessions", "load_tokenizer", "serve"]

logger = logging.getLogger(__name__)
_GRACE_S = 10


def build_engine(config: ServerConfig) -> EngineClient:
    """The engine client of ``config`` (not started): a ``PDEngineClient`` for ``--role decode``.

    Raises:
        ValueError: the model folder or an engine option is invalid, or the role is ``prefill``.
    """
    assert config.model is not None, "resolve the default model first"
    return engine_client_for(config.model, config.engine, config.pd)


def build_sessions(config: ServerConfig, engine: EngineClient, tokenizer: Tokenizer | None = None) -> SessionManager:
    """The session manager over ``engine``: ``config.sessions``, the model's tokenizer (loaded from
    the folder unless given) and its fingerprint, measured here."""
    assert config.model is not None, "resolve the default model first"
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
    return SessionManager(engine, tokenizer, config.sessions, model_fingerprint=model_fingerprint(config.model))


def load_tokenizer(config: ServerConfig) -> Tokenizer:
    """The model folder's tokenizer, with ``config.chat_template``'s template when one is given.

    Raises:
        OSError: The folder has no loadable tokenizer, or the template file cannot be read.
    """
    assert config.model is not None, "resolve the default model first"
    return Tokenizer.from_pretrained(str(config.model), chat_template=config.read_chat_template())


def build_app(config: ServerConfig, engine: EngineClient, manager: SessionManager) -> Litestar:
    """The Litestar app over the built objects and ``config.http``."""
    return create_app(config.http, engine, manager, model=config.model,
                      load_format=config.engine.load.load_format)


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
    with stderr_logging(config.http.log_format, config.http.log_level):
        _serve(config, sock, startup or StartupLog())


def _serve(config: ServerConfig, sock: socket.socket | None, startup: StartupLog) -> None:
    adopt_library_loggers()  # transformers, imported by now, logs through our handler too
    if config.model is None:
        config = dataclasses.replace(config, model=str(trained_model_path()))
    config.data_dir.mkdir(parents=True, exist_ok=True)
    load = config.engine.load
    try:
        with startup.phase("model", f"loading the model from {config.model} on {load.device} ({load.dtype})"):
            engine = build_engine(config)
        _warm_up(engine, config.engine, startup)
    except torch.OutOfMemoryError as exc:
        raise out_of_device_memory(exc, config.engine) from None
    with startup.phase("tokenizer", "loading the tokenizer"):
        tokenizer = load_tokenizer(config)
    # With CUDA and session tiers, the host tier's memory is pinned here, before the engine thread
    # runs (0.3–0.6 s a GiB: pinning stalls other threads' CUDA calls; storage.pinned_arena).
    with startup.phase("sessions", "setting up sessions (pinning host memory for spilled state on CUDA)"):
        manager = build_sessions(config, engine, tokenizer)
    app = build_app(config, engine, manager)
    http = config.http
    _log_auth(http)

    async def stop_engine() -> None:
        await engine.shutdown()

    app.on_shutdown.append(stop_engine)
    server = _Server(uvicorn.Config(
        app, host=http.host, port=http.port, ws_max_size=http.max_body_bytes,
        lifespan="on", timeout_graceful_shutdown=_GRACE_S, log_level=http.log_level,
        log_config=None, access_log=False, timeout_keep_alive=http.keepalive_timeout_s,
        http=guarded_http_protocol(http.header_timeout_s, http.max_connections)), startup)
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


def out_of_device_memory(exc: torch.OutOfMemoryError, config: EngineConfig) -> StartupError:
    """The one-line start-up error for a device that ran out of memory while the engine was built
    or warmed up: the pools take ``memory_fraction`` of what the weights leave, and a step's
    activations and CUDA graphs need the rest (bf16 weights of the 35B-A3B shape on an 80 GB card
    leave too little for an 8K-token step's)."""
    first = "; ".join(str(exc).split(". ")[:2]).strip().rstrip(".")
    tokens = config.scheduler.max_num_batched_tokens
    step = f"a {tokens}-token step" if tokens else "a step"
    return StartupError(
        f"out of GPU memory starting the engine ({first}): the weights and the KV and state pools "
        f"(--gpu-memory-utilization {config.cache.memory_fraction} of the memory the weights leave) "
        f"leave too little for {step} and its CUDA graphs; lower --gpu-memory-utilization or "
        "--max-num-batched-tokens, set --num-pages, or load FP8 weights (--quantization fp8)")


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


def _log_auth(config: HttpConfig) -> None:
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

"""The ``phloem`` command: ``serve``, ``demo`` and ``bench``.

The composition root (``phloem.cli``): it imports ``phloem.api`` (the server in ``serve``, the SDK
in ``demo``) inside the function that needs it, so ``phloem --help`` stays fast and the SDK side
of ``demo`` never imports torch; ``phloem bench`` comes from ``phloem.benchmarks.cli``.

Flags default to the ``PHLOEM_*`` environment variables (``runtime.env``), then to
``ServerConfig``'s defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from phloem.benchmarks.cli import add_bench_commands
from phloem.cli.hardening import add_hardening_flags, hardening_config
from phloem.cli.demo import DEFAULT_MAX_TOKENS, DemoOptions
from phloem.engine.config import CacheConfig, EngineConfig, LoadConfig, ParallelConfig, SchedulerConfig
from phloem.runtime.config import (
    DTYPES, LOG_FORMATS, LOG_LEVELS, ApiKey, ServerConfig, default_data_dir, parse_api_key, read_api_keys_file,
)
from phloem.runtime.model_shapes import SHAPES, ensure_shape_model
from phloem.runtime.env import EnvSettings, kernel_config, read_env, use_kernel_caches
from phloem.runtime.pd.roles import ROLES, PDConfig
from phloem.cli.parsers import command_parser, shorten_usage
from phloem.runtime.preflight import StartupError, bind_port, check_device, check_model_folder
from phloem.runtime.startup import StartupLog

__all__ = ["build_parser", "main"]

_SERVE_EXAMPLES = """\
examples:
  phloem serve                                  # the built-in tiny model (trained, 4M parameters)
  phloem serve --model ~/models/Qwen3.5-35B-A3B --device cuda --dtype bfloat16
  phloem serve --port 9000 --redis-url redis://localhost:6379/0
  phloem serve --model ~/models/Qwen3.5-35B-A3B --device cuda --tp 2   # GPUs 0 and 1
  phloem serve --model ~/models/Qwen3.5-35B-A3B --device cuda --tp 2 --ep   # experts split whole
  phloem serve --role prefill --pd-peer 10.0.0.2:9555 --model DIR      # then, on the decode side:
  phloem serve --role decode --pd-peer 10.0.0.2:9555 --model DIR       # same model; serves the API
  phloem serve --host 0.0.0.0 --api-keys-file /etc/phloem/keys   # one KEY[:admin] per line
  PHLOEM_API_KEY=$(cat /run/secrets/key) phloem serve --host 0.0.0.0
  phloem serve --max-generations-per-key 8 --max-sessions-per-key 100 --max-context-len 32768
  phloem serve --log-format json --log-level debug 2> phloem.jsonl   # one JSON object per line
  curl -s http://127.0.0.1:8000/metrics          # Prometheus metrics of a running server
  phloem serve --shape qwen3.5-35b-a3b --device cuda --dtype bfloat16   # dummy weights, benchmarks
  phloem serve --model ~/models/Qwen3.5-35B-A3B --device cuda --max-num-batched-tokens 2048   # smoother decodes
"""
_DEMO_EXAMPLES = """\
examples:
  phloem demo                                   # starts a server (free port, temporary data dir), then stops it
  phloem demo --base-url http://127.0.0.1:8000  # drive a server that is already running
  phloem demo --max-tokens 32 --model ~/models/Qwen3.5-35B-A3B
"""


def build_parser(env: EnvSettings | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``phloem``; defaults come from ``env`` (``read_env()`` when None)."""
    env = env if env is not None else read_env()
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    parser = argparse.ArgumentParser(
        prog="phloem",
        description="Phloem: an inference runtime for LLM agents (sessions, prefix cache, fork).",
        epilog="examples:\n  phloem serve\n  phloem demo\n  phloem serve --help",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve",
        help="run the HTTP/WebSocket server",
        description="Load a model and serve the native and OpenAI-compatible APIs.",
        epilog=_SERVE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--model", metavar="DIR", default=env.model,
                       help="Hugging Face model folder (default: $PHLOEM_MODEL, else the built-in "
                            "tiny model, trained, shipped with phloem)")
    serve.add_argument("--host", default=_pick(env.host, defaults["host"]),
                       help="bind address (default: %(default)s)")
    serve.add_argument("--port", type=int, default=_pick(env.port, defaults["port"]),
                       help="TCP port (default: %(default)s)")
    serve.add_argument("--redis-url", metavar="URL", default=env.redis_url,
                       help="Redis URL of the session index (default: embedded SQLite index)")
    _add_data_dir(serve, env)
    serve.add_argument("--device", default=_pick(env.device, defaults["device"]),
                       help="torch device: cpu, cuda, cuda:N (default: %(default)s)")
    serve.add_argument("--dtype", choices=DTYPES, default=_pick(env.dtype, defaults["dtype"]),
                       help="weight dtype; auto takes the checkpoint's (default: %(default)s)")
    serve.add_argument("--tp", metavar="N", type=int, default=defaults["tensor_parallel_size"],
                       help="tensor parallelism: N processes (on CUDA, N GPUs from --device) "
                            "run the model (default: %(default)s)")
    serve.add_argument("--ep", action="store_true",
                       help="expert parallelism: with --tp N, each rank holds E/N whole routed experts "
                            "instead of a slice of every expert")
    serve.add_argument("--no-prefix-cache", action="store_true",
                       help="disable the radix prefix cache (benchmark baseline)")
    serve.add_argument("--shape", choices=sorted(SHAPES),
                       help="serve DUMMY (random) weights of a benchmark shape with the demo "
                            "tokenizer, instead of --model (benchmarks only)")
    serve.add_argument("--max-num-batched-tokens", metavar="TOKENS", type=int,
                       help="token budget of one engine step: larger prefills faster, smaller keeps "
                            "concurrent decodes smoother (default: 8192 on a GPU, 512 on CPU)")
    serve.add_argument("--max-num-seqs", metavar="N", type=int, default=SchedulerConfig().max_num_seqs,
                       help="requests decoding at once (default: %(default)s)")
    serve.add_argument("--no-async-scheduling", action="store_true",
                       help="read each step's sampled ids before preparing the next step (default: "
                            "the next decode step is queued while the device runs the current one)")
    serve.add_argument("--default-ttl", metavar="SECONDS", type=float,
                       default=defaults["default_ttl_s"],
                       help="seconds a session stays pinned after a turn (default: %(default)s)")
    _add_auth_flags(serve, env)
    _add_limit_flags(serve, defaults)
    add_hardening_flags(serve, defaults)
    _add_pd_flags(serve)
    _add_output_flags(serve, env, defaults)
    serve.set_defaults(configure=_server_config, run=_serve)

    demo = commands.add_parser(
        "demo",
        help="a guided tour: a session with 3 turns, forked into 2 branches",
        description="Drive a server with the Python SDK: create a session, run 3 turns of "
                    "append + generate, fork it into 2 branches, generate in each, and print "
                    "prompt / cached / completion tokens per turn.",
        epilog=_DEMO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--base-url", metavar="URL",
                      help="a running server; without it one is started on a free loopback port")
    demo.add_argument("--api-key", default=env.api_key, help="API key (default: $PHLOEM_API_KEY)")
    demo.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                      help="tokens per generation; a tool call takes 26-44 of the built-in model's "
                           "(default: %(default)s)")
    demo.add_argument("--model", metavar="DIR", default=env.model,
                      help="model of the server it starts (default: the built-in tiny model)")
    demo.add_argument("--data-dir", metavar="DIR", type=Path,
                      help="data directory of the server it starts (default: a temporary one, deleted "
                           "afterwards, so the demo runs beside a `phloem serve`)")
    demo.add_argument("--port", type=int,
                      help="port of the server it starts (default: a free one)")
    demo.add_argument("--startup-timeout", metavar="SECONDS", type=float, default=120.0,
                      help="how long to wait for the server it starts (default: %(default)s)")
    demo.set_defaults(configure=_demo_options, run=_demo)

    add_bench_commands(commands)
    shorten_usage(parser)
    return parser


def _add_auth_flags(serve: argparse.ArgumentParser, env: EnvSettings) -> None:
    auth = serve.add_argument_group(
        "authentication",
        "Clients send `Authorization: Bearer KEY`; a session belongs to the key that created it. "
        "Without any key every request is one anonymous owner, and only loopback is served.")
    auth.add_argument("--api-key", metavar="KEY[:admin]", action="append",
                      help="accept this API key (repeatable); `:admin` also lets it list every "
                           "key's sessions. Visible in `ps`: prefer --api-keys-file or "
                           "$PHLOEM_API_KEY (its default when neither flag is given)")
    auth.add_argument("--api-keys-file", metavar="FILE", type=Path, default=env.api_keys_file,
                      help="read API keys from FILE, one KEY[:admin] per line; blank lines and "
                           "lines starting with # are skipped (default: $PHLOEM_API_KEYS_FILE)")
    auth.add_argument("--allow-remote-without-auth", action="store_true",
                      help="serve a non-loopback --host without API keys: anyone who can reach "
                           "the port can read every session")
    # Kept out of the help text and its %(default)s on purpose: it is a secret.
    serve.set_defaults(env_api_key=env.api_key)


def _add_limit_flags(serve: argparse.ArgumentParser, defaults: dict[str, object]) -> None:
    limits = serve.add_argument_group(
        "limits", "Beyond a per-key limit: 429 rate_limited; beyond a server-wide one: 503 "
                  "overloaded (both with Retry-After).")
    limits.add_argument("--max-body-bytes", metavar="BYTES", type=int,
                        default=defaults["max_body_bytes"],
                        help="largest request body or WebSocket frame; larger is 413 "
                             "payload_too_large (default: %(default)s)")
    limits.add_argument("--max-context-len", metavar="TOKENS", type=int, default=None,
                        help="longest token history of a session or request; longer is 400 "
                             "context_length_exceeded (default: the model's limit)")
    limits.add_argument("--max-sessions-per-key", metavar="N", type=int,
                        default=defaults["max_sessions_per_key"],
                        help="sessions one key may hold, forks included (default: %(default)s)")
    limits.add_argument("--max-generations-per-key", metavar="N", type=int,
                        default=defaults["max_generations_per_key"],
                        help="generations one key may run at once (default: %(default)s)")
    limits.add_argument("--max-generations", metavar="N", type=int,
                        default=defaults["max_num_generations"],
                        help="generations in flight on the whole server (default: %(default)s)")
    limits.add_argument("--stream-idle-timeout", metavar="SECONDS", type=float,
                        default=defaults["stream_idle_timeout_s"],
                        help="cancel a streamed generation that produces nothing for this long, "
                             "and close a WebSocket idle this long (default: %(default)s)")


def _add_output_flags(serve: argparse.ArgumentParser, env: EnvSettings,
                      defaults: dict[str, object]) -> None:
    output = serve.add_argument_group(
        "logs and progress", "Logs go to stderr: one line per request (with its X-Request-Id) and "
                             "per session transition (docs/api.md, \"Observability\").")
    output.add_argument("--log-format", choices=LOG_FORMATS,
                        default=_pick(env.log_format, defaults["log_format"]),
                        help="text lines, or one JSON object per line (default: $PHLOEM_LOG_FORMAT, "
                             "else %(default)s)")
    output.add_argument("--log-level", choices=LOG_LEVELS,
                        default=_pick(env.log_level, defaults["log_level"]),
                        help="least severe level logged; debug adds /health and /metrics requests "
                             "(default: $PHLOEM_LOG_LEVEL, else %(default)s)")
    output.add_argument("--no-progress", action="store_true", default=env.no_progress,
                        help="no progress bars while building the demo model, loading weights and "
                             "capturing CUDA graphs (default: on when stderr is a terminal, off "
                             "with $PHLOEM_NO_PROGRESS=1)")


def _add_pd_flags(serve: argparse.ArgumentParser) -> None:
    pd = serve.add_argument_group(
        "prefill/decode disaggregation",
        "Two instances of the same model: `--role prefill` computes prompts and streams their KV "
        "and GDN state to `--role decode`, which serves the API (docs/disaggregation.md).")
    pd_defaults = PDConfig()
    pd.add_argument("--role", choices=ROLES, default=pd_defaults.role,
                    help="this instance's part (default: %(default)s: prefill and decode in one)")
    pd.add_argument("--pd-peer", metavar="HOST:PORT",
                    help="rendezvous of the pair: the prefill instance listens there, the decode "
                         "instance connects to it (required with --role prefill|decode)")
    pd.add_argument("--pd-timeout", metavar="SECONDS", type=float, default=pd_defaults.timeout_s,
                    help="longest wait for one transfer message (default: %(default)s)")
    pd.add_argument("--pd-local-prefill-tokens", metavar="N", type=int,
                    default=pd_defaults.local_prefill_tokens,
                    help="the decode instance prefills a prompt itself when it extends a prefix "
                         "cached there (a session's later turn) by at most N tokens; 0 sends "
                         "every prompt to the prefill instance (default: %(default)s)")
    pd.add_argument("--pd-no-local-retry", action="store_true",
                    help="fail a request whose transfer failed, instead of retrying it once on "
                         "the decode instance")


def _pd_config(args: argparse.Namespace) -> PDConfig:
    return PDConfig(role=args.role, peer=args.pd_peer, timeout_s=args.pd_timeout,
                    local_prefill_tokens=args.pd_local_prefill_tokens,
                    retry_local=not args.pd_no_local_retry)


def _pick(env_value: object, default: object) -> object:
    return default if env_value is None else env_value


def _add_data_dir(parser: argparse.ArgumentParser, env: EnvSettings) -> None:
    parser.add_argument("--data-dir", metavar="DIR", type=Path, default=env.data_dir,
                        help="models, spilled sessions and the index (default: $PHLOEM_DATA_DIR, "
                             "else ~/.phloem)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``phloem`` console script.

    Args:
        argv: Arguments without the program name; None: ``sys.argv[1:]``.

    Returns:
        The exit status (argparse exits by itself: 2 on a bad argument, 0 after ``--help``).
    """
    try:
        parser = build_parser()
    except ValueError as exc:  # a PHLOEM_* variable that does not parse
        sys.stderr.write(f"phloem: error: {exc}\n")
        return 2
    args = parser.parse_args(argv)
    command = command_parser(parser, args)
    try:
        config = args.configure(args)
    except ValueError as exc:
        # A value argparse accepted but the config rejects: a usage error naming the field.
        command.error(str(exc))
    try:
        return int(args.run(config))
    except StartupError as exc:  # this machine cannot (no CUDA, port taken): one line
        sys.stderr.write(f"{command.prog}: error: {exc}\n")
        return 2


def _api_keys(args: argparse.Namespace) -> tuple[ApiKey, ...]:
    keys = [parse_api_key(text, "--api-key") for text in args.api_key or ()]
    if args.api_keys_file is not None:
        try:
            keys += read_api_keys_file(args.api_keys_file)
        except OSError as exc:
            raise ValueError(f"api_keys_file: cannot read {args.api_keys_file}: {exc.strerror}") from None
    if not keys and args.env_api_key:
        keys.append(parse_api_key(args.env_api_key, "$PHLOEM_API_KEY"))
    return tuple(keys)


def _server_config(args: argparse.Namespace) -> ServerConfig:
    options = {"data_dir": args.data_dir} if args.data_dir is not None else {}
    model = args.model
    if args.shape:
        if args.model:
            raise ValueError("--shape: give either --model or --shape, not both")
        model = str(ensure_shape_model(args.shape, options.get("data_dir") or default_data_dir()))
    check_model_folder(model)
    return ServerConfig(
        host=args.host,
        port=args.port,
        model=model,
        redis_url=args.redis_url,
        device=args.device,
        dtype=args.dtype,
        default_ttl_s=args.default_ttl,
        tensor_parallel_size=args.tp,
        api_keys=_api_keys(args),
        allow_remote_without_auth=args.allow_remote_without_auth,
        max_body_bytes=args.max_body_bytes,
        max_context_len=args.max_context_len,
        max_sessions_per_key=args.max_sessions_per_key,
        max_generations_per_key=args.max_generations_per_key,
        max_num_generations=args.max_generations,
        stream_idle_timeout_s=args.stream_idle_timeout,
        pd=_pd_config(args),
        log_format=args.log_format,
        log_level=args.log_level,
        **hardening_config(args),
        **options,
        **_engine_config(args),
    )


def _engine_config(args: argparse.Namespace) -> dict[str, EngineConfig]:
    """``ServerConfig.engine`` from ``phloem serve``'s engine flags; left out when they say nothing
    beyond the server's own ``--device`` / ``--dtype`` / ``--tp`` (``ServerConfig.engine_config``
    derives the same then, with ``--max-context-len``)."""
    load, parallel = LoadConfig(device=args.device, dtype=args.dtype), ParallelConfig(tensor_parallel_size=args.tp)
    config = EngineConfig(
        load=dataclasses.replace(load, load_format="dummy" if args.shape else "safetensors",
                                 show_progress=False if args.no_progress else None),
        cache=CacheConfig(enable_prefix_caching=not args.no_prefix_cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                                  async_scheduling=not args.no_async_scheduling),
        parallel=dataclasses.replace(parallel, expert_parallel=args.ep),
        kernels=kernel_config(),
    )
    return {} if config == EngineConfig(load=load, parallel=parallel) else {"engine": config}


def _serve(config: ServerConfig) -> int:
    from phloem.runtime.logs import stderr_logging
    from phloem.storage import StorageError, lock_data_dir

    # Before torch loads anything: kernel caches on disk, then what would fail late (preflight).
    startup = StartupLog()
    use_kernel_caches(config.data_dir / "kernel-cache")
    check_device(config.device)
    sock = bind_port(config.host, config.port) if config.pd.role != "prefill" else None
    # The server's logging, from the first line on (``serve`` finds it installed and keeps it).
    with stderr_logging(config.log_format, config.log_level), contextlib.ExitStack() as held:
        if config.pd.role != "prefill":
            # One server per data directory; an unusable one is a usage error (exit 2).
            try:
                held.enter_context(lock_data_dir(config.data_dir))
            except StorageError as exc:
                logging.getLogger("phloem.cli.main").error("phloem serve: --data-dir: %s", exc)
                return 2
        if config.model is None:
            from phloem.runtime.builtin_model import DEFAULT_MODEL_NAME, trained_model_path

            folder = trained_model_path()
            logging.getLogger("phloem.cli.main").warning(
                "phloem: no --model given; serving the built-in model %s from %s: a 4M-parameter "
                "test model that writes tool calls but knows nothing (use --model DIR for a real "
                "model)", DEFAULT_MODEL_NAME, folder)
            config = dataclasses.replace(config, model=str(folder))
        if config.pd.role == "prefill":
            from phloem.runtime.pd.prefill import run_prefill_worker

            run_prefill_worker(config.model, config.engine_config, config.pd)
            return 0
        with startup.phase("imports", "importing torch and the server"):
            from phloem.api.server.app import serve
        serve(config, sock=sock, startup=startup)
    return 0


def _demo_options(args: argparse.Namespace) -> DemoOptions:
    check_model_folder(args.model)
    return DemoOptions(
        base_url=args.base_url,
        api_key=args.api_key,
        max_tokens=args.max_tokens,
        model=args.model,
        data_dir=args.data_dir,
        startup_timeout_s=args.startup_timeout,
        port=args.port,
    )


def _demo(options: DemoOptions) -> int:
    from phloem.api.sdk import Client
    from phloem.cli.demo import run_demo

    # The SDK is handed in, so a test can drive the story with a stand-in client.
    return run_demo(options, Client, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())

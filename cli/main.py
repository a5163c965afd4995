"""The ``phloem`` command: ``serve``, ``demo``, ``bench`` and ``estimate``.

The composition root (``phloem.cli``): it imports ``phloem.api`` (the server in ``serve``, the SDK
in ``demo``) inside the function that needs it, so ``phloem --help`` stays fast and the SDK side
of ``demo`` never imports torch; ``phloem bench`` comes from ``phloem.benchmarks.cli``.

``phloem serve`` builds its ``ServerConfig`` (``cli.config``) here, in one place
(``_server_config``): every flag that sets one field is a row of ``cli.options.SERVE``; flags
default to the ``PHLOEM_*`` environment variables (``runtime.env``), then to the fields'
defaults. ``_serve`` runs the process-level checks (kernel caches, device, port, data-directory
lock) and hands the config to the composition root, ``cli.compose``.
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
from phloem.api.server.config import ApiKey, parse_api_key, read_api_keys_file
from phloem.cli.config import ServerConfig
from phloem.cli.demo import DEFAULT_MAX_TOKENS, DemoOptions
from phloem.cli.estimate import add_estimate_command
from phloem.cli.options import add_serve_flags, config_from_args, flag_values
from phloem.runtime.model_shapes import SHAPES, ensure_shape_model
from phloem.runtime.env import EnvSettings, default_data_dir, kernel_config, read_env, use_kernel_caches
from phloem.cli.parsers import command_parser, shorten_usage
from phloem.runtime.preflight import StartupError, bind_port, check_device, resolve_model_folder
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
    parser = argparse.ArgumentParser(
        prog="phloem",
        description="Phloem: an inference runtime for LLM agents (sessions, prefix cache, fork).",
        epilog="examples:\n  phloem serve\n  phloem demo\n  phloem estimate --shape qwen3.5-35b-a3b\n  phloem serve --help",
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
    groups = add_serve_flags(serve, env)
    serve.add_argument("--shape", choices=sorted(SHAPES),
                       help="serve DUMMY (random) weights of a benchmark shape with the demo "
                            "tokenizer, instead of --model (benchmarks only)")
    _add_auth_flags(groups["authentication"], serve, env)
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
    add_estimate_command(commands)
    shorten_usage(parser)
    return parser


def _add_auth_flags(auth: argparse._ArgumentGroup, serve: argparse.ArgumentParser, env: EnvSettings) -> None:
    """The API key flags: not one field each (``_api_keys`` merges them into ``http.api_keys``)."""
    auth.add_argument("--api-key", metavar="KEY[:admin]", action="append",
                      help="accept this API key (repeatable); `:admin` also lets it list every "
                           "key's sessions. Visible in `ps`: prefer --api-keys-file or "
                           "$PHLOEM_API_KEY (its default when neither flag is given)")
    auth.add_argument("--api-keys-file", metavar="FILE", type=Path, default=env.api_keys_file,
                      help="read API keys from FILE, one KEY[:admin] per line; blank lines and "
                           "lines starting with # are skipped (default: $PHLOEM_API_KEYS_FILE)")
    # Kept out of the help text and its %(default)s on purpose: it is a secret.
    serve.set_defaults(env_api_key=env.api_key)


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
    """The one place ``phloem serve``'s flags and ``PHLOEM_*`` variables become a ``ServerConfig``:
    the ``cli.options.SERVE`` rows, then the flags that are not one field each."""
    values = flag_values(args)
    if args.shape:
        if args.model:
            raise ValueError("--shape: give either --model or --shape, not both")
        data_dir = values.get("sessions.data_dir") or default_data_dir()
        values["model"] = str(ensure_shape_model(args.shape, data_dir))
        values["engine.load.load_format"] = "dummy"
    values["model"] = resolve_model_folder(values.get("model"))
    values["http.api_keys"] = _api_keys(args)
    values["engine.kernels"] = kernel_config()
    return config_from_args(values)


def _serve(config: ServerConfig) -> int:
    from phloem.runtime.logs import stderr_logging
    from phloem.storage import StorageError, lock_data_dir

    # Before torch loads anything: kernel caches on disk, then what would fail late (preflight).
    startup = StartupLog()
    use_kernel_caches(config.data_dir / "kernel-cache")
    check_device(config.engine.load.device)
    http = config.http
    sock = bind_port(http.host, http.port) if config.pd.role != "prefill" else None
    # The server's logging, from the first line on (``serve`` finds it installed and keeps it).
    with stderr_logging(http.log_format, http.log_level), contextlib.ExitStack() as held:
        if sock is not None:
            held.enter_context(sock)  # closed however the server ends (a start-up error included)
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

            run_prefill_worker(config.model, config.engine, config.pd)
            return 0
        with startup.phase("imports", "importing torch and the server"):
            from phloem.cli.compose import serve
        serve(config, sock=sock, startup=startup)
    return 0


def _demo_options(args: argparse.Namespace) -> DemoOptions:
    model = resolve_model_folder(args.model)
    return DemoOptions(
        base_url=args.base_url,
        api_key=args.api_key,
        max_tokens=args.max_tokens,
        model=model,
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

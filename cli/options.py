"""``phloem serve``'s flags, each mapped to its ``ServerConfig`` field in one table (``SERVE``).

A row names its flag, the dotted path of the field it sets (``engine.scheduler.max_num_seqs``),
its help text and, when a ``PHLOEM_*`` variable supplies its default, that variable's
``EnvSettings`` field. Its default, and the ``(default: ...)`` of its help, come from the field
itself (``field_default``), so no default is written twice; a field whose default is None (the
engine's choice) says what None means in ``default_text``. ``add_serve_flags`` adds the rows to
the parser; ``config_from_args`` builds every section from the parsed flags, the only place a
flag's value meets the config. Flags that are not one field (``--shape``, ``--api-key``) are
resolved by ``cli.main``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from phloem.cli.config import ServerConfig
from phloem.engine.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS, DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, SpeculativeConfig,
)
from phloem.runtime.logs import LOG_FORMATS, LOG_LEVELS
from phloem.runtime.pd.roles import ROLES
from phloem.runtime.preflight import check_chat_template
from phloem.runtime.shared_prefixes import read_shared_prefix_file

__all__ = ["GROUPS", "SERVE", "Flag", "add_serve_flags", "config_from_args", "field_default", "flag_values"]

Kind = Literal["value", "switch", "negate", "append", "extend"]


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag of ``phloem serve`` and the ``ServerConfig`` field it sets.

    Args:
        flag: The option string, ``--max-num-seqs``.
        path: The field it sets, dotted from ``ServerConfig``: ``engine.scheduler.max_num_seqs``.
        help: What it does; the default is appended from the field (``value`` flags).
        group: The help section it is listed in (None: the command's own options).
        kind: ``value`` (takes a value), ``switch`` (sets the field True), ``negate`` (sets it
            False: ``--no-prefix-cache``), ``append`` (repeatable, a tuple), ``extend`` (one or
            more values, repeatable, a tuple: ``--served-model-name a b``).
        type: argparse's conversion of the text.
        metavar / choices: as argparse's.
        env: The ``EnvSettings`` field whose value, when set, is the default instead.
        default_text: What the default means when the field's default is None or computed.
        convert: Turns the parsed value into the field's (``--shared-prefix-file``: the file's
            prefixes); ``ValueError`` is a usage error.
    """

    flag: str
    path: str
    help: str
    group: str | None = None
    kind: Kind = "value"
    type: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: Sequence[str] | None = None
    env: str | None = None
    default_text: str | None = None
    convert: Callable[[Any], Any] | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


_LIMITS = "limits"
_AUTH = "authentication"
_HARDENING = "tenancy and hardening"
_LOGS = "logs and progress"
_PD = "prefill/decode disaggregation"
_MEMORY = "memory and cache"

GROUPS = {
    _MEMORY: "After the weights load, the KV page pool (full-attention layers) and the GDN state-slot pool "
             "(prefix-cache checkpoints, running requests) are sized from the GPU memory left; "
             "`phloem estimate` prints the sizes without a GPU (docs/models.md).",
    _AUTH: "Clients send `Authorization: Bearer KEY`; a session belongs to the key that created it. "
           "Without any key every request is one anonymous owner, and only loopback is served.",
    _LIMITS: "Beyond a per-key limit: 429 rate_limited; beyond a server-wide one: 503 overloaded "
             "(both with Retry-After).",
    _HARDENING: "docs/api.md, \"Security model\".",
    _PD: "Two instances of the same model: `--role prefill` computes prompts and streams their KV and "
         "GDN state to `--role decode`, which serves the API (docs/disaggregation.md).",
    _LOGS: "Logs go to stderr: one line per request (with its X-Request-Id) and per session "
           "transition (docs/api.md, \"Observability\").",
}

_BUDGETS = ", ".join(f"{tokens} on {'a GPU' if kind == 'cuda' else kind.upper()}"
                     for kind, tokens in DEFAULT_MAX_NUM_BATCHED_TOKENS.items())

SERVE: tuple[Flag, ...] = (
    Flag("--model", "model", "Hugging Face model folder", metavar="DIR", env="model",
         default_text="the built-in tiny model, trained, shipped with phloem"),
    Flag("--served-model-name", "http.served_model_names",
         "name(s) the API serves the model under: the first is reported in /v1/models and responses, each is "
         "accepted in a request's `model`", kind="extend", metavar="NAME", default_text="the model folder's name"),
    Flag("--chat-template", "chat_template",
         "Jinja chat template file used instead of the model's; the tool-call format and reasoning tags are "
         "read from it too", metavar="FILE", type=Path, default_text="the model's", convert=check_chat_template),
    Flag("--host", "http.host", "bind address", env="host"),
    Flag("--port", "http.port", "TCP port", type=int, env="port"),
    Flag("--redis-url", "sessions.redis_url", "Redis URL of the session index", metavar="URL", env="redis_url",
         default_text="embedded SQLite index"),
    Flag("--data-dir", "sessions.data_dir", "models, spilled sessions and the index", metavar="DIR", type=Path,
         env="data_dir", default_text="~/.phloem"),
    Flag("--device", "engine.load.device", "torch device: cpu, cuda, cuda:N", env="device"),
    Flag("--dtype", "engine.load.dtype", "weight dtype; auto takes the checkpoint's", choices=DTYPES, env="dtype"),
    Flag("--quantization", "engine.load.quantization",
         "fp8: quantize a bf16 checkpoint's (or --shape's dummy) projection weights at load to block FP8 "
         "(e4m3, a scale per 128x128 block); an FP8 checkpoint (quantization_config quant_method fp8) loads "
         "as FP8 without it", choices=QUANTIZATIONS,
         default_text="none: the weights as stored"),
    Flag("--kv-cache-dtype", "engine.cache.kv_cache_dtype",
         "KV pages' dtype: auto is the model's; fp8_e4m3 stores float8_e4m3fn with a unit scale (half the bytes "
         "of bf16 per token; docs/decisions.md, \"FP8 KV cache\")", choices=KV_CACHE_DTYPES),
    Flag("--tp", "engine.parallel.tensor_parallel_size",
         "tensor parallelism: N processes (on CUDA, N GPUs from --device) run the model", metavar="N", type=int),
    Flag("--ep", "engine.parallel.expert_parallel",
         "expert parallelism: with --tp N, each rank holds E/N whole routed experts instead of a slice of "
         "every expert", kind="switch"),
    Flag("--no-prefix-cache", "engine.cache.enable_prefix_caching",
         "disable the radix prefix cache (benchmark baseline)", kind="negate"),
    Flag("--max-num-batched-tokens", "engine.scheduler.max_num_batched_tokens",
         "token budget of one engine step: larger prefills faster, smaller keeps concurrent decodes smoother",
         metavar="TOKENS", type=int, default_text=_BUDGETS),
    Flag("--max-num-seqs", "engine.scheduler.max_num_seqs", "requests decoding at once", metavar="N", type=int),
    Flag("--no-async-scheduling", "engine.scheduler.async_scheduling",
         "read each step's sampled ids before preparing the next step (default: the next decode step is "
         "queued while the device runs the current one)", kind="negate"),
    Flag("--speculative", "engine.speculative",
         "speculative decoding: mtp:K drafts K tokens a step (1-4) with the model's MTP layer; greedy and "
         "seeded requests get the same tokens as without, unseeded sampled ones the same distribution; "
         "it turns async scheduling off, and its steps run eagerly (CUDA graphs serve the plain steps); "
         "on CUDA at --tp 1 only", metavar="mtp:K", default_text="off", convert=SpeculativeConfig.parse),
    Flag("--speculative-max-verify-tokens", "engine.speculative.max_verify_tokens",
         "with --speculative mtp:K: a decode step of more than N / (K + 1) requests runs plain (the verify "
         "of batch x (K + 1) tokens would no longer be bandwidth-bound)", metavar="N", type=int),
    Flag("--default-ttl", "sessions.default_ttl_s", "seconds a session stays pinned after a turn",
         metavar="SECONDS", type=float),
    Flag("--no-session-tiers", "sessions.session_tiers",
         "never spill idle sessions to host memory or disk: the engine evicts them and their next turn "
         "recomputes what it evicted (what stateless servers do; a benchmark baseline)", kind="negate"),
    Flag("--host-budget-bytes", "sessions.host_budget_bytes",
         "bytes of spilled session state kept in host memory; beyond it the least recently used go to disk "
         "(on CUDA pinned at start-up, with the backlog's and a quarter more for disk reads)",
         group=_MEMORY, metavar="BYTES", type=int),
    Flag("--host-backlog-bytes", "sessions.host_backlog_bytes",
         "bytes of spilled state that may wait, beyond the host budget, for the disk writes that make its "
         "room (spills do not wait for the disk); with the disk that far behind, the least recently used "
         "host segment is dropped and recomputed if needed", group=_MEMORY, metavar="BYTES", type=int,
         default_text="a quarter of --host-budget-bytes"),
    Flag("--idle-to-host", "sessions.idle_to_host_s",
         "seconds an unpinned session stays on the GPU before it is spilled to host memory "
         "(0: spilled as its pin ends, before the unpin: for more sessions than the GPU holds)",
         group=_MEMORY, metavar="SECONDS", type=float),
    Flag("--spill-sweep-interval", "sessions.sweep_interval_s",
         "seconds between two passes of the sweeper that spills idle sessions", group=_MEMORY,
         metavar="SECONDS", type=float),
    Flag("--gpu-memory-utilization", "engine.cache.memory_fraction",
         "share of the GPU memory still free once the weights are loaded that the KV page and state-slot "
         "pools take (vLLM's flag of this name is a share of the whole GPU, weights included); unused on CPU, "
         "where the pools take a fixed 256 MiB", group=_MEMORY, metavar="FRACTION", type=float),
    Flag("--num-pages", "engine.cache.num_pages",
         "KV pages in the pool (each holds 16 tokens of every full-attention layer), instead of sizing them "
         "from memory", group=_MEMORY, metavar="N", type=int, default_text="from memory"),
    Flag("--num-state-slots", "engine.cache.num_state_slots",
         "GDN state slots (one per running request or cached checkpoint), instead of sizing them from memory",
         group=_MEMORY, metavar="N", type=int, default_text="from memory"),
    Flag("--checkpoint-interval", "engine.cache.checkpoint_interval",
         "also checkpoint the GDN state every this many tokens of a long prompt, so a later prompt sharing "
         "part of it resumes there (a multiple of the 16-token page; 0: none)", group=_MEMORY, metavar="TOKENS",
         type=int),
    Flag("--prompt-end-split-min-tokens", "engine.cache.prompt_end_split_min_tokens",
         "a turn resumed from the cache that adds fewer prompt tokens than this keeps its prompt-end "
         "checkpoint at the prompt's very end (one step to its first token; a resend recomputes those "
         "tokens); 0: every resent prompt is a full hit", group=_MEMORY, metavar="TOKENS", type=int),
    Flag("--grammar-compile-timeout", "engine.grammar.compile_timeout_s",
         "seconds a request waits for its grammar (response_format, tool calls) to compile before it "
         "is refused", group=_LIMITS, metavar="SECONDS", type=float),
    Flag("--grammar-cache-bytes", "engine.grammar.cache_bytes",
         "bytes of compiled grammars kept, by their measured size", group=_LIMITS, metavar="BYTES", type=int),
    Flag("--grammar-cache-bytes-per-key", "engine.grammar.cache_bytes_per_owner",
         "of which one API key's grammars may hold at most this much", group=_LIMITS, metavar="BYTES",
         type=int),
    Flag("--grammar-compile-workers", "engine.grammar.compile_workers",
         "threads that compile grammars (a pool of their own)", group=_LIMITS, metavar="N", type=int),
    Flag("--grammar-compiles-per-key", "engine.grammar.compile_per_owner",
         "grammars one API key compiles at once; its others queue", group=_LIMITS, metavar="N", type=int),
    Flag("--grammar-max-schema-bytes", "engine.grammar.max_schema_bytes",
         "largest grammar (a JSON schema, or every tool's schema together) accepted, in bytes of JSON",
         group=_LIMITS, metavar="BYTES", type=int),
    Flag("--grammar-max-enum-values", "engine.grammar.max_enum_values",
         "values one JSON-schema enum may list", group=_LIMITS, metavar="N", type=int),
    Flag("--allow-remote-without-auth", "http.allow_remote_without_auth",
         "serve a non-loopback --host without API keys: anyone who can reach the port can read every session",
         group=_AUTH, kind="switch"),
    Flag("--max-body-bytes", "http.max_body_bytes",
         "largest request body or WebSocket frame; larger is 413 payload_too_large", group=_LIMITS,
         metavar="BYTES", type=int),
    Flag("--max-context-len", "engine.scheduler.max_model_len",
         "longest token history of a session or request; longer is 400 context_length_exceeded",
         group=_LIMITS, metavar="TOKENS", type=int, default_text="the model's limit"),
    Flag("--max-sessions-per-key", "http.max_sessions_per_key", "sessions one key may hold, forks included",
         group=_LIMITS, metavar="N", type=int),
    Flag("--max-generations-per-key", "http.max_generations_per_key", "generations one key may run at once",
         group=_LIMITS, metavar="N", type=int),
    Flag("--max-generations", "sessions.max_num_generations", "generations in flight on the whole server",
         group=_LIMITS, metavar="N", type=int),
    Flag("--stream-idle-timeout", "http.stream_idle_timeout_s",
         "cancel a streamed generation that produces nothing for this long, and close a WebSocket idle "
         "this long", group=_LIMITS, metavar="SECONDS", type=float),
    Flag("--shared-prefix-file", "sessions.shared_prefixes",
         "JSON Lines of prefixes (system prompts) every key may hit in the prefix cache, which is otherwise "
         "partitioned by key", group=_HARDENING, metavar="FILE", type=Path, default_text="none",
         convert=read_shared_prefix_file),
    Flag("--allowed-host", "http.allowed_hosts",
         "also accept this Host / Origin name (repeatable); without API keys only loopback names are "
         "accepted otherwise", group=_HARDENING, kind="append", metavar="HOST"),
    Flag("--docs-ui", "http.docs_ui", "serve the interactive API pages under /schema", group=_HARDENING,
         kind="switch"),
    Flag("--header-timeout", "http.header_timeout_s",
         "close a connection that has not sent a whole request head after this long", group=_HARDENING,
         metavar="SECONDS", type=float),
    Flag("--keepalive-timeout", "http.keepalive_timeout_s",
         "close a connection idle between requests after this long", group=_HARDENING, metavar="SECONDS",
         type=float),
    Flag("--max-connections", "http.max_connections", "open connections at most; more are closed at once",
         group=_HARDENING, metavar="N", type=int),
    Flag("--idempotency-quota", "http.idempotency_entries_per_key",
         "Idempotency-Key outcomes one key keeps; beyond, its own oldest go", group=_HARDENING, metavar="N",
         type=int),
    Flag("--role", "pd.role", "this instance's part (both: prefill and decode in one)", group=_PD,
         choices=ROLES),
    Flag("--pd-peer", "pd.peer",
         "rendezvous of the pair: the prefill instance listens there, the decode instance connects to it "
         "(required with --role prefill|decode)", group=_PD, metavar="HOST:PORT"),
    Flag("--pd-timeout", "pd.timeout_s", "longest wait for one transfer message", group=_PD,
         metavar="SECONDS", type=float),
    Flag("--pd-local-prefill-tokens", "pd.local_prefill_tokens",
         "the decode instance prefills a prompt itself when it extends a prefix cached there (a session's "
         "later turn) by at most N tokens; 0 sends every prompt to the prefill instance", group=_PD,
         metavar="N", type=int),
    Flag("--pd-no-local-retry", "pd.retry_local",
         "fail a request whose transfer failed, instead of retrying it once on the decode instance",
         group=_PD, kind="negate"),
    Flag("--log-format", "http.log_format", "text lines, or one JSON object per line", group=_LOGS,
         choices=LOG_FORMATS, env="log_format"),
    Flag("--log-level", "http.log_level",
         "least severe level logged; debug adds /health and /metrics requests", group=_LOGS,
         choices=LOG_LEVELS, env="log_level"),
    Flag("--no-progress", "engine.load.show_progress",
         "no progress bars while building the demo model, loading weights and capturing CUDA graphs "
         "(default: on when stderr is a terminal, off with $PHLOEM_NO_PROGRESS=1)", group=_LOGS,
         kind="negate", env="no_progress"),
)


def _section(cls: type, name: str) -> dataclasses.Field[Any]:
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    if name not in by_name:
        raise KeyError(f"{cls.__name__} has no field {name!r}")
    return by_name[name]


def _section_type(f: dataclasses.Field[Any]) -> type | None:
    """The section class of a field declared ``field(default_factory=SectionClass)``."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def field_default(path: str) -> Any:
    """The declared default of the ``ServerConfig`` field at ``path`` (None for a computed one)."""
    cls: type = ServerConfig
    *sections, name = path.split(".")
    for section in sections:
        found = _section_type(_section(cls, section))
        assert found is not None, f"{path}: {section} is not a section"
        cls = found
    f = _section(cls, name)
    return None if f.default is dataclasses.MISSING else f.default


def add_serve_flags(serve: argparse.ArgumentParser, env: Any) -> dict[str, Any]:
    """Add every ``SERVE`` row to ``serve``, in groups; defaults from ``env`` (``EnvSettings``),
    else from the field. Returns the argument groups by title (for the flags that are no field)."""
    groups = {title: serve.add_argument_group(title, text) for title, text in GROUPS.items()}
    for flag in SERVE:
        target = groups[flag.group] if flag.group else serve
        env_value = getattr(env, flag.env) if flag.env else None
        if flag.kind in ("switch", "negate"):
            target.add_argument(flag.flag, action="store_true", default=bool(env_value), help=flag.help)
            continue
        if flag.kind in ("append", "extend"):
            target.add_argument(flag.flag, action=flag.kind, nargs="+" if flag.kind == "extend" else None,
                                default=[], metavar=flag.metavar,
                                help=f"{flag.help} (default: {flag.default_text})" if flag.default_text else flag.help)
            continue
        declared = None if flag.convert else field_default(flag.path)  # converted: the field's default is no text
        shown = flag.default_text if flag.default_text is not None else "%(default)s"
        if flag.env:  # the help names the variable, then the field's own default
            shown = f"$PHLOEM_{flag.env.upper()}, else {flag.default_text or declared}"
        target.add_argument(flag.flag, default=declared if env_value is None else env_value, type=flag.type,
                            metavar=flag.metavar,
                            choices=flag.choices,
                            help=flag.help if declared is None and shown == "%(default)s" else f"{flag.help} (default: {shown})")
    return groups


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """``{path: value}`` of the ``SERVE`` flags ``args`` set (a None value leaves the field's
    default; a switch not given leaves it too).

    Raises:
        ValueError: a ``convert`` rejects its value.
    """
    values: dict[str, Any] = {}
    for flag in SERVE:
        value = getattr(args, flag.dest)
        if flag.kind == "switch":
            value = True if value else None
        elif flag.kind == "negate":
            value = False if value else None
        elif flag.kind in ("append", "extend"):
            value = tuple(value) if value else None
        if value is not None:
            values[flag.path] = flag.convert(value) if flag.convert else value
    return values


def config_from_args(values: dict[str, Any]) -> ServerConfig:
    """Build ``ServerConfig`` and each of its sections from ``{dotted path: value}``; a section no
    value names keeps its default; each section validates its own fields (``ValueError``)."""
    return _build(ServerConfig, values, "")


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        section = _section_type(f)
        nested = section is not None and any(key.startswith(path + ".") for key in values)
        if path in values and nested:  # a whole section (``--speculative mtp:3``) and flags of its fields
            kwargs[f.name] = _build(section, {**_fields_of(values[path], path), **values}, path + ".")  # type: ignore[arg-type]
        elif path in values:
            kwargs[f.name] = values[path]
        elif nested:
            kwargs[f.name] = _build(section, values, path + ".")  # type: ignore[arg-type]
    unknown = [k for k in values if k.startswith(prefix) and k.removeprefix(prefix).split(".")[0]
               not in {f.name for f in dataclasses.fields(cls)}]
    assert not unknown, f"no such field: {unknown}"
    return cls(**kwargs)


def _fields_of(section: Any, path: str) -> dict[str, Any]:
    """``{path.field: value}`` of a section object's fields."""
    return {f"{path}.{f.name}": getattr(section, f.name) for f in dataclasses.fields(section)}

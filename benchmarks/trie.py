"""``phloem bench trie``: the external harness ``tokenspeed-trie`` against our ``/v1/completions``.

A check that a client nobody here wrote gets sensible numbers from us. ``tokenspeed-trie``
(PyPI; import name and command ``trie``) replays closed-loop agentic traces on an OpenAI
``/v1/completions`` endpoint with ``ignore_eos`` and ``stream_options.include_usage`` and reads
``usage.prompt_tokens_details.cached_tokens``. This module

1. writes the agentic workload of ``benchmarks.agentic`` (one long first turn, then tool results of
   ``append`` tokens, ``output`` tokens per turn) as a trie JSONL file, one trace per agent;
2. runs the harness's own CLI in a subprocess (``python -m trie.cli``), exactly as a user would,
   and parses its ``benchmark complete`` summary line;
3. runs our own client (``run_agentic``, modes ``sessions`` and ``stateless``) on the same
   workload against the same server, and puts both side by side.

Design decisions:

- trie's prompts are TEXT: random token ids decoded by the tokenizer (``--tokenizer``: the built-in
  model's folder by default, which is deterministic, so it matches any server that serves the
  built-in model), then each turn appends the generated *text* and a new random text. Its cache
  hits therefore depend on the generated text re-tokenizing to the generated ids; our stateless
  client sends token ids (``return_token_ids``) and cannot drift. The ideal row of the table is
  what a drift-free trace gets, computed from the workload alone (``ideal_hit_rates``).
- trie runs for a duration (it cycles its traces and cancels what is in flight at the deadline);
  ours runs every agent's conversation once. Both report per-trace means, so the rows compare.
- trie subtracts one token from the first prompt (BOS compensation for servers that add one; we
  add none), so its first turn is ``first_turn - 1`` tokens, and its synthesized texts may miss
  their target length by a token or two (it warns). Both are left as the harness does them.
- Forks are not modelled by trie: a workload with forks is refused.
- trie's ``openai`` client refuses to start without an API key; a server without keys ignores
  the placeholder sent, a server with keys needs ``$OPENAI_API_KEY``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import httpx

from phloem.benchmarks.agentic import AgenticWorkload, TurnRecord, run_agentic
from phloem.benchmarks.local_server import LocalServer

__all__ = [
    "TrieReport", "ideal_hit_rates", "parse_trie_output", "per_trace_rates", "run_trie", "run_trie_bench",
    "trie_workload_rows", "write_trie_workload",
]  # fmt: skip

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PAIR = re.compile(r"(\w+)=(\S+)")
_PLACEHOLDER_KEY = "phloem-bench-no-key"


@dataclass(frozen=True, slots=True)
class TrieReport:
    """What one harness run printed.

    Attributes:
        command: The command line that ran it.
        metrics: The key=value pairs of its ``benchmark complete`` line (``completed_requests``
            counts completed traces; ``*_pct_*`` are percentages; ``ttft_s_*`` is per trace).
        tables: Its two tables (per-trace and workload metrics), as printed, colours removed.
    """

    command: list[str]
    metrics: dict[str, float]
    tables: str


def trie_workload_rows(wl: AgenticWorkload) -> list[dict[str, object]]:
    """The trie JSONL rows of ``wl``: one trace per agent, ``wl.turns`` requests each.

    Trie's trace is ``num_turns`` tool-use requests plus a final one, so ``num_turns`` is
    ``wl.turns - 1``: request 1 sends ``first_turn`` tokens, every later one ``append`` more.

    Raises:
        ValueError: ``wl`` forks (trie has no forks) or has no turn.
    """
    if wl.forks:
        raise ValueError(f"forks: tokenspeed-trie replays linear traces only, got forks={wl.forks}")
    if wl.turns < 1:
        raise ValueError(f"turns: expected >= 1, got {wl.turns}")
    n = wl.turns - 1
    row = {
        "num_turns": n, "input_prompt_length": wl.first_turn, "assistant_response_length": [wl.output] * n,
        "tool_call_output_length": [wl.append] * n, "tool_call_latency": [wl.tool_pause_s] * n,
        "final_assistant_response_length": wl.output,
    }  # fmt: skip
    return [dict(row) for _ in range(wl.agents)]


def write_trie_workload(wl: AgenticWorkload, path: Path) -> Path:
    """Write ``trie_workload_rows(wl)`` as JSONL to ``path``; returns ``path``."""
    path.write_text("".join(json.dumps(row) + "\n" for row in trie_workload_rows(wl)))
    return path


def ideal_hit_rates(wl: AgenticWorkload) -> tuple[float, float]:
    """Per-trace (hit rate, eligible hit rate) when every request reuses all earlier tokens.

    Request ``r`` (0-based) has ``first_turn + r * (output + append)`` prompt tokens and, from
    ``r = 1``, reuses the previous prompt and output. Trie's eligible denominator is exactly that
    reuse, so its ideal is 1.0 (0.0 for a one-request trace).
    """
    prompts = [wl.first_turn + r * (wl.output + wl.append) for r in range(wl.turns)]
    reusable = sum(p + wl.output for p in prompts[:-1])
    return reusable / sum(prompts), 1.0 if reusable else 0.0


def parse_trie_output(text: str) -> tuple[dict[str, float], str]:
    """The summary metrics and the tables from the harness's console output.

    Raises:
        ValueError: There is no ``benchmark complete`` line.
    """
    plain = _ANSI.sub("", text)
    lines = plain.splitlines()
    summary = next((i for i, line in enumerate(lines) if "benchmark complete" in line), None)
    if summary is None:
        raise ValueError(f"no 'benchmark complete' line in the harness output:\n{plain[-2000:]}")
    metrics = {k: float(v) for k, v in _PAIR.findall(lines[summary])}
    tables = "\n".join(line.rstrip() for line in lines[summary + 1 :]).strip("\n")
    return metrics, tables


def run_trie(base_url: str, model: str, tokenizer: Path | str, workload: Path, concurrency: int,
             duration_s: float, seed: int = 0, timeout_s: float = 3600.0) -> TrieReport:  # fmt: skip
    """Run the ``trie`` CLI (streaming) against ``base_url``'s ``/v1/completions``.

    Args:
        base_url: The server, without ``/v1``.
        model: The served model id.
        tokenizer: A tokenizer folder (or Hugging Face id) matching the server's.
        workload: A trie JSONL workload file.
        concurrency: Traces in flight.
        duration_s: How long trie admits new traces.
        seed: Trie's seed (same seed, same prompts).
        timeout_s: Kill the harness after this long.

    Returns:
        Its report.

    Raises:
        ValueError: ``concurrency`` < 1 or ``duration_s`` <= 0.
        RuntimeError: tokenspeed-trie is not installed, or the harness failed.
    """
    if concurrency < 1 or duration_s <= 0:
        raise ValueError(f"concurrency, duration_s: expected >= 1 and > 0, got {concurrency} and {duration_s}")
    try:
        metadata.version("tokenspeed-trie")
    except metadata.PackageNotFoundError as exc:
        raise RuntimeError("tokenspeed-trie is not installed: pip install 'phloem[bench]'") from exc
    command = [
        sys.executable, "-m", "trie.cli", f"workload_path={workload}", f"endpoint={base_url.rstrip('/')}/v1",
        f"model={model}", f"tokenizer_model={tokenizer}", f"concurrency={concurrency}", f"duration={duration_s}",
        "stream=True", f"seed={seed}",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.setdefault("OPENAI_API_KEY", _PLACEHOLDER_KEY)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"trie exited with {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    metrics, tables = parse_trie_output(done.stdout + "\n" + done.stderr)
    return TrieReport(command, metrics, tables)


def per_trace_rates(records: list[TurnRecord]) -> tuple[float, float]:
    """Our records' (hit rate, eligible hit rate), each a mean over traces, as trie defines them.

    A trace is one (agent, branch); its eligible tokens are, for every request after its first,
    the previous request's prompt plus completion tokens.
    """
    traces: dict[tuple[int, int], list[TurnRecord]] = defaultdict(list)
    for r in records:
        traces[(r.agent, r.branch)].append(r)
    hits, eligible = [], []
    for trace in traces.values():
        trace.sort(key=lambda r: r.turn)
        cached = sum(r.cached_tokens for r in trace)
        hits.append(cached / max(1, sum(r.prompt_tokens for r in trace)))
        reusable = sum(r.prompt_tokens + r.completion_tokens for r in trace[:-1])
        eligible.append(cached / reusable if reusable else 0.0)
    return sum(hits) / max(1, len(hits)), sum(eligible) / max(1, len(eligible))


def run_trie_bench(
    wl: AgenticWorkload,
    duration_s: float,
    base_url: str | None = None,
    server_args: tuple[str, ...] = (),
    tokenizer: Path | str | None = None,
    out_dir: str | None = None,
    ours: bool = True,
) -> tuple[str, dict[str, object]]:
    """Run trie and our own client on ``wl`` against one server; returns Markdown + raw data.

    Args:
        wl: The workload (no forks); trie runs ``wl.agents`` traces at a time.
        duration_s: How long trie admits new traces.
        base_url: A running server; without it one ``phloem serve`` is started on a free port.
        server_args: Extra ``phloem serve`` arguments for the server started here.
        tokenizer: The server's tokenizer folder; default: that of the model the server started
            here serves (``_served_tokenizer``), or the built-in model's for ``base_url``.
        out_dir: Where the workload file, ``trie.json`` and the harness's output go (a temporary
            folder when None).
        ours: Also run our client (``sessions`` and ``stateless``) after trie. Off: trie alone
            (on a GPU at the record's sizes each client takes minutes; ``bench agentic`` on the
            same server gives ours).

    Returns:
        The report (comparison table, then trie's tables) and the raw numbers.

    Raises:
        ValueError: ``wl`` forks.
        RuntimeError: The harness or the server failed.
    """
    trie_workload_rows(wl)
    with tempfile.TemporaryDirectory(prefix="phloem-bench-trie-") as scratch:
        out = Path(out_dir or scratch)
        out.mkdir(parents=True, exist_ok=True)
        workload = write_trie_workload(wl, out / "trie_workload.jsonl")
        server = None if base_url is not None else LocalServer(list(server_args), scratch)
        try:
            if server is not None:
                _wait(server)
            url = base_url or server.url  # type: ignore[union-attr]
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            tok = tokenizer or _served_tokenizer(server_args, Path(scratch))
            report = run_trie(url, model, tok, workload, wl.agents, duration_s, wl.seed)
            own = run_agentic(wl, ("sessions", "stateless"), base_url=url)[1] if ours else None
        finally:
            if server is not None:
                server.stop()
        data: dict[str, object] = {
            "workload": asdict(wl), "trie_workload": trie_workload_rows(wl)[0], "duration_s": duration_s,
            "trie": {"command": report.command, "metrics": report.metrics}, "ours": own,
        }  # fmt: skip
        markdown = _markdown(wl, report, own) + "\n\ntokenspeed-trie's own report:\n\n```\n" + report.tables + "\n```"
        (out / "trie.json").write_text(json.dumps(data, indent=2))
        (out / "trie_report.md").write_text(markdown + "\n")
    return markdown, data


def _markdown(wl: AgenticWorkload, report: TrieReport, ours: dict[str, object] | None) -> str:
    m = report.metrics
    traces = int(m.get("completed_requests", 0))
    lines = [
        "| client | prompt sent as | traces | requests | failed | hit rate | eligible hit rate | TTFT turn 1 s "
        "| TPOT ms | per-user decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| tokenspeed-trie | text | {traces} | {traces * wl.turns} | {int(m.get('failed_requests', 0))} "
        f"| {m.get('cache_hit_rate_pct_mean', 0.0):.1f}% | {m.get('eligible_cache_hit_rate_pct_mean', 0.0):.1f}% "
        f"| {m.get('ttft_s_p50', 0.0):.3f} | {_ms(m.get('mean_turn_decode_tps_tok_s_p50', 0.0))} "
        f"| {m.get('mean_turn_decode_tps_tok_s_p50', 0.0):.1f} |",
    ]
    turns: dict[str, list[dict[str, object]]] = ours["turns"] if ours else {}  # type: ignore[assignment]
    summary: dict[str, dict[str, float]] = ours["summary"] if ours else {}  # type: ignore[assignment]
    for mode, form in (("stateless", "token ids"), ("sessions", "session appends")) if ours else ():
        records = [TurnRecord(**r) for r in turns[mode]]  # type: ignore[arg-type]
        hit, eligible = per_trace_rates(records)
        s = summary[mode]
        lines.append(
            f"| phloem {mode} | {form} | {wl.agents} | {len(records)} | 0 | {hit:.1%} | {eligible:.1%} "
            f"| {s['ttft_turn1_s']:.3f} | {_ms(s['per_user_decode_tok_s'])} | {s['per_user_decode_tok_s']:.1f} |"
        )
    hit, eligible = ideal_hit_rates(wl)
    lines.append(f"| ideal (from the workload) | — | — | — | — | {hit:.1%} | {eligible:.1%} | — | — | — |")
    return "\n".join(lines)


def _wait(server: LocalServer) -> None:
    """Wait for ``server``; on failure, put its log in the error (its folder is about to go)."""
    try:
        server.wait()
    except (RuntimeError, TimeoutError) as exc:
        log = Path(server.log.name).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{exc}; its log ends with:\n{log}") from exc


def _served_tokenizer(server_args: tuple[str, ...], scratch: Path) -> Path | str:
    """The tokenizer folder of ``phloem serve SERVER_ARGS``: its ``--model``; for a ``--shape``
    (dummy weights) the random-weight tiny model's, whose tokenizer shapes carry; else the
    built-in default model's."""
    from phloem.runtime.builtin_model import trained_model_path
    from phloem.runtime.default_model import ensure_default_model

    model = _served_model(server_args)
    if model is not None:
        return model
    if any(arg == "--shape" or arg.startswith("--shape=") for arg in server_args):
        return ensure_default_model(scratch)
    return trained_model_path()


def _served_model(server_args: tuple[str, ...]) -> str | None:
    """The ``--model DIR`` among ``server_args`` (its tokenizer is the server's), else None."""
    for i, arg in enumerate(server_args):
        if arg.startswith("--model="):
            return arg.split("=", 1)[1]
        if arg == "--model" and i + 1 < len(server_args):
            return server_args[i + 1]
    return None


def _ms(tok_s: float) -> str:
    return f"{1000.0 / tok_s:.1f}" if tok_s > 0 else "—"

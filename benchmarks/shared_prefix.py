"""``phloem bench agentic --shared-prefix TOKENS``: agents sharing a system prompt, as users meet it.

N agents whose first requests share a system prompt + tool definitions of about ``TOKENS``
tokens (rendered by the server's chat template) and differ after it: each agent's own user
message of ``append`` tokens, then ``turns - 1`` more turns, each appending a user message (or,
when the model called a tool, tool results) of ``append`` tokens. Modes:

- ``stateless``: the openai client on ``/v1/chat/completions``, resending the whole conversation
  every turn (the prefix cache only: branch-point checkpoints, full hits);
- ``sessions``: the native session API on the same messages: ``POST /v1/sessions`` with the
  system prompt and tools (its prefill is timed as ``create``), then one streamed append per turn;
- ``nocache``: the stateless client against a server started with ``--no-prefix-cache``.

Agent k's first request is sent once agent k-1's first request has streamed its first token, so
request index k is the k-th request to meet the shared prefix (the 1st finds nothing cached, the
2nd finds the 1st's pages past its deepest checkpoint and publishes a branch-point checkpoint,
the 3rd+ resume there); after that the agents run concurrently. Output is greedy with
``ignore_eos``. TTFT is time to the first streamed token (content, reasoning or tool-call delta).

The report gives, by request index (1st, 2nd, 3rd+ agent's first request), the hit rate
(``cached_tokens / prompt_tokens`` from ``usage.prompt_tokens_details``) and the share of the
shared prefix served from cache, TTFT p50 / p99, later turns' hit rate and TTFT, and what
``/metrics`` saw: the peak of state slots in use (sampled), whether waiting requests were ever
blocked on memory, failed engine steps, HTTP errors, checkpoints held and evicted, and the
client's failed requests.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from phloem.benchmarks.agentic import AgenticWorkload, _percentile
from phloem.benchmarks.local_server import LocalServer, rss_mib

__all__ = ["PAGE", "SharedPrefixRecord", "SharedPrefixSpec", "build_spec", "run_shared_prefix", "summarize_shared"]

PAGE = 16  # KV page: the prefix cache's granularity
_SCRAPE_S = 0.2
_WORDS = ("alpha", "ledger", "tool", "call", "return", "value", "schema", "field", "agent", "reply", "budget",
          "token", "cache", "shared", "prefix", "system", "check", "order", "route", "state", "invoice", "retry",
          "window", "commit", "branch", "deploy", "metric", "owner", "policy", "record")
_TOOLS = ("search_docs", "read_file", "run_tests", "open_ticket", "query_metrics", "send_reply")


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """The workload's messages: the shared system prompt and tools, and the exact token counts."""

    system: str
    tools: list[dict[str, Any]]
    shared_tokens: int  # tokens every agent's first request shares (the rendered system + tools, and the user header)
    agents: int
    append: int
    words_per_message: int
    seed: int

    def user_message(self, agent: int, turn: int) -> str:
        rng = random.Random(self.seed * 100_003 + agent * 1009 + turn)
        return f"Agent {agent}, step {turn}: " + _words(rng, self.words_per_message)


@dataclass(frozen=True, slots=True)
class SharedPrefixRecord:
    mode: str
    agent: int  # the request index of its first request
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    wall_s: float
    create_s: float = 0.0  # sessions, turn 1: creating the session (prefilling the shared prefix)
    error: str = ""


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _tools(rng: random.Random, words: int, count: int) -> list[dict[str, Any]]:
    per = max(1, words // count)
    return [{"type": "function", "function": {
        "name": name, "description": _words(rng, per),
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": _words(rng, 6)},
            "limit": {"type": "integer", "description": "most results"}}, "required": ["query"]}}}
        for name in _TOOLS[:count]]  # fmt: skip


def build_spec(tokenizer: Any, target: int, agents: int, append: int, seed: int = 0) -> SharedPrefixSpec:
    """Messages whose shared part renders to about ``target`` tokens with ``tokenizer`` (a
    ``phloem.sessions.Tokenizer`` matching the server's); about a sixth of it tool definitions
    (one tool per 400 tokens, at most six)."""
    rng = random.Random(seed)
    tools = _tools(rng, max(6, target // 6), min(len(_TOOLS), max(1, target // 400)))  # ~130 tokens of schema each
    served = _as_served(tools)
    base = len(tokenizer.encode(tokenizer.render_text([{"role": "system", "content": "x"}], tools=served)))
    words = max(1, target - base)
    text = ""
    for _ in range(4):  # a word is a token or two: converge on the target
        text = _words(random.Random(seed + 1), words)
        got = len(tokenizer.encode(tokenizer.render_text([{"role": "system", "content": text}], tools=served)))
        if abs(got - target) <= max(8, target // 200):
            break
        words = max(1, round(words * (target - base) / max(1, got - base)))
    per_word = len(tokenizer.encode(" " + _words(random.Random(seed + 2), 200))) / 200
    spec = SharedPrefixSpec(text, tools, 0, agents, append, max(1, round(append / per_word)), seed)
    firsts = [tokenizer.render_messages(_first_messages(spec, a), tools=served, add_generation_prompt=True)
              for a in range(min(2, agents))]  # fmt: skip
    shared = len(firsts[0]) if len(firsts) == 1 else next(
        (i for i, (x, y) in enumerate(zip(*firsts)) if x != y), min(map(len, firsts)))
    return SharedPrefixSpec(text, tools, shared, agents, append, spec.words_per_message, seed)


def _as_served(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as the server hands them to the chat template (through its wire schema: its
    own key order and defaults), so the token counts here are the server's."""
    import msgspec

    from phloem.api.schemas import Tool
    from phloem.api.server.convert import tool_specs

    return list(tool_specs(msgspec.convert(tools, list[Tool])) or ())


def _first_messages(spec: SharedPrefixSpec, agent: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": spec.system}, {"role": "user", "content": spec.user_message(agent, 1)}]


_Tick = Callable[[int], None]


def _ignore(n: int) -> None:
    del n


async def _wait_turn(events: list[asyncio.Event], agent: int) -> None:
    if agent:
        await events[agent - 1].wait()


async def _chat_agent(oa: Any, model: str, wl: AgenticWorkload, spec: SharedPrefixSpec, agent: int, mode: str,
                      events: list[asyncio.Event], tick: _Tick) -> list[SharedPrefixRecord]:
    records: list[SharedPrefixRecord] = []
    messages: list[dict[str, Any]] = _first_messages(spec, agent)
    try:
        await _wait_turn(events, agent)
        for turn in range(1, wl.turns + 1):
            t0 = time.perf_counter()
            first = 0.0
            text, calls, usage = "", {}, None  # type: ignore[var-annotated]
            try:
                stream = await oa.chat.completions.create(
                    model=model, messages=messages, tools=spec.tools, max_tokens=wl.output, temperature=0.0,
                    stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for choice in chunk.choices:
                        d = choice.delta
                        if not first and (d.content or d.tool_calls or getattr(d, "reasoning_content", None)):
                            first = time.perf_counter()
                            if turn == 1:
                                events[agent].set()
                        text += d.content or ""
                        for call in d.tool_calls or []:
                            slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                            slot["id"] = call.id or slot["id"]
                            if call.function is not None:
                                slot["name"] += call.function.name or ""
                                slot["arguments"] += call.function.arguments or ""
            except Exception as exc:  # a failed request is a figure of the report, not a crash
                records.append(SharedPrefixRecord(mode, agent, turn, 0, 0, 0, 0.0, time.perf_counter() - t0,
                                                  error=f"{type(exc).__name__}: {exc}"[:300]))
                return records
            details = getattr(usage, "prompt_tokens_details", None)
            records.append(SharedPrefixRecord(
                mode, agent, turn, getattr(usage, "prompt_tokens", 0) or 0,
                (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0,
                getattr(usage, "completion_tokens", 0) or 0, (first - t0) if first else 0.0, time.perf_counter() - t0))
            tick(1)
            assistant: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                assistant["tool_calls"] = [{"id": c["id"] or f"call_{i}", "type": "function",
                                            "function": {"name": c["name"], "arguments": c["arguments"]}}
                                           for i, c in sorted(calls.items())]  # fmt: skip
            messages.append(assistant)
            nxt = spec.user_message(agent, turn + 1)
            if calls:
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": nxt} for c in assistant["tool_calls"]]
            else:
                messages.append({"role": "user", "content": nxt})
    finally:
        events[agent].set()  # never leave the next agent waiting
    return records


async def _sessions_agent(client: Any, wl: AgenticWorkload, spec: SharedPrefixSpec, agent: int,
                          events: list[asyncio.Event], tick: _Tick) -> list[SharedPrefixRecord]:
    from phloem.api.schemas import GenerateParams

    params = GenerateParams(max_tokens=wl.output, temperature=0.0, ignore_eos=True)
    records: list[SharedPrefixRecord] = []
    try:
        await _wait_turn(events, agent)
        t0 = time.perf_counter()
        create_s = 0.0
        try:
            session = await client.sessions.create(messages=[{"role": "system", "content": spec.system}],
                                                   tools=spec.tools, metadata={"bench": "shared-prefix"})
            create_s = time.perf_counter() - t0
            for turn in range(1, wl.turns + 1):
                t0 = time.perf_counter()
                first = 0.0
                async with session.stream(messages=[{"role": "user", "content": spec.user_message(agent, turn)}],
                                          generate=params) as stream:
                    async for delta in stream:
                        if not first and delta.token_ids:
                            first = time.perf_counter()
                            if turn == 1:
                                events[agent].set()
                result = stream.result
                assert result is not None, "the stream ended without a committed turn"
                records.append(SharedPrefixRecord(
                    "sessions", agent, turn, result.usage.prompt_tokens, result.usage.cached_tokens,
                    result.usage.completion_tokens, (first - t0) if first else 0.0, time.perf_counter() - t0,
                    create_s if turn == 1 else 0.0))
                tick(1)
        except Exception as exc:
            records.append(SharedPrefixRecord("sessions", agent, len(records) + 1, 0, 0, 0, 0.0,
                                              time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:300]))
    finally:
        events[agent].set()
    return records


async def _run_mode(url: str, mode: str, wl: AgenticWorkload, spec: SharedPrefixSpec,
                    tick: _Tick) -> tuple[list[SharedPrefixRecord], dict[str, object], float]:
    events = [asyncio.Event() for _ in range(wl.agents)]
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        before = await _scrape(http)
        peak: dict[str, float] = {}
        done = asyncio.Event()
        poller = asyncio.create_task(_poll(http, peak, done))
        t0 = time.perf_counter()
        try:
            if mode == "sessions":
                from phloem.api import AsyncClient

                async with AsyncClient(url, timeout=3600, max_retries=0) as client:
                    parts = await asyncio.gather(*(_sessions_agent(client, wl, spec, a, events, tick)
                                                   for a in range(wl.agents)))  # fmt: skip
            elif mode in ("stateless", "nocache"):
                import openai

                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600) as oa:
                    parts = await asyncio.gather(*(_chat_agent(oa, model, wl, spec, a, mode, events, tick)
                                                   for a in range(wl.agents)))  # fmt: skip
            else:
                raise ValueError(f"mode: expected 'sessions', 'stateless' or 'nocache', got {mode!r}")
            wall = time.perf_counter() - t0
        finally:
            done.set()
            await poller
        after = await _scrape(http)
    records = sorted((r for part in parts for r in part), key=lambda r: (r.agent, r.turn))
    return records, _metrics_delta(before, after, peak), wall


async def _scrape(http: httpx.AsyncClient) -> dict[str, float]:
    """``/metrics`` as {sample name with labels: value}; empty when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = await http.get("/metrics")
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def _poll(http: httpx.AsyncClient, peak: dict[str, float], done: asyncio.Event) -> None:
    while not done.is_set():
        m = await _scrape(http)
        for name in ("phloem_state_slots_used", "phloem_kv_pages_used", "phloem_engine_memory_blocked",
                     'phloem_engine_requests{state=waiting}'):
            if name in m:
                peak[name] = max(peak.get(name, 0.0), m[name])
        if m.get("phloem_engine_memory_blocked"):
            peak["memory_blocked_samples"] = peak.get("memory_blocked_samples", 0.0) + 1
        peak["samples"] = peak.get("samples", 0.0) + 1
        try:
            await asyncio.wait_for(done.wait(), _SCRAPE_S)
        except TimeoutError:
            pass


def _metrics_delta(before: dict[str, float], after: dict[str, float], peak: dict[str, float]) -> dict[str, object]:
    if not after:
        return {"available": False}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    http_errors = sum(v - before.get(k, 0.0) for k, v in after.items()
                      if k.startswith("phloem_http_requests_total{") and "status=" in k
                      and int(k.split("status=")[1].split(",")[0].rstrip("}")) >= 400)  # fmt: skip
    return {
        "available": True,
        "state_slots_total": after.get("phloem_state_slots_total", 0.0),
        "state_slots_used_peak": peak.get("phloem_state_slots_used", 0.0),
        "kv_pages_total": after.get("phloem_kv_pages_total", 0.0),
        "kv_pages_used_peak": peak.get("phloem_kv_pages_used", 0.0),
        "waiting_peak": peak.get("phloem_engine_requests{state=waiting}", 0.0),
        "memory_blocked_samples": peak.get("memory_blocked_samples", 0.0),
        "samples": peak.get("samples", 0.0),
        "failed_steps": delta("phloem_engine_failed_steps_total"),
        "http_errors": http_errors,
        "checkpoints_after": after.get("phloem_prefix_checkpoints", 0.0),
        "checkpoints_evicted": delta("phloem_prefix_checkpoints_evicted_total"),
        "cancelled_generations": delta("phloem_generations_total{finish_reason=cancelled}"),
    }


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize_shared(records: list[SharedPrefixRecord], spec: SharedPrefixSpec, wall_s: float,
                     metrics: dict[str, object]) -> dict[str, object]:
    ok = [r for r in records if not r.error]
    firsts = {r.agent: r for r in ok if r.turn == 1}
    later = [r for r in ok if r.turn > 1]
    by_index: dict[str, dict[str, float]] = {}
    for name, agents in (("1st", [0]), ("2nd", [1]), ("3rd+", list(range(2, spec.agents)))):
        rs = [firsts[a] for a in agents if a in firsts]
        if not rs:
            continue
        prompt, cached = sum(r.prompt_tokens for r in rs), sum(r.cached_tokens for r in rs)
        ttfts = [r.ttft_s for r in rs]
        by_index[name] = {
            "requests": len(rs), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "min_cached_tokens": min(r.cached_tokens for r in rs),
            "shared_prefix_served": min(1.0, statistics.mean(r.cached_tokens for r in rs) / spec.shared_tokens)
            if spec.shared_tokens else 0.0,
            "ttft_p50_s": _p50(ttfts), "ttft_p99_s": _percentile(ttfts, 0.99),
            "create_p50_s": _p50([r.create_s for r in rs]),
        }  # fmt: skip
    prompt, cached = sum(r.prompt_tokens for r in ok), sum(r.cached_tokens for r in ok)
    later_ttfts = [r.ttft_s for r in later]
    return {
        "requests": len(records),
        "failed_requests": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "shared_prefix_tokens": spec.shared_tokens,
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
        "first_request_by_index": by_index,
        "hit_rate_turns_2plus": sum(r.cached_tokens for r in later) / max(1, sum(r.prompt_tokens for r in later)),
        "ttft_turns_2plus_p50_s": _p50(later_ttfts), "ttft_turns_2plus_p99_s": _percentile(later_ttfts, 0.99),
        "wall_s": wall_s,
        "metrics": metrics,
    }  # fmt: skip


def run_shared_prefix(
    wl: AgenticWorkload,
    shared_prefix: int,
    modes: tuple[str, ...] = ("sessions", "stateless"),
    base_url: str | None = None,
    server_args: tuple[str, ...] = (),
    tokenizer: Path | str | None = None,
    out_dir: str | None = None,
    show_progress: bool | None = None,
) -> tuple[str, dict[str, object]]:
    """Run the shared-prefix workload (``wl.agents``, ``wl.turns``, ``wl.append``, ``wl.output``;
    ``wl.first_turn`` unused) in each mode, a fresh server per mode unless ``base_url`` (then
    ``nocache`` is skipped, and the modes share one cache: run one mode per server to compare).

    Args:
        tokenizer: The server's tokenizer folder, to size the prompts; default: that of the model
            the server started here serves, or the built-in model's for ``base_url``.

    Returns:
        The Markdown report and the raw numbers (also ``OUT/shared_prefix.json``).
    """
    import tempfile

    from phloem.benchmarks.trie import _served_tokenizer
    from phloem.runtime.progress import progress_bar
    from phloem.sessions import Tokenizer

    with tempfile.TemporaryDirectory(prefix="phloem-bench-shared-") as scratch:
        tok = Tokenizer.from_pretrained(Path(tokenizer or _served_tokenizer(server_args, Path(scratch))))
        spec = build_spec(tok, shared_prefix, wl.agents, wl.append, wl.seed)
    summary: dict[str, object] = {}
    runs: dict[str, list[dict[str, object]]] = {}
    for mode in modes:
        if base_url is not None and mode == "nocache":
            continue
        with tempfile.TemporaryDirectory() as data_dir:
            server = None
            if base_url is None:
                server = LocalServer([*server_args, *(["--no-prefix-cache"] if mode == "nocache" else [])], data_dir)
            try:
                if server is not None:
                    server.wait()
                url = base_url or server.url  # type: ignore[union-attr]
                with progress_bar(wl.agents * wl.turns, f"shared-prefix {mode}", "request", show_progress) as tick:
                    records, metrics, wall = asyncio.run(_run_mode(url, mode, wl, spec, tick))
                summary[mode] = summarize_shared(records, spec, wall, metrics)
                if server is not None:
                    summary[mode]["server_rss_mib"] = rss_mib(server.proc.pid)  # type: ignore[index]
            finally:
                if server is not None:
                    server.stop()
        runs[mode] = [asdict(r) for r in records]
    data: dict[str, object] = {"workload": asdict(wl) | {"shared_prefix": shared_prefix},
                               "shared_prefix_tokens": spec.shared_tokens, "summary": summary, "requests": runs}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "shared_prefix.json").write_text(json.dumps(data, indent=2))
    return shared_markdown(summary, spec.shared_tokens), data


def shared_markdown(summary: dict[str, object], shared_tokens: int) -> str:
    lines = [
        f"shared prefix: {shared_tokens} tokens (system prompt + tools + user header)",
        "",
        "| mode | request | hit rate | of the shared prefix | min cached | TTFT p50 / p99 s | create p50 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        d: dict[str, Any] = dict(s)  # type: ignore[call-overload]
        for index, b in d["first_request_by_index"].items():
            create = f"{b['create_p50_s']:.3f}" if mode == "sessions" else "—"
            lines.append(f"| {mode} | {index} | {b['hit_rate']:.1%} | {b['shared_prefix_served']:.1%} "
                         f"| {b['min_cached_tokens']} | {b['ttft_p50_s']:.3f} / {b['ttft_p99_s']:.3f} | {create} |")
        lines.append(f"| {mode} | turns 2+ | {d['hit_rate_turns_2plus']:.1%} | — | — "
                     f"| {d['ttft_turns_2plus_p50_s']:.3f} / {d['ttft_turns_2plus_p99_s']:.3f} | — |")
    lines += ["", "| mode | requests | failed | HTTP errors | failed steps | peak state slots | memory-blocked "
              "samples | checkpoints (evicted) | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for mode, s in summary.items():
        d = dict(s)  # type: ignore[call-overload]
        m: dict[str, Any] = d["metrics"]
        if not m.get("available"):
            lines.append(f"| {mode} | {d['requests']} | {d['failed_requests']} | — | — | — | — | — | {d['wall_s']:.1f} |")
            continue
        lines.append(
            f"| {mode} | {d['requests']} | {d['failed_requests']} | {m['http_errors']:.0f} | {m['failed_steps']:.0f} "
            f"| {m['state_slots_used_peak']:.0f} / {m['state_slots_total']:.0f} "
            f"| {m['memory_blocked_samples']:.0f} of {m['samples']:.0f} "
            f"| {m['checkpoints_after']:.0f} ({m['checkpoints_evicted']:.0f}) | {d['wall_s']:.1f} |")
    return "\n".join(lines)

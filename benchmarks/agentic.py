"""``phloem bench agentic``: simulated agents against a running server, over real HTTP.

Each agent holds a conversation shaped like the record's workload: a long first turn, then turns
that append a tool result of ``append`` tokens, ``output`` generated tokens per turn (greedy,
``ignore_eos``), a tool wait between turns (``tool_pause_s``, or a seeded heavy-tailed draw:
``benchmarks.tool_wait``; session modes may send the SDK's ``prefetch`` hint ``prefetch_ahead_s``
before a wait ends), and optionally ``forks`` branches from turn ``fork_at`` that continue
independently. Four modes run the same workload:

- ``sessions``: the native session API (``POST /v1/sessions/{id}/append``, SSE);
- ``tiersoff``: the session client against a server started with ``--no-session-tiers``
  (idle sessions are evicted and recomputed, never spilled: what sessions buy over that);
- ``stateless``: ``/v1/completions`` resending the whole history each turn (prefix cache only);
- ``nocache``: the stateless client against a server started with the prefix cache disabled.

Per turn it records prompt tokens, cached tokens (from the server's usage), time to first token,
time per output token, wall time and a hash of the output ids (runs compare token for token);
the report gives hit rate (cached / prompt tokens) next
to its ceiling (the share of prompt tokens the client had sent before: a cache can serve nothing
else, so a cold long first turn caps it), the hit rate of those tokens, per-user decode speed (1000 / TPOT ms), TTFT by turn, and aggregate throughput;
with a fresh server per mode, or ``/metrics`` readable at ``base_url``, also the fleet figures of
``benchmarks.fleet_report`` (served-token shares by tier, resumes against recompute, tier bytes
over time). Token ids are
drawn from ``[10, vocab_hi)`` so that no special token is sent by accident.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, wait
from multiprocessing.sharedctypes import Synchronized
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from phloem.api import AsyncClient
from phloem.api.sdk import PhloemError
from phloem.api.schemas import GenerateParams
from phloem.benchmarks.local_server import LocalServer, rss_mib
from phloem.benchmarks.tool_wait import ToolWait

__all__ = ["MODE_SERVER_ARGS", "AgenticWorkload", "ModeRun", "TurnRecord", "default_client_processes", "num_turns", "run_agentic", "run_mode", "summarize"]


# Each mode, and the `phloem serve` flags of the fresh server it needs (modes with flags are
# skipped against a --base-url server).
MODE_SERVER_ARGS: dict[str, tuple[str, ...]] = {
    "sessions": (), "tiersoff": ("--no-session-tiers",), "stateless": (), "nocache": ("--no-prefix-cache",),
}


@dataclass(frozen=True, slots=True)
class AgenticWorkload:
    agents: int = 1
    first_turn: int = 50_000
    append: int = 800
    turns: int = 12
    output: int = 500
    tool_pause_s: float = 0.0
    tool_wait: ToolWait | None = None  # instead of tool_pause_s
    # Session modes: call the SDK's prefetch this long before a tool wait ends (0: never), so the
    # spilled state is loaded back while the agent still waits.
    prefetch_ahead_s: float = 0.0
    fork_at: int | None = None  # fork after this turn (1-based)
    forks: int = 0
    vocab_hi: int = 1000
    seed: int = 0
    # Client processes the agents are spread over (round-robin). One asyncio process parsing
    # ~1,000 streamed deltas a second falls behind the server and stretches the TPOT it sees;
    # real agents are separate processes too.
    client_processes: int = 1
    # Stop after this many seconds (0: never): no agent starts a turn later than that from the
    # mode's start; turns already running finish. What a fixed device call can afford: the report
    # counts the turns not started (``turns_not_started``) apart from turns lost to errors.
    duration_s: float = 0.0
    # With ``duration_s``: turns still streaming this many seconds after it ends are cancelled
    # (0: wait for every running turn), so a mode whose turns drain slowly (recomputed histories)
    # still ends inside a fixed call with a report. A cancelled turn and the rest of its branch
    # count with the turns not started (not lost: the server was still serving them), and the
    # mode's wall time ends at the cut.
    drain_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TurnRecord:
    mode: str
    agent: int
    branch: int
    turn: int
    prompt_tokens: int
    new_tokens: int  # what the client sent for the first time this turn (the rest was seen before)
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    wall_s: float
    output_hash: str = ""  # of the output token ids: runs of one workload compare token for token


@dataclass(slots=True)
class _Agent:
    agent: int
    branch: int
    history: list[int]
    rng: random.Random
    records: list[TurnRecord] = field(default_factory=list)
    not_started: int = 0  # turns skipped at the deadline


def _stops(state: _Agent, deadline: float | None, turns_left: int, after_s: float = 0.0) -> bool:
    """Whether ``state``'s branch stops here: ``deadline`` (``time.monotonic``, system-wide:
    client processes share it) is past, or will be in ``after_s`` seconds (a tool wait that would
    end past it ends the branch now). Its ``turns_left`` then count as not started."""
    if deadline is None or time.monotonic() + after_s < deadline:
        return False
    state.not_started += turns_left
    return True


def _cut_at(wl: AgenticWorkload, deadline: float | None) -> float | None:
    """When running turns are cancelled (``time.monotonic``), or None: never."""
    return deadline + wl.drain_s if deadline is not None and wl.drain_s > 0 else None


def _cut_timeout(cut: float | None) -> asyncio.Timeout:
    """``async with`` this around a turn's stream: raises ``TimeoutError`` at ``cut``."""
    return asyncio.timeout(None if cut is None else max(0.0, cut - time.monotonic()))


def _was_cut(state: _Agent, cut: float | None, turns_left: int) -> bool:
    """Whether a ``TimeoutError`` that ended a turn was the drain cut (``cut`` has passed); its
    ``turns_left`` (this one included) then count as not started. Any other ``TimeoutError`` is
    the caller's to re-raise."""
    if cut is None or time.monotonic() < cut:
        return False
    state.not_started += turns_left
    return True


def _failed(state: _Agent, turn: int, exc: Exception) -> None:
    """A turn failed (the server refused or broke it): say so on stderr and end the branch; its
    turns from this one on count as lost (``lost_turns``), the other agents go on."""
    print(f"agent {state.agent} branch {state.branch} turn {turn} failed: {exc}", file=sys.stderr)


def _tokens(rng: random.Random, n: int, hi: int) -> list[int]:
    return [rng.randrange(10, hi) for _ in range(n)]


def _waits(wl: AgenticWorkload, agent: int, branch: int) -> Callable[[], float]:
    """The tool waits of one agent's branch, in seconds (seeded apart from its tokens)."""
    wait = wl.tool_wait
    if wait is None:
        return lambda: wl.tool_pause_s
    rng = wait.rng(wl.seed, agent, branch)
    return lambda: wait.draw(rng)


def _hash(ids: list[int]) -> str:
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16]


def _timing(t0: float, stamps: list[float]) -> tuple[float, float]:
    ttft = stamps[0] - t0 if stamps else 0.0
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return ttft, tpot


_Tick = Callable[[int], None]


def _ignore(n: int) -> None:
    del n


def num_turns(wl: AgenticWorkload) -> int:
    """Turns one mode of ``wl`` runs (every agent, every branch after a fork)."""
    fork_at = wl.fork_at if wl.forks and wl.fork_at else wl.turns
    return wl.agents * (fork_at + wl.forks * (wl.turns - fork_at))


async def _sessions_agent(client: AsyncClient, wl: AgenticWorkload, agent: int, tick: _Tick = _ignore,
                          mode: str = "sessions", deadline: float | None = None) -> tuple[list[TurnRecord], int]:
    rng = random.Random(wl.seed * 1000 + agent)
    params = GenerateParams(max_tokens=wl.output, temperature=0.0, ignore_eos=True)
    session = await client.sessions.create(metadata={"bench": "agentic", "agent": str(agent)})
    root = _Agent(agent, 0, [], rng)
    cut = _cut_at(wl, deadline)
    records: list[TurnRecord] = []
    branches = [root]

    async def run_turns(handle: object, state: _Agent, first: int, last: int) -> None:
        waits = _waits(wl, state.agent, state.branch)
        for turn in range(first, last + 1):
            if _stops(state, deadline, last - turn + 1):
                return
            new = _tokens(state.rng, wl.first_turn if turn == 1 else wl.append, wl.vocab_hi)
            t0 = time.perf_counter()
            stamps: list[float] = []
            output: list[int] = []
            try:
                async with _cut_timeout(cut), handle.stream(input_ids=new, generate=params) as stream:  # type: ignore[attr-defined]
                    async for delta in stream:
                        stamps.extend([time.perf_counter()] * len(delta.token_ids))
                        output += delta.token_ids
            except TimeoutError:
                if not _was_cut(state, cut, last - turn + 1):
                    raise
                return
            except PhloemError as exc:
                _failed(state, turn, exc)
                return
            result = stream.result
            assert result is not None, "the stream ended without a committed turn"
            ttft, tpot = _timing(t0, stamps)
            records.append(
                TurnRecord(
                    mode, state.agent, state.branch, turn, result.usage.prompt_tokens, len(new),
                    result.usage.cached_tokens, result.usage.completion_tokens, ttft, tpot, time.perf_counter() - t0,
                    _hash(output),
                )
            )  # fmt: skip
            tick(1)
            if turn < last and (wait_s := waits()) > 0:
                if _stops(state, deadline, last - turn, wait_s):
                    return
                ahead = min(wl.prefetch_ahead_s, wait_s)
                await asyncio.sleep(wait_s - ahead)
                if ahead > 0:
                    await handle.prefetch()  # type: ignore[attr-defined]
                    await asyncio.sleep(ahead)

    fork_at = wl.fork_at if wl.forks and wl.fork_at else wl.turns
    await run_turns(session, root, 1, fork_at)
    if fork_at < wl.turns:
        children = await session.fork(n=wl.forks)
        branches += [_Agent(agent, i + 1, [], random.Random(rng.random())) for i in range(wl.forks)]
        await asyncio.gather(*(run_turns(c, b, fork_at + 1, wl.turns) for c, b in zip(children, branches[1:])))
    return records, sum(b.not_started for b in branches)


async def _stateless_agent(http: httpx.AsyncClient, wl: AgenticWorkload, agent: int, mode: str, model: str,
                           tick: _Tick = _ignore, deadline: float | None = None) -> tuple[list[TurnRecord], int]:
    rng = random.Random(wl.seed * 1000 + agent)
    records: list[TurnRecord] = []
    cut = _cut_at(wl, deadline)

    async def run_turns(state: _Agent, first: int, last: int) -> None:
        waits = _waits(wl, state.agent, state.branch)
        for turn in range(first, last + 1):
            if _stops(state, deadline, last - turn + 1):
                return
            new = _tokens(state.rng, wl.first_turn if turn == 1 else wl.append, wl.vocab_hi)
            state.history += new
            body = {
                "model": model, "prompt": state.history, "max_tokens": wl.output, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            }  # fmt: skip
            t0 = time.perf_counter()
            stamps: list[float] = []
            usage: dict[str, object] = {}
            output: list[int] = []
            try:
                async with _cut_timeout(cut), http.stream("POST", "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise httpx.HTTPError(str(chunk["error"]))
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for choice in chunk.get("choices") or []:
                            ids = choice.get("token_ids") or []
                            output += ids
                            stamps.extend([time.perf_counter()] * len(ids))
            except TimeoutError:
                if not _was_cut(state, cut, last - turn + 1):
                    raise
                return
            except httpx.HTTPError as exc:
                _failed(state, turn, exc)
                return
            ttft, tpot = _timing(t0, stamps)
            details = usage.get("prompt_tokens_details") or {}
            records.append(
                TurnRecord(
                    mode, state.agent, state.branch, turn, int(usage.get("prompt_tokens", 0)), len(new),  # type: ignore[arg-type]
                    int(details.get("cached_tokens", 0)), int(usage.get("completion_tokens", 0)),  # type: ignore[union-attr, arg-type]
                    ttft, tpot, time.perf_counter() - t0, _hash(output),
                )
            )  # fmt: skip
            tick(1)
            state.history += output
            if turn < last and (wait_s := waits()) > 0:
                if _stops(state, deadline, last - turn, wait_s):
                    return
                await asyncio.sleep(wait_s)

    branches = [_Agent(agent, 0, [], rng)]
    fork_at = wl.fork_at if wl.forks and wl.fork_at else wl.turns
    await run_turns(branches[0], 1, fork_at)
    if fork_at < wl.turns:
        root = branches[0]
        branches += [_Agent(agent, i + 1, list(root.history), random.Random(rng.random())) for i in range(wl.forks)]
        await asyncio.gather(*(run_turns(b, fork_at + 1, wl.turns) for b in branches[1:]))
    return records, sum(b.not_started for b in branches)


@dataclass(frozen=True, slots=True)
class ModeRun:
    """One mode's turns, its wall time, and the turns no agent started before ``wl.duration_s``."""

    records: list[TurnRecord]
    wall_s: float
    not_started: int = 0


async def run_mode(base_url: str, mode: str, wl: AgenticWorkload, tick: _Tick = _ignore) -> ModeRun:
    """Run every agent of ``wl`` concurrently in ``mode``. ``tick(1)`` is called after every
    turn (a progress bar's ``advance``). With ``wl.client_processes`` > 1 the agents run in that
    many processes (``_run_spread``)."""
    deadline = time.monotonic() + wl.duration_s if wl.duration_s > 0 else None
    if wl.client_processes > 1:
        return await asyncio.to_thread(_run_spread, base_url, mode, wl, tick, deadline)
    t0 = time.perf_counter()
    records, not_started = await _run_agents(base_url, mode, wl, range(wl.agents), tick, deadline)
    return ModeRun(records, time.perf_counter() - t0, not_started)


async def _run_agents(base_url: str, mode: str, wl: AgenticWorkload, agents: Iterable[int],
                      tick: _Tick, deadline: float | None) -> tuple[list[TurnRecord], int]:
    if mode in ("sessions", "tiersoff"):
        async with AsyncClient(base_url, timeout=3600, max_retries=0) as client:
            results = await asyncio.gather(*(_sessions_agent(client, wl, a, tick, mode, deadline) for a in agents))
    elif mode in ("stateless", "nocache"):
        async with httpx.AsyncClient(base_url=base_url, timeout=3600) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            results = await asyncio.gather(
                *(_stateless_agent(http, wl, a, mode, model, tick, deadline) for a in agents)
            )
    else:
        raise ValueError(f"mode: expected one of {', '.join(MODE_SERVER_ARGS)}, got {mode!r}")
    return [r for records, _ in results for r in records], sum(n for _, n in results)


_turns_done: Synchronized[int] | None = None  # a client process's shared turn counter


def _init_client_process(counter: Synchronized[int]) -> None:
    global _turns_done
    _turns_done = counter


def _count_turn(n: int) -> None:
    assert _turns_done is not None
    with _turns_done.get_lock():
        _turns_done.value += n


def _client_process(base_url: str, mode: str, wl: AgenticWorkload, agents: list[int],
                    deadline: float | None) -> tuple[list[TurnRecord], int, float, float]:
    start = time.monotonic()
    records, not_started = asyncio.run(_run_agents(base_url, mode, wl, agents, _count_turn, deadline))
    return records, not_started, start, time.monotonic()


def _run_spread(base_url: str, mode: str, wl: AgenticWorkload, tick: _Tick, deadline: float | None) -> ModeRun:
    """The agents round-robin over ``wl.client_processes`` spawned processes; the wall time runs
    from the first process's start to the last one's end (``time.monotonic`` is system-wide)."""
    procs = min(wl.client_processes, wl.agents)
    context = multiprocessing.get_context("spawn")
    counter = context.Value("q", 0)
    with ProcessPoolExecutor(procs, mp_context=context, initializer=_init_client_process,
                             initargs=(counter,)) as pool:
        futures = [pool.submit(_client_process, base_url, mode, wl, list(range(p, wl.agents, procs)), deadline)
                   for p in range(procs)]
        reported = 0
        while not all(f.done() for f in futures):
            wait(futures, timeout=0.25)
            done = counter.value
            tick(done - reported)
            reported = done
        parts = [f.result() for f in futures]
    tick(counter.value - reported)
    records = sorted((r for part in parts for r in part[0]), key=lambda r: (r.agent, r.branch, r.turn))
    return ModeRun(records, max(p[3] for p in parts) - min(p[2] for p in parts), sum(p[1] for p in parts))


def summarize(records: list[TurnRecord], wall_s: float, num_gpus: int = 1) -> dict[str, object]:
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens for r in records)
    completion = sum(r.completion_tokens for r in records)
    tpots = [r.tpot_s for r in records if r.tpot_s > 0]
    later = [r for r in records if r.turn > 1]
    later_tpots = [r.tpot_s for r in later if r.tpot_s > 0]
    seen = sum(r.prompt_tokens - r.new_tokens for r in records)
    return {
        "turns": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        # The best any cache can do on this workload: every token sent before is a hit, no new one.
        "hit_rate_ceiling": seen / prompt if prompt else 0.0,
        "hit_rate_of_seen": cached / seen if seen else 0.0,
        "hit_rate_turns_2plus": sum(r.cached_tokens for r in later) / max(1, sum(r.prompt_tokens for r in later)),
        "per_user_decode_tok_s": 1.0 / statistics.median(tpots) if tpots else 0.0,
        # Turns 2+ decode beside the other agents' tool results only (turn 1 beside their long
        # first turns): the figure to hold against `bench decode` at the same batch and context.
        "per_user_decode_tok_s_turns_2plus": 1.0 / statistics.median(later_tpots) if later_tpots else 0.0,
        "ttft_turn1_s": statistics.median([r.ttft_s for r in records if r.turn == 1] or [0.0]),
        "ttft_turns_2plus_s": statistics.median([r.ttft_s for r in later] or [0.0]),
        "ttft_turns_2plus_p99_s": _percentile([r.ttft_s for r in later], 0.99),
        "output_tok_s": completion / wall_s if wall_s else 0.0,
        "output_tok_s_per_gpu": completion / wall_s / num_gpus if wall_s else 0.0,
        "wall_s": wall_s,
    }


def _percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 when empty): the smallest value with at least a ``q``
    share of the values at or below it."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def records_json(records: list[TurnRecord]) -> list[dict[str, object]]:
    return [asdict(r) for r in records]


def run_agentic(
    wl: AgenticWorkload,
    modes: tuple[str, ...] = ("sessions", "stateless", "nocache"),
    base_url: str | None = None,
    server_args: tuple[str, ...] = (),
    out_dir: str | None = None,
    num_gpus: int = 1,
    show_progress: bool | None = None,
) -> tuple[str, dict[str, object]]:
    """Run ``wl`` in each mode (a fresh server per mode unless ``base_url``); returns Markdown + raw data.

    ``nocache`` and ``tiersoff`` need a server started with their flags (``MODE_SERVER_ARGS``):
    with ``base_url`` they are skipped. Each
    mode's turns are counted by a progress bar (``show_progress``: False never, None when stderr
    is a terminal; ``runtime.progress``).
    """
    import tempfile

    from phloem.benchmarks.fleet_report import fleet_markdown, plot_tiers
    from phloem.benchmarks.plots import plot_agentic

    runs: dict[str, list[TurnRecord]] = {}
    summary: dict[str, object] = {}
    for mode in modes:
        if mode not in MODE_SERVER_ARGS:
            raise ValueError(f"mode: expected one of {', '.join(MODE_SERVER_ARGS)}, got {mode!r}")
        if base_url is not None:
            if MODE_SERVER_ARGS[mode]:
                continue
            records, summary[mode] = _measure(base_url, mode, wl, num_gpus, show_progress)
        else:
            with tempfile.TemporaryDirectory() as data_dir:
                server = LocalServer([*server_args, *MODE_SERVER_ARGS[mode]], data_dir)
                try:
                    server.wait()
                    records, summary[mode] = _measure(server.url, mode, wl, num_gpus, show_progress)
                    summary[mode]["server_rss_mib"] = rss_mib(server.proc.pid)  # type: ignore[index]
                    # Saved before the server stops and its data directory (GBs of segment files
                    # after a fleet run) is deleted: a timeout then no longer loses the mode.
                    _save(out_dir, wl, summary, {**runs, mode: records})
                finally:
                    try:
                        server.stop()
                    finally:
                        _keep_server_log(server.log.name, out_dir, mode)
        runs[mode] = records
    data = _save(out_dir, wl, summary, runs)
    if out_dir is not None:
        out = Path(out_dir)
        series = {m: s["fleet"]["tier_bytes"] for m, s in summary.items() if "fleet" in s}  # type: ignore[index, operator]
        data["plots"] = [str(p) for p in [*plot_agentic(runs, out), *plot_tiers(series, out)]]
    return _markdown(summary) + "\n\n" + fleet_markdown(summary), data  # type: ignore[arg-type]


def _keep_server_log(path: str, out_dir: str | None, mode: str) -> None:
    """Copy a mode's server log (one line per request with its first-token and prepare times,
    one per session transition: docs/api.md, "Observability") to ``out_dir/server-MODE.log``
    before its data directory is deleted."""
    if out_dir is not None and os.path.exists(path):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(out_dir) / f"server-{mode}.log")


def _save(out_dir: str | None, wl: AgenticWorkload, summary: dict[str, object],
          runs: dict[str, list[TurnRecord]]) -> dict[str, object]:
    """The raw data of the modes run so far, written to ``out_dir/agentic.json`` when given."""
    data: dict[str, object] = {"workload": asdict(wl), "summary": summary, "turns": {m: records_json(r) for m, r in runs.items()}}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "agentic.json").write_text(json.dumps(data, indent=2))
    return data


def _measure(url: str, mode: str, wl: AgenticWorkload, num_gpus: int,
             show_progress: bool | None) -> tuple[list[TurnRecord], dict[str, object]]:
    """One mode's run against ``url``, with ``/metrics`` sampled around and during it."""
    from phloem.benchmarks.fleet_report import TierSampler, fleet_summary
    from phloem.runtime.progress import progress_bar

    with TierSampler(url) as sampler, progress_bar(num_turns(wl), f"agentic {mode}", "turn", show_progress) as tick:
        run = asyncio.run(run_mode(url, mode, wl, tick))
    result = summarize(run.records, run.wall_s, num_gpus)
    result["turns_not_started"] = run.not_started
    if sampler.before:
        result["fleet"] = fleet_summary(run.records, sampler, num_turns(wl) - run.not_started)
    return run.records, result


def _markdown(summary: dict[str, object]) -> str:
    lines = [
        "| mode | turns | prompt tokens | cached | hit rate (ceiling) | of tokens seen before | hit rate turns 2+ | per-user decode tok/s (turns 2+) | TTFT turn 1 s | TTFT turns 2+ p50 / p99 s | output tok/s | server RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, s in summary.items():
        d = dict(s)  # type: ignore[call-overload]
        lines.append(
            f"| {mode} | {d['turns']}{_not_started(d)} | {d['prompt_tokens']} | {d['cached_tokens']} | {d['hit_rate']:.1%} "
            f"({d['hit_rate_ceiling']:.1%}) | {d['hit_rate_of_seen']:.1%} | {d['hit_rate_turns_2plus']:.1%} | {d['per_user_decode_tok_s']:.1f} "
            f"({d['per_user_decode_tok_s_turns_2plus']:.1f}) | {d['ttft_turn1_s']:.3f} "
            f"| {d['ttft_turns_2plus_s']:.3f} / {d['ttft_turns_2plus_p99_s']:.3f} | {d['output_tok_s']:.1f} | {d.get('server_rss_mib', float('nan')):.0f} |"
        )
    return "\n".join(lines)


def _not_started(summary: dict[str, object]) -> str:
    n = summary.get("turns_not_started", 0)
    return f" (+{n} not started or cut: duration)" if n else ""


def default_client_processes(agents: int) -> int:
    """One client process per two CPUs of this machine, at most 8 and at most ``agents``."""
    import os

    return max(1, min(agents, 8, (os.cpu_count() or 2) // 2))

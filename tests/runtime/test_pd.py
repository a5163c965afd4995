"""Prefill/decode disaggregation over gloo: a prefill process and a decode client (this process).

Every answer is compared token for token with one colocated engine that gets the same calls:
fresh prompts, multi-turn conversations (later turns on the side holding the prefix, or all sent
to the prefill process), forks, seeded sampling, first tokens that end the request, and sessions
through ``SessionManager``. Failures: a prefill peer that dies mid-transfer (scripted: this file,
run as a script, plays it, so the kill lands at a known point), a decode peer that dies while its
prompt is being computed, the real prefill process killed, and a layout mismatch. After each, no
page or slot is leaked on the survivor: its free counts return to their start values once its
prefix cache is emptied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch

from phloem.engine import (
    CacheConfig, Engine, EngineConfig, EngineError, ParallelConfig, RequestOutput, SamplingParams, SchedulerConfig,
)
from phloem.engine.transfer.protocol import GDNState, Hello, KVLayer, PrefillProgress, PrefillRequest
from phloem.engine.transfer.dist_transport import PrefillListener, connect
from phloem.runtime.engine_client import EngineClient
from phloem.runtime.pd.decode import PDEngineClient
from phloem.runtime.pd.link import exchange_hello, hello_for
from phloem.runtime.pd.prefill import PrefillWorker, declines, run_prefill_worker
from phloem.runtime.pd.roles import PDConfig
from pd_links import serving

ARCH = "Qwen3_5MoeForCausalLM"
# 8 layers: two full-attention layers, so KV streams as two messages. A 32-token budget chunks
# every longer prefill (a heartbeat per chunk); no periodic checkpoints (turn ends only).
CONFIG = EngineConfig(
    cache=CacheConfig(num_pages=128, num_state_slots=24, page_size=16, checkpoint_interval=0),
    scheduler=SchedulerConfig(max_num_batched_tokens=32),
)
GREEDY = SamplingParams(max_tokens=6)


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 256 for i in range(n)]


def spawn_prefill(model: Path, config: EngineConfig = CONFIG) -> tuple[multiprocessing.Process, int]:
    """A real prefill instance in a spawned process; returns it and the port it listens on."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    pd = PDConfig(role="prefill", peer="127.0.0.1:0", connect_timeout_s=10)
    args = (str(model), config, pd, theirs)
    proc = ctx.Process(target=run_prefill_worker, args=args, name="phloem-prefill-test", daemon=True)
    proc.start()
    theirs.close()
    assert ours.poll(120), "the prefill process did not start"
    kind, value = ours.recv()
    assert kind == "ready", value
    return proc, int(value)


def stop(proc: multiprocessing.Process) -> None:
    proc.kill()
    proc.join(10)


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Callable[..., Path]) -> Path:
    return tiny_checkpoint(ARCH, num_layers=8)


@pytest.fixture(scope="module")
def prefill_port(model: Path) -> Iterator[int]:
    proc, port = spawn_prefill(model)
    yield port
    stop(proc)


def decode_client(model: Path, port: int, **pd: object) -> PDEngineClient:
    settings: dict[str, object] = {"timeout_s": 20, "connect_timeout_s": 5, "reconnect_interval_s": 60, **pd}
    config = PDConfig(role="decode", peer=f"127.0.0.1:{port}", **settings)  # type: ignore[arg-type]
    return PDEngineClient(Engine.from_pretrained(model, CONFIG), config)


@asynccontextmanager
async def pair(model: Path, port: int, **pd: object) -> AsyncIterator[tuple[EngineClient, PDEngineClient]]:
    """(colocated reference, decode client); the decode side's pools are checked for leaks after."""
    async with EngineClient(Engine.from_pretrained(model, CONFIG)) as ref:
        async with decode_client(model, port, **pd) as client:
            yield ref, client
            await assert_no_leak(client)


async def assert_no_leak(client: EngineClient) -> None:
    await client.cached_prefix_len([0])  # answered once pending turn-end checkpoints landed
    await client.reset_prefix_cache()
    stats = await client.stats()
    assert (stats.num_free_pages, stats.num_free_slots) == (stats.num_pages, stats.num_slots)


async def collect(client: EngineClient, prompt: list[int], params: SamplingParams = GREEDY) -> RequestOutput:
    items = [out async for out in client.generate(prompt, params)]
    assert [t for out in items for t in out.new_token_ids] == items[-1].token_ids
    assert items[-1].finished and not any(out.finished for out in items[:-1])
    return items[-1]


async def both(ref: EngineClient, client: EngineClient, prompt: list[int],
               params: SamplingParams = GREEDY) -> RequestOutput:
    expected, got = await collect(ref, prompt, params), await collect(client, prompt, params)
    assert (got.token_ids, got.finish_reason) == (expected.token_ids, expected.finish_reason)
    return got


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
def test_fresh_requests_equal_one_process(model: Path, prefill_port: int) -> None:
    async def main() -> None:
        async with pair(model, prefill_port) as (ref, client):
            for n in (1, 7, 16, 17, 45, 70):
                await both(ref, client, tokens(n, 40 + n))
            prompts = [tokens(n, 60 + n) for n in (5, 33, 50)]
            expected = await asyncio.gather(*(collect(ref, p) for p in prompts))
            got = await asyncio.gather(*(collect(client, p) for p in prompts))
            assert [o.token_ids for o in got] == [o.token_ids for o in expected]
            seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=7)
            for n in (9, 21):
                await both(ref, client, tokens(n, 3 + n), seeded)
            # A first token that ends the request: as a stop token, and as max_tokens=1.
            prompt = tokens(19, 5)
            first = (await collect(ref, prompt, GREEDY)).token_ids[0]
            await both(ref, client, prompt, SamplingParams(max_tokens=6, stop_token_ids=(first,)))
            await both(ref, client, tokens(23, 6), SamplingParams(max_tokens=1))
            assert (client.num_remote, client.num_local, client.num_failed) == (13, 0, 0)

    asyncio.run(main())


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
def test_requests_with_processed_logits_prefill_on_the_decode_side(model: Path, prefill_port: int) -> None:
    """The prefill instance samples plain tokens only: penalties, a bias and logprobs stay local."""
    async def main() -> None:
        async with pair(model, prefill_port) as (ref, client):
            for params in (SamplingParams(max_tokens=6, presence_penalty=1.5, frequency_penalty=1.0),
                           SamplingParams(max_tokens=6, logit_bias=((3, 5.0),)),
                           SamplingParams(max_tokens=6, logprobs=2)):
                await both(ref, client, tokens(30, 11), params)
            assert (client.num_remote, client.num_local) == (0, 0)  # never asked the prefill side

    asyncio.run(main())


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
@pytest.mark.parametrize("local", [0, 16], ids=["all-remote", "later-turns-local"])
def test_multi_turn_and_forks_equal_one_process(model: Path, prefill_port: int, local: int) -> None:
    async def main() -> None:
        async with pair(model, prefill_port, local_prefill_tokens=local) as (ref, client):
            history, previous = tokens(37, 1 + local), 0
            for turn in range(3):
                out = await both(ref, client, history, SamplingParams(max_tokens=5))
                if turn and local:
                    # The decode side held the conversation and computed only the 3 new tokens.
                    assert out.num_cached_tokens == len(history) - 3
                elif turn:
                    # The prefill side resumed from its checkpoint at the previous prompt's end.
                    assert out.num_cached_tokens == previous
                previous = len(history)
                history = history + out.token_ids + tokens(3, 10 + turn)
            conv = history[:-3]
            assert len(conv) % 16, "the fork point must be mid-page to exercise the tail-page copy"
            branches = [conv + tokens(2, 20), conv + tokens(5, 21)]
            expected = await asyncio.gather(*(collect(ref, b) for b in branches))
            got = await asyncio.gather(*(collect(client, b) for b in branches))
            assert [o.token_ids for o in got] == [o.token_ids for o in expected]
            assert (client.num_remote, client.num_local) == ((1, 4) if local else (5, 0))

    asyncio.run(main())


def test_declines_only_when_the_decode_side_is_the_cheaper_side() -> None:
    # Later turn of a conversation both sides followed: waste = last outputs, local = those + new.
    assert not declines(num_tokens=51_056, held_len=50_256, num_cached=50_000)
    # The prefill side lost it (the fifth session's turn 2 on two H200s): 46K wasted vs 800 local.
    assert declines(num_tokens=51_056, held_len=50_256, num_cached=4_096)
    assert not declines(num_tokens=100, held_len=0, num_cached=0)  # nothing held: nothing to waste
    assert not declines(num_tokens=100, held_len=50, num_cached=0)  # 50 wasted vs 50 local: a tie


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
@pytest.mark.parametrize("local", [0, 4], ids=["never-local", "local-allowed"])
def test_a_prefill_side_that_lost_the_conversation_declines_it(model: Path, local: int) -> None:
    """The prefill side's cache is emptied between turns (as after an eviction, a restart or a
    failed transfer retried locally): the next turn is declined and prefilled on the decode side,
    which holds it, unless the decode side never prefills (``local_prefill_tokens=0``); tokens
    equal a colocated run either way and nothing leaks on either side."""
    worker = PrefillWorker(Engine.from_pretrained(model, CONFIG), PDConfig(role="prefill", peer="127.0.0.1:0"))
    with serving(worker) as listener:

        async def main() -> None:
            async with pair(model, listener.port, local_prefill_tokens=local) as (ref, client):
                history = tokens(60, 3)
                out = await both(ref, client, history)  # remote: the decode side holds nothing
                history = history + out.token_ids + tokens(9, 4)
                await client.cached_prefix_len([0])  # the turn-end checkpoint has landed
                held = await client.cached_prefix_len(history)
                assert held == len(history) - 9  # the turn-end checkpoint: prompt + every output token
                worker.engine.cache.tree.clear()  # the link is idle: the worker thread waits in recv
                out = await both(ref, client, history)
                if local:
                    assert (client.num_declined, worker.num_declined, client.num_remote) == (1, 1, 1)
                    assert out.num_cached_tokens == held  # the decode side's own cache
                else:
                    assert (client.num_declined, worker.num_declined, client.num_remote) == (0, 0, 2)
                    assert out.num_cached_tokens == 0  # the prefill side recomputed it all
                assert client.num_failed == 0

        asyncio.run(main())
    engine = worker.engine
    assert not engine.has_unfinished_requests()
    engine.cache.tree.clear()
    assert (engine.page_pool.num_free_pages, engine.slot_pool.num_free_slots) == (
        engine.page_pool.num_pages, engine.slot_pool.num_slots)


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_tensor_parallel_on_either_side_equals_one_process(model: Path, side: str) -> None:
    """TP=2 on the prefill side (its KV gathered from both ranks and sent once the prompt is
    computed) or on the decode side (the TP=1-layout state installed into both ranks' parts):
    fresh prompts and a conversation's later turns equal a colocated TP=1 engine, nothing leaks."""
    tp2 = dataclasses.replace(CONFIG, parallel=ParallelConfig(tensor_parallel_size=2))
    check_pd_equals_one_process(model, tp2 if side == "prefill" else CONFIG, tp2 if side == "decode" else CONFIG)


@pytest.mark.slow  # a prefill-decode pair of tensor-parallel engines
@pytest.mark.parametrize("sizes", [(4, 2), (2, 4)], ids=["prefill-tp4-decode-tp2", "prefill-tp2-decode-tp4"])
def test_tensor_parallel_on_both_sides_of_other_sizes_equals_one_process(
    tiny_checkpoint: Callable[..., Path], sizes: tuple[int, int]
) -> None:
    """Both sides tensor-parallel, at different sizes (the wide model: 4 KV heads split at TP=4,
    two a rank at TP=2): the state crosses in the TP=1 layout, gathered from one group's ranks and
    scattered to the other's."""
    model = tiny_checkpoint(ARCH, num_layers=8, wide=True)
    prefill, decode = (dataclasses.replace(CONFIG, parallel=ParallelConfig(tensor_parallel_size=n)) for n in sizes)
    check_pd_equals_one_process(model, prefill, decode)


def check_pd_equals_one_process(model: Path, prefill_config: EngineConfig, decode_config: EngineConfig) -> None:
    """A prefill worker on ``prefill_config`` in this process and a decode client on ``decode_config``
    against a colocated TP=1 engine: fresh prompts (one chunked) and two turns of a conversation
    (the later one hitting the prefill side's checkpoint) give its tokens; no page or slot leaks
    on either side."""
    prefill_engine = Engine.from_pretrained(model, prefill_config)
    worker = PrefillWorker(prefill_engine, PDConfig(role="prefill", peer="127.0.0.1:0"))
    try:
        with serving(worker) as listener:

            async def main() -> None:
                async with EngineClient(Engine.from_pretrained(model, CONFIG)) as ref:
                    config = PDConfig(role="decode", peer=f"127.0.0.1:{listener.port}", timeout_s=20,
                                      connect_timeout_s=5, local_prefill_tokens=0)  # fmt: skip
                    async with PDEngineClient(Engine.from_pretrained(model, decode_config), config) as client:
                        for n in (7, 45):
                            await both(ref, client, tokens(n, 70 + n))
                        history, previous = tokens(37, 2), 0
                        for turn in range(2):
                            out = await both(ref, client, history, SamplingParams(max_tokens=5))
                            assert out.num_cached_tokens == previous  # the prefill side's checkpoint
                            previous = len(history)
                            history = history + out.token_ids + tokens(3, 30 + turn)
                        assert (client.num_remote, client.num_failed) == (4, 0)
                        await assert_no_leak(client)

            asyncio.run(main())
        assert worker.num_served == 4 and not prefill_engine.has_unfinished_requests()
        prefill_engine.cache.tree.clear()
        assert (prefill_engine.page_pool.num_free_pages, prefill_engine.slot_pool.num_free_slots) == (
            prefill_engine.page_pool.num_pages, prefill_engine.slot_pool.num_slots)
    finally:
        prefill_engine.close()


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
def test_a_consumer_leaving_or_aborting_mid_transfer_releases_everything(model: Path, prefill_port: int) -> None:
    async def main() -> None:
        async with pair(model, prefill_port) as (ref, client):
            long_prompt = tokens(300, 77)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(collect(client, long_prompt), 0.02)
            # An abort while the prompt is (most likely still) being computed remotely.
            items: list[RequestOutput] = []

            async def consume() -> None:
                items.extend([out async for out in client.generate(tokens(600, 78), GREEDY, "victim")])

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)
            assert await client.abort("victim")
            await task
            assert items[-1].finished and items[-1].finish_reason == "abort"
            # The link finished those transfers in the background and serves the next one.
            await both(ref, client, long_prompt)

    asyncio.run(main())


def run_script(*args: str) -> subprocess.Popen[str]:
    """This file as a script: a scripted peer that dies at a known point (see the bottom).
    It imports what pytest's ``pythonpath`` gives the tests (``tests/support``)."""
    support = str(Path(__file__).parents[1] / "support")
    path = os.pathsep.join(p for p in (support, os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": path})


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
@pytest.mark.parametrize("retry_local", [False, True], ids=["fails-cleanly", "retried-locally"])
def test_prefill_peer_dying_mid_transfer(model: Path, retry_local: bool) -> None:
    phase = "before-done" if retry_local else "mid-kv"
    peer = run_script("faulty-prefill", phase)
    assert peer.stdout is not None
    port = int(peer.stdout.readline())

    async def main() -> None:
        async with pair(model, port, retry_local=retry_local) as (ref, client):
            start = await client.stats()
            prompt = tokens(40, 8)
            if retry_local:
                await both(ref, client, prompt)
            else:
                with pytest.raises(EngineError, match=r"disaggregated prefill failed: link to prefill .* failed"):
                    await collect(client, prompt)
                stats = await client.stats()
                assert (stats.num_free_pages, stats.num_free_slots) == (start.num_free_pages, start.num_free_slots)
            assert (client.num_remote, client.num_failed) == (0, 1)

    try:
        asyncio.run(main())
    finally:
        peer.kill()
        peer.stdout.close()
        assert peer.wait(10) != 0


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
def test_decode_peer_dying_mid_prefill_leaves_the_prefill_side_clean(model: Path) -> None:
    worker = PrefillWorker(Engine.from_pretrained(model, CONFIG), PDConfig(role="prefill", peer="127.0.0.1:0"))
    with serving(worker) as listener:
        peer = run_script("faulty-decode", str(model), str(listener.port))
        assert peer.wait(60) == 1
        assert peer.stdout is not None
        peer.stdout.close()
        deadline = time.monotonic() + 20
        while worker.num_dropped < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (worker.num_links, worker.num_dropped, worker.num_served) == (1, 1, 0)
        engine = worker.engine
        assert not engine.has_unfinished_requests()
        engine.cache.tree.clear()  # nothing is locked: every page and slot comes back
        assert (engine.page_pool.num_free_pages, engine.slot_pool.num_free_slots) == (
            engine.page_pool.num_pages, engine.slot_pool.num_slots)

        async def main() -> None:
            async with pair(model, listener.port) as (ref, client):
                await both(ref, client, tokens(400, 9))
                assert client.num_remote == 1

        asyncio.run(main())
        assert worker.num_served == 1


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
def test_prefill_process_killed_then_requests_run_on_the_decode_side(model: Path) -> None:
    proc, port = spawn_prefill(model)

    async def main() -> None:
        async with pair(model, port, connect_timeout_s=1) as (ref, client):
            await both(ref, client, tokens(30, 1))
            stop(proc)
            # Broken link; then unreachable; then inside the retry interval. Unrelated prompts: a
            # prompt extending an earlier one would hit its prompt-end checkpoint and be prefilled
            # on the decode side without trying the link.
            for seed, n in ((2, 31), (3, 32), (4, 33)):
                await both(ref, client, tokens(n, seed))
            assert (client.num_remote, client.num_failed) == (1, 3)

    try:
        asyncio.run(main())
    finally:
        stop(proc)


def test_a_layout_mismatch_is_refused_with_a_clear_error(model: Path) -> None:
    worker = PrefillWorker(Engine.from_pretrained(model, CONFIG), PDConfig(role="prefill", peer="127.0.0.1:0"))

    async def main(port: int) -> None:
        config = PDConfig(role="decode", peer=f"127.0.0.1:{port}", retry_local=False)
        other = Engine.from_pretrained(model, dataclasses.replace(CONFIG, cache=dataclasses.replace(CONFIG.cache, page_size=32)))
        async with PDEngineClient(other, config) as client:
            with pytest.raises(EngineError, match="do not serve the same model layout"):
                await collect(client, tokens(20, 1))

    with serving(worker) as listener:
        asyncio.run(main(listener.port))


def _faulty_prefill(phase: str) -> None:
    """A prefill peer that links, takes a request, sends part of the answer and dies."""
    listener = PrefillListener("127.0.0.1", 0, connect_timeout_s=30)
    print(listener.port, flush=True)
    link = listener.accept()
    assert link is not None
    hello = link.recv(30)
    assert isinstance(hello, Hello)
    link.send(dataclasses.replace(hello, role="prefill"), 30)
    req = link.recv(None)
    assert isinstance(req, PrefillRequest)
    ps = hello.page_size
    link.send(PrefillProgress(req.xfer_id, 0, req.token_ids.numel()), 30)
    pages = -(-req.token_ids.numel() // ps) - req.held_len // ps
    kv = torch.zeros(pages, *hello.kv_shape[1:])
    for layer in range(1 if phase == "mid-kv" else hello.kv_shape[0]):
        link.send(KVLayer(req.xfer_id, layer, req.held_len // ps, kv), 30)
    if phase == "before-done":
        link.send(GDNState(req.xfer_id, torch.zeros(hello.conv_shape), torch.zeros(hello.ssm_shape)), 30)
    os._exit(1)


def _faulty_decode(model: str, port: int) -> None:
    """A decode peer that links, asks for a long prompt and dies once it is being computed."""
    engine = Engine.from_pretrained(model, CONFIG)
    link = connect("127.0.0.1", port, connect_timeout_s=30)
    exchange_hello(link, hello_for(engine, "decode"), first=True, timeout_s=30)
    link.send(PrefillRequest(1, torch.tensor(tokens(400, 9)), 0, 0.0, 1.0, 0, None, 1), 30)
    while not isinstance(link.recv(30), PrefillProgress):
        pass
    os._exit(1)


# Random conversations through a disaggregated pair against the colocated engine. Each seed draws a
# workload: new conversations, later turns, forks (two branches at once), first tokens that end the
# request, and the events that move a prefix from one side to the other (the prefill side's cache
# emptied: an eviction or a restart; the decode side's emptied), with a local_prefill_tokens of its
# own, so later turns go local, remote or get declined. Every answer must equal the colocated
# engine's tokens, and at the end neither side holds a page or slot.

FUZZ_SEEDS = [0, 1, 2, 3]


async def _workload(ref, client, worker: PrefillWorker, rng: random.Random, ops: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
    conversations: list[list[int]] = []
    seen = {"new": 0, "turn": 0, "fork": 0, "clear_prefill": 0, "clear_decode": 0}

    def draw(n: int) -> list[int]:
        return [rng.randrange(256) for _ in range(n)]

    def params() -> SamplingParams:
        return SamplingParams(max_tokens=rng.choice([1, 2, 5, 6]), ignore_eos=rng.random() < 0.8)

    for _ in range(ops):
        kind = rng.choices(["new", "turn", "fork", "clear_prefill", "clear_decode"], [3, 6, 2, 1, 1])[0]
        if kind != "new" and not conversations and kind in ("turn", "fork"):
            kind = "new"
        seen[kind] += 1
        if kind == "new":
            prompt = draw(rng.randrange(1, 90))
            out = await both(ref, client, prompt, params())
            conversations.append(prompt + out.token_ids)
        elif kind == "turn":
            i = rng.randrange(len(conversations))
            prompt = conversations[i] + draw(rng.randrange(1, 40))
            out = await both(ref, client, prompt, params())
            conversations[i] = prompt + out.token_ids
        elif kind == "fork":
            base = rng.choice(conversations)
            branches = [base + draw(rng.randrange(1, 20)) for _ in range(2)]
            p = params()
            expected = [await _collect(ref, b, p) for b in branches]
            got = await asyncio.gather(*(_collect(client, b, p) for b in branches))
            assert got == expected, "forked branches differ from the colocated run"
            conversations += [b + t for b, t in zip(branches, got)]
        elif kind == "clear_prefill":
            worker.engine.cache.tree.clear()  # idle link: the worker thread waits in recv
        else:
            await client.cached_prefix_len([0])
            await client.reset_prefix_cache()
    return seen


async def _collect(client, prompt: list[int], params: SamplingParams) -> list[int]:  # type: ignore[no-untyped-def]
    items = [out async for out in client.generate(prompt, params)]
    return list(items[-1].token_ids)


@pytest.mark.slow  # a prefill process or a prefill-decode pair of engines
@pytest.mark.parametrize("seed", FUZZ_SEEDS)
def test_random_conversations_equal_one_process(model: Path, seed: int) -> None:
    rng = random.Random(seed)
    local = rng.choice([0, 8, 64])
    worker = PrefillWorker(Engine.from_pretrained(model, CONFIG), PDConfig(role="prefill", peer="127.0.0.1:0"))
    with serving(worker) as listener:

        async def main() -> dict[str, int]:
            async with pair(model, listener.port, local_prefill_tokens=local) as (ref, client):
                seen = await _workload(ref, client, worker, rng, ops=24)
                assert client.num_failed == 0
                assert client.num_remote + client.num_local >= seen["new"] + seen["turn"]
                if local == 0:
                    assert client.num_declined == 0  # never local: never declined
                return seen

        seen = asyncio.run(main())
    assert seen["turn"] and seen["new"]
    engine = worker.engine
    assert not engine.has_unfinished_requests()
    engine.cache.tree.clear()
    assert (engine.page_pool.num_free_pages, engine.slot_pool.num_free_slots) == (
        engine.page_pool.num_pages, engine.slot_pool.num_slots)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "faulty-prefill":
        _faulty_prefill(sys.argv[2])
    elif sys.argv[1] == "faulty-decode":
        _faulty_decode(sys.argv[2], int(sys.argv[3]))

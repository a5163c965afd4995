"""Tensor parallelism on CPU over gloo: TP=2 gives the same greedy tokens as TP=1.

Each architecture's TP=2 engine is spawned once per module (rank 0 here, rank 1 a child
process) next to a TP=1 engine with the same options; both get the same calls, so they make the
same scheduling and prefix-cache decisions, and every answer is compared token for token. The
shard loader is checked in-process (no communication) against the TP=1 weights.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import shutil
from dataclasses import replace
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import phloem.engine.loader as loader
from phloem.engine import Engine, EngineError, SamplingParams
from phloem.engine.config import CacheConfig, LoadConfig, ModelConfig, ParallelConfig, SchedulerConfig
from phloem.engine.parallel import TPGroup, check_tp_size, kv_head_start
from phloem.engine.step_plan import StateMove, StepInputs, StepPlan, decode_plan, encode_plan
from phloem.runtime.engine_client import EngineClient
from tp_pairs import assert_same_state, assert_stopped, both, clear, spill_and_resume, tokens

ARCHS = ["Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM", "Qwen3NextForCausalLM"]
# A 32-token budget chunks every longer prefill; no periodic checkpoints (turn ends only).
OPTIONS: dict[str, Any] = dict(
    cache=CacheConfig(page_size=16, num_pages=64, num_state_slots=16, checkpoint_interval=0),
    scheduler=SchedulerConfig(max_num_batched_tokens=32),
)
TP2 = ParallelConfig(tensor_parallel_size=2)


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: Callable[..., Path]) -> Iterator[dict[str, tuple[Engine, Engine]]]:
    """arch -> (TP=1 engine, TP=2 engine); the TP=2 workers must all exit cleanly at teardown."""
    pairs: dict[str, tuple[Engine, Engine]] = {}
    try:
        for arch in ARCHS:
            path = tiny_checkpoint(arch)
            tp1 = Engine.from_pretrained(path, **OPTIONS)
            pairs[arch] = (tp1, Engine.from_pretrained(path, parallel=TP2, **OPTIONS))
        yield pairs
    finally:
        for _, tp in pairs.values():
            tp.close()
    for _, tp in pairs.values():
        assert_stopped(tp)


@pytest.mark.slow  # two-rank tensor-parallel process group
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_prefill_decode_and_chunked_prefill(arch: str, engines: dict[str, tuple[Engine, Engine]]) -> None:
    lengths = [1, 7, 16, 17, 45, 70]  # 45 and 70 are prefilled in chunks of 32
    both(engines[arch], [tokens(n, 40 + n) for n in lengths], SamplingParams(max_tokens=12))


@pytest.mark.slow  # two-rank tensor-parallel process group
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hit_multi_turn_then_fork(arch: str, engines: dict[str, tuple[Engine, Engine]]) -> None:
    pair = engines[arch]
    history = tokens(37, 1)
    for turn in range(3):
        out = pair[1].generate([history], SamplingParams(max_tokens=5))[0]
        ref = pair[0].generate([history], SamplingParams(max_tokens=5))[0]
        assert out.token_ids == ref.token_ids
        assert out.num_cached_tokens == ref.num_cached_tokens == (0 if turn == 0 else len(history) - 3)
        history = history + out.token_ids + tokens(3, 10 + turn)
    # Fork: two continuations of the finished conversation; its partial last page is copied.
    conv = history[:-3]
    assert len(conv) % 16, "the fork point must be mid-page to exercise the tail-page copy"
    branches = [conv + tokens(2, 20), conv + tokens(5, 21)]
    ref_out, tp_out = (engine.generate(branches, SamplingParams(max_tokens=8)) for engine in pair)
    assert [o.token_ids for o in tp_out] == [o.token_ids for o in ref_out]
    assert [o.num_cached_tokens for o in tp_out] == [len(conv)] * 2


@pytest.mark.slow  # two-rank tensor-parallel process group
@pytest.mark.parametrize("arch", ARCHS)
def test_spill_and_resume_move_between_tp_sizes(arch: str, engines: dict[str, tuple[Engine, Engine]]) -> None:
    """A TP=2 export equals the TP=1 one (the TP=1 layout), and each engine resumes from the
    other's export with the tokens of a fresh recompute."""
    pair = engines[arch]
    conv, one = spill_and_resume(pair, max_tokens=8)
    assert len(conv) % 16, "a mid-page end exercises the checkpoint's tail page"
    with pytest.raises(ValueError, match="state: expected kv"):
        pair[1].import_prefix(replace(one, ssm=one.ssm[:, :1]))  # type: ignore[union-attr]
    assert pair[1].slot_pool.num_free_slots == pair[1].slot_pool.num_slots


@pytest.mark.slow  # two-rank tensor-parallel process group
def test_seeded_sampling_matches(engines: dict[str, tuple[Engine, Engine]]) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.95, seed=7)
    both(engines["Qwen3_5MoeForCausalLM"], [tokens(9, 3), tokens(21, 4)], params)


@pytest.mark.slow  # two-rank tensor-parallel process group
def test_async_scheduling_under_tp2_gives_synchronous_tp1_tokens(engines: dict[str, tuple[Engine, Engine]]) -> None:
    """TP=2 queues decode steps whose ids every rank receives by broadcast from rank 0's device."""
    tp1, tp2 = engines["Qwen3_5MoeForCausalLM"]
    queued = tp2.num_pipelined_steps
    tp1.async_scheduling = False
    try:
        both((tp1, tp2), [tokens(5, 8), tokens(19, 9), tokens(2, 10)],
             [SamplingParams(max_tokens=n) for n in (14, 6, 9)])
    finally:
        tp1.async_scheduling = True
    assert tp2.num_pipelined_steps > queued


@pytest.mark.slow  # two-rank tensor-parallel process group
def test_engine_client_runs_a_tp_engine_and_stops_its_workers(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("Qwen3_5MoeForCausalLM")
    prompt = tokens(20, 5)
    expected = Engine.from_pretrained(path, **OPTIONS).generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    engine = Engine.from_pretrained(path, parallel=TP2, **OPTIONS)

    async def main() -> list[int]:
        async with EngineClient(engine) as client:
            items = [item async for item in client.generate(prompt, SamplingParams(max_tokens=6))]
        return items[-1].token_ids

    assert asyncio.run(main()) == expected
    assert_stopped(engine)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size: expected a divisor of num_attention_heads=4, got 3"),
        (dict(tensor_parallel_size=4), "linear_num_key_heads=2"),
        (dict(tensor_parallel_size=16), r"tensor_parallel_size: expected an integer in \[1, 8\], got 16"),
        (dict(tensor_parallel_size=0), r"in \[1, 8\], got 0"),
        (dict(tensor_parallel_size=2, device="cuda"), "need GPUs 0..1, but 0 are visible"),
    ],
    ids=["heads", "gdn-heads", "over-8", "zero", "gpus"],
)
def test_bad_tensor_parallel_size_is_a_clear_error(
    options: dict[str, Any], message: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    if options.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=message):
        parallel = ParallelConfig(tensor_parallel_size=options["tensor_parallel_size"])
        Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), device=options.get("device"), parallel=parallel)
    assert set(multiprocessing.active_children()) == before, "a refused size must start no process"


def test_kv_heads_split_or_follow_their_q_heads() -> None:
    cpu = torch.device("cpu")
    assert [kv_head_start(8, 4, TPGroup(r, 2, cpu)) for r in range(2)] == [0, 2]
    # 2 KV heads on 4 ranks: replicated, each rank keeps the one its q heads read.
    assert [kv_head_start(8, 2, TPGroup(r, 4, cpu)) for r in range(4)] == [0, 0, 1, 1]
    assert [kv_head_start(8, 1, TPGroup(r, 8, cpu)) for r in range(8)] == [0] * 8


def unshard(name: str, parts: list[torch.Tensor], model: Any) -> torch.Tensor:
    """Rebuild a TP=1 parameter from its two rank shards (the inverse of the sharding table)."""
    config = model.config
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
        return torch.cat(parts, dim=-1)
    if name.endswith("experts.gate_up_proj"):
        halves = [p.chunk(2, dim=1) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=1)
    if name.endswith("gate_up_proj.weight"):
        halves = [p.chunk(2) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if name.endswith("qkv_proj.weight"):
        q, k = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        split = [p.split([q, k // 2, k // 2]) for p in parts]
        return torch.cat([torch.cat([s[i] for s in split]) for i in range(3)])
    if name.endswith(("in_proj.weight", "conv_weight")):
        kd, vd, hv = config.linear_key_dim // 2, config.linear_value_dim // 2, config.linear_num_value_heads // 2
        sizes = [kd, kd, vd, vd, hv, hv] if name.endswith("in_proj.weight") else [kd, kd, vd]
        split = [p.split(sizes) for p in parts]
        return torch.cat([torch.cat([s[i] for s in split]) for i in range(len(sizes))])
    if name.endswith(("norm.weight", "router.weight")):
        assert torch.equal(parts[0], parts[1]), f"{name} must be replicated"
        return parts[0]
    return torch.cat(parts)  # heads, vocab rows


def record_reads(monkeypatch: pytest.MonkeyPatch, *methods: str) -> list[str]:
    """Patch the loader's ``safe_open``: the names read through ``methods`` are appended to the list."""
    reads: list[str] = []
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.inner = real_open(*args, **kwargs)

        def __enter__(self) -> Recording:
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc: Any) -> None:
            self.inner.__exit__(*exc)

        def keys(self) -> Any:
            return self.f.keys()

        def get_slice(self, name: str) -> Any:
            if "get_slice" in methods:
                reads.append(name)
            return self.f.get_slice(name)

        def get_tensor(self, name: str) -> torch.Tensor:
            if "get_tensor" in methods:
                reads.append(name)
            return self.f.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    return reads


# Checkpoint layouts the sharded loader must read: Qwen3-Next's fused in_proj_qkvz / in_proj_ba
# with per-expert tensors, and Qwen3.5's language_model prefix, sharded files and fused experts.
SHARDED_LAYOUTS = [("Qwen3NextForCausalLM", "plain", "per_expert"), ("Qwen3_5MoeForCausalLM", "language_model", "fused")]


@pytest.mark.parametrize(("arch", "layout", "experts"), SHARDED_LAYOUTS)
def test_shards_rebuild_the_full_model_without_full_reads(
    arch: str, layout: str, experts: str, tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoint(arch, layout, experts)
    config = ModelConfig.from_pretrained(path)
    full = dict(loader.load_model(path, config, LoadConfig()).named_parameters())
    whole_reads = record_reads(monkeypatch, "get_tensor")
    shards = [loader.load_model(path, config, LoadConfig(), TPGroup(r, 2, torch.device("cpu"))) for r in range(2)]
    ranks = [dict(m.named_parameters()) for m in shards]
    assert ranks[0].keys() == full.keys()
    for name, param in full.items():
        assert torch.equal(unshard(name, [r[name] for r in ranks], shards[0]), param), name
    replicated = ("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight", "visual", "mtp.")
    assert whole_reads and all(any(k in n for k in replicated) for n in whole_reads), whole_reads


MOE_ARCHS = ["Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"]


@pytest.fixture(scope="module")
def ep_engines(tiny_checkpoint: Callable[..., Path], engines: dict[str, tuple[Engine, Engine]]) -> Iterator[dict[str, tuple[Engine, Engine]]]:
    """arch -> (the TP=1 engine, a TP=2 engine with the experts split whole across the ranks)."""
    pairs: dict[str, tuple[Engine, Engine]] = {}
    try:
        for arch in MOE_ARCHS:
            ep = Engine.from_pretrained(tiny_checkpoint(arch), parallel=ParallelConfig(2, expert_parallel=True), **OPTIONS)
            pairs[arch] = (engines[arch][0], ep)
        yield pairs
    finally:
        for _, ep in pairs.values():
            ep.close()
    for _, ep in pairs.values():
        assert_stopped(ep)


@pytest.mark.slow  # two-rank tensor-parallel process group
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_parallel_follows_tp1(arch: str, ep_engines: dict[str, tuple[Engine, Engine]]) -> None:
    """Batched and chunked prefill, decode, a multi-turn prefix hit, a fork and a resume."""
    pair = ep_engines[arch]
    moe = pair[1].runner.model.model.layers[0].mlp  # type: ignore[attr-defined]
    assert moe.expert_parallel and moe.experts.gate_up_proj.shape[0] == moe.num_experts // 2 + 2
    clear(pair)
    both(pair, [tokens(n, 70 + n) for n in (3, 16, 45)], SamplingParams(max_tokens=10))
    history = tokens(37, 2)
    for _ in range(2):
        history = history + both(pair, [history], SamplingParams(max_tokens=5))[0] + tokens(3, 9)
    conv = history[:-3]
    both(pair, [conv + tokens(2, 30), conv + tokens(4, 31)], SamplingParams(max_tokens=6))
    states = [engine.export_prefix(conv) for engine in pair]
    assert_same_state(states[1], states[0])
    clear(pair)
    assert pair[1].import_prefix(states[0])  # type: ignore[arg-type]
    out = pair[1].generate([conv + [7]], SamplingParams(max_tokens=6))[0]
    assert out.num_cached_tokens == len(conv)
    assert out.token_ids == pair[0].generate([conv + [7]], SamplingParams(max_tokens=6))[0].token_ids
    clear(pair)


def test_expert_parallel_needs_a_moe_model_and_divisible_experts(tiny_checkpoint: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="expert_parallel: Qwen3_5ForCausalLM has no MoE layers"):
        Engine.from_pretrained(tiny_checkpoint("Qwen3_5ForCausalLM"), parallel=ParallelConfig(2, expert_parallel=True))
    odd = replace(ModelConfig.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM")), num_experts=7)
    with pytest.raises(ValueError, match="expected a divisor of num_experts=7, got 2"):
        check_tp_size(odd, 2, torch.device("cpu"), expert_parallel=True)
    check_tp_size(odd, 2, torch.device("cpu"))  # tensor-parallel experts split their intermediate instead
    with pytest.raises(ValueError, match="expert_parallel: needs tensor_parallel_size > 1"):
        Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), parallel=ParallelConfig(expert_parallel=True))


@pytest.mark.parametrize(("arch", "layout", "experts"), SHARDED_LAYOUTS)
def test_expert_parallel_ranks_read_only_their_experts(
    arch: str, layout: str, experts: str, tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_checkpoint(arch, layout, experts)
    config = ModelConfig.from_pretrained(path)
    full = dict(loader.load_model(path, config, LoadConfig()).named_parameters())
    reads = record_reads(monkeypatch, "get_tensor", "get_slice")
    e, half = config.num_experts, config.num_experts // 2
    for rank in range(2):
        reads.clear()
        model = loader.load_model(path, config, LoadConfig(), TPGroup(rank, 2, torch.device("cpu"), expert_parallel=True))
        local = dict(model.named_parameters())
        others = range(half, e) if rank == 0 else range(half)
        assert reads and not [n for n in reads if any(f".experts.{o}." in n for o in others)]
        assert rank == 0 or not [n for n in reads if ".shared_expert." in n]
        for name, param in local.items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            whole = full[name]
            assert torch.equal(param[:half], whole[rank * half : (rank + 1) * half]), name
            assert torch.equal(param[half], whole[e] if rank == 0 else torch.zeros_like(whole[e])), name
            assert not param[half + 1].any(), name  # the zero expert


def test_step_plan_round_trips() -> None:
    inputs = StepInputs(
        input_ids=[5, 6, 7], positions=[3, 0, 1], slot_mapping=[35, 64, 65], query_start_loc=[0, 1, 3],
        seq_lens=[4, 2], read_slots=[2, 3], write_slots=[4, 3], has_state=[True, False], query_lens=(1, 2),
        page_ids=[[2], [4, 9]], sample_rows=[0, 1],
    )
    moves = [StateMove("export", (3, 9, 4), 2), StateMove("import", (), 0)]
    plans = [StepPlan(((1, 2), (7, 3)), inputs), StepPlan((), inputs), StepPlan(((4, 5),), None)]
    plans += [StepPlan(((1, 2),), inputs, device_ids=True)]
    plans += [StepPlan(((4, 5),), None, moves[0]), StepPlan((), None, moves[1])]
    for plan in plans:
        assert decode_plan(encode_plan(plan)) == plan


@pytest.mark.slow  # two-rank tensor-parallel process group
def test_a_bad_checkpoint_fails_on_every_rank_and_leaves_no_process(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    src = tiny_checkpoint("Qwen3_5ForCausalLM")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    with safe_open(dst / "model.safetensors", framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n != "model.layers.1.mlp.up_proj.weight"}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=r"missing weight 'model\.layers\.1\.mlp\.gate_up_proj\.weight'"):
        Engine.from_pretrained(dst, parallel=TP2, **OPTIONS)
    assert set(multiprocessing.active_children()) == before


@pytest.fixture(scope="module")
def odd_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Dense Qwen3.5 with one KV head (replicated on both ranks), an odd vocab (padded vocab
    shards) and tied embeddings (the tie holds between the two vocab-parallel shards)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    config = Qwen3_5TextConfig(
        vocab_size=251, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=True, rope_parameters=rope,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        # Unit gain on fan-in and non-trivial norms: clear top-2 logit margins (see conftest).
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 8.0, generator=gen).log())
            elif name.endswith(("norm.weight", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if "linear_attn" in name else 0.0))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    folder = tmp_path_factory.mktemp("odd_tp")
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow  # two-rank tensor-parallel process group
def test_replicated_kv_head_padded_vocab_tied_embeddings(odd_checkpoint: Path) -> None:
    prompts = [[t % 251 for t in tokens(n, n)] for n in (3, 18, 50)]
    params = SamplingParams(max_tokens=10)
    ref_engine = Engine.from_pretrained(odd_checkpoint, **OPTIONS)
    ref = ref_engine.generate(prompts, params)
    with Engine.from_pretrained(odd_checkpoint, parallel=TP2, **OPTIONS) as engine:
        assert engine.runner.caches.kv.shape[-2] == 1  # the one KV head, on both ranks
        out = engine.generate(prompts, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
        # The replicated KV head is exported once; the TP=1 state resumes on TP=2.
        conv = prompts[2] + ref[2].token_ids
        state = ref_engine.export_prefix(conv)
        assert_same_state(engine.export_prefix(conv), state)
        nxt = [conv + [7, 8]]
        expected = ref_engine.generate(nxt, params)[0].token_ids
        engine.cache.tree.clear()  # type: ignore[union-attr]
        assert engine.import_prefix(state)  # type: ignore[arg-type]
        resumed = engine.generate(nxt, params)[0]
        assert resumed.token_ids == expected and resumed.num_cached_tokens == len(conv)
        # A worker that dies is reported at the next step, not a hang in a collective.
        worker = engine.workers.processes[0]  # type: ignore[union-attr]
        worker.kill()
        worker.join()
        with pytest.raises(EngineError, match="tensor-parallel rank 1 died"):
            engine.generate([tokens(5, 1)], SamplingParams(max_tokens=2))
    assert worker not in multiprocessing.active_children()

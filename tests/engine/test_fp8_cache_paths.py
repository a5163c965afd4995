"""FP8 KV pages (``kv_cache_dtype="fp8_e4m3"``) on every cache path give the fresh path's greedy
tokens, on the trained built-in model: a prefix hit, forks, spill/resume through a segment on
disk, a prefill/decode transfer, MTP speculation, and (slow; the tiny random checkpoint) TP=2
over gloo. The fresh path is an fp8-KV engine without a prefix cache computing the whole
history; fp8 pages are bytes to every path that moves them, so each equals it token for token.

A state of another KV dtype converts when it is imported (docs/decisions.md, "FP8 KV cache"): a
model-dtype segment into an fp8 engine takes the saturating cast a fresh write takes, an fp8
segment into a model-dtype engine the exact upcast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from phloem.engine import CacheConfig, Engine, SamplingParams, SchedulerConfig
from phloem.engine.transfer.prefix_export import PrefixState
from phloem.kernels.attention.reference import FP8_MAX
from phloem.runtime.builtin_model import trained_model_path
from phloem.storage import Segment
from phloem.storage.disk import DiskStore

FP8 = torch.float8_e4m3fn
CACHE = CacheConfig(page_size=16, num_pages=96, num_state_slots=16, checkpoint_interval=0, kv_cache_dtype="fp8_e4m3")
GREEDY = SamplingParams(max_tokens=10)


def engine(cache: CacheConfig = CACHE) -> Engine:
    scheduler = SchedulerConfig(max_num_batched_tokens=256)
    return Engine.from_pretrained(trained_model_path(), cache=cache, scheduler=scheduler)


def fresh(prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in engine(replace(CACHE, enable_prefix_caching=False)).generate(prompts, GREEDY)]


def tokens(n: int, seed: int, vocab: int = 4096) -> list[int]:
    return [(seed * 131 + i * 17) % (vocab - 10) + 10 for i in range(n)]


def test_the_pool_holds_fp8_pages_at_half_the_bytes() -> None:
    fp8, model_dtype = engine(), engine(replace(CACHE, kv_cache_dtype="auto"))
    assert fp8.runner.caches.kv.dtype == FP8 and fp8.runner.caches.conv.dtype == model_dtype.runner.caches.conv.dtype
    assert model_dtype.runner.caches.kv.element_size() == 4 * fp8.runner.caches.kv.element_size()  # fp32 model


def test_an_unknown_kv_cache_dtype_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of \\('auto', 'fp8_e4m3'\\), got 'fp8'"):
        CacheConfig(kv_cache_dtype="fp8")


def test_prefix_hit_and_forks_equal_fresh() -> None:
    eng = engine()
    shared = tokens(50, 1)
    prompts = [shared + tokens(3, 2), shared + tokens(9, 3)]
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == fresh(prompts)
    conv = prompts[0] + outs[0].token_ids
    nxt = conv + tokens(7, 4)
    hit = eng.generate([nxt], GREEDY)[0]
    assert hit.num_cached_tokens == len(conv) and hit.token_ids == fresh([nxt])[0]
    # Forks: three branches continue the same conversation (its mid-page tail copied each time).
    branches = [conv + tokens(2, s) for s in (5, 6, 7)]
    bouts = eng.generate(branches, GREEDY)
    assert all(b.num_cached_tokens == len(conv) for b in bouts)
    assert [b.token_ids for b in bouts] == fresh(branches)


def _spill(eng: Engine, conv: list[int], tmp_path: Path) -> Segment:
    """Export ``conv``'s state, write it as a segment file and read it back (the disk tier)."""
    state = eng.export_prefix(conv)
    assert state is not None and state.num_tokens == len(conv)
    ids = torch.tensor(conv, dtype=torch.int64)
    segment = Segment.from_tensors(session_id="s", segment_id="seg", model_fingerprint="fp",
                                   tensors={"kv": state.kv, "conv": state.conv, "ssm": state.ssm, "token_ids": ids})
    disk = DiskStore(tmp_path)
    disk.write(segment)
    return disk.read("s", "seg", expect_fingerprint="fp")


def _resume(eng: Engine, segment: Segment) -> None:
    t = segment.tensors
    eng.cache.tree.clear()  # the session went idle and was dropped from the device
    assert eng.import_prefix(PrefixState(tuple(t["token_ids"].tolist()), t["kv"], t["conv"], t["ssm"]))


@pytest.mark.parametrize("prompt_len", [21, 26], ids=["mid-page", "page-aligned"])
def test_spill_resume_through_a_segment_equals_fresh(tmp_path: Path, prompt_len: int) -> None:
    eng = engine()
    prompt = tokens(prompt_len, 8)
    conv = prompt + eng.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    segment = _spill(eng, conv, tmp_path)
    assert (segment.meta.kv_dtype, segment.meta.conv_dtype) == ("float8_e4m3fn", "float32")
    assert segment.tensors["kv"].dtype == FP8
    _resume(eng, segment)
    nxt = conv + tokens(3, 9)
    resumed = eng.generate([nxt], GREEDY)[0]
    assert resumed.num_cached_tokens == len(conv)
    assert resumed.token_ids == fresh([nxt])[0]


def _pages(eng: Engine, conv: list[int]) -> torch.Tensor:
    state = eng.export_prefix(conv)
    assert state is not None
    return state.kv


def test_a_segment_of_another_kv_dtype_converts_on_resume(tmp_path: Path) -> None:
    prompt = tokens(30, 10)
    fp8, full = engine(), engine(replace(CACHE, kv_cache_dtype="auto"))
    conv = prompt + full.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    fp8_conv = prompt + fp8.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
    # fp32 pages into the fp8 engine: the saturating cast of a fresh write.
    fp32_segment = _spill(full, conv, tmp_path / "fp32")
    _resume(fp8, fp32_segment)
    want = fp32_segment.tensors["kv"].clamp(-FP8_MAX, FP8_MAX).to(FP8)
    assert torch.equal(_pages(fp8, conv).view(torch.uint8), want.view(torch.uint8))
    assert fp8.generate([conv + [11]], GREEDY)[0].num_cached_tokens == len(conv)
    # fp8 pages into the fp32 engine: the exact upcast.
    fp8_segment = _spill(fp8, fp8_conv, tmp_path / "fp8")
    _resume(full, fp8_segment)
    assert torch.equal(_pages(full, fp8_conv), fp8_segment.tensors["kv"].float())
    assert full.generate([fp8_conv + [11]], GREEDY)[0].num_cached_tokens == len(fp8_conv)


def test_prefill_decode_transfer_of_fp8_pages_equals_one_engine() -> None:
    """The decode side reserves, the prefill side computes and ships its fp8 pages and state."""
    prompt = tokens(37, 11)
    reference = engine().generate([prompt], GREEDY)[0].token_ids
    prefill_engine, decode_engine = engine(), engine()
    res = decode_engine.reserve_transfer(prompt, GREEDY)
    assert res is not None
    rid = prefill_engine.add_request(prompt, GREEDY, prefill_only=True, sample_first=True)
    first = _run(prefill_engine, rid)
    source = prefill_engine.transfer_source(list(res.token_ids), res.first_page)
    assert source is not None
    kv = source.whole()[0]
    assert kv.dtype == FP8
    decode_engine.install_transfer(res, kv, *source.state())
    out = _run(decode_engine, decode_engine.add_request(prompt, GREEDY, output_token_ids=first))
    assert out == reference


def test_mtp_speculation_on_fp8_pages_gives_the_plain_tokens() -> None:
    """The MTP layer's KV is one more layer of the fp8 pool; drafts verified on fp8 pages keep
    greedy decoding lossless."""
    from phloem.engine.config import SpeculativeConfig

    prompts = [tokens(20, s) for s in (18, 19, 20)]
    cache = replace(CACHE, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=24)
    plain = Engine.from_pretrained(trained_model_path(), cache=cache).generate(prompts, params)
    spec = Engine.from_pretrained(trained_model_path(), cache=cache, speculative=SpeculativeConfig.parse("mtp:3"))
    assert spec.runner.caches.kv.dtype == FP8
    assert [o.token_ids for o in spec.generate(prompts, params)] == [o.token_ids for o in plain]


def _run(eng: Engine, rid: str) -> list[int]:
    """Step until ``rid`` finishes (and its checkpoints land); its tokens."""
    final = None
    while final is None or eng.scheduler.num_finalizing():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
    return final.token_ids


@pytest.mark.slow  # two-rank tensor-parallel process group
def test_tp2_over_gloo_hit_and_spill_resume_equal_its_fresh_path(tiny_checkpoint: Callable[..., Path]) -> None:
    """At TP=2 (gloo) the fp8 pages leave and come back through the ranks' gather and scatter (on
    the tiny random Qwen3.5-MoE checkpoint: the trained model's single GDN key head does not split)."""
    from phloem.engine import ParallelConfig

    tp2 = Engine.from_pretrained(tiny_checkpoint("Qwen3_5MoeForCausalLM"), cache=CACHE,
                                 parallel=ParallelConfig(tensor_parallel_size=2),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=32))
    try:
        prompt = tokens(29, 12, vocab=256)
        conv = prompt + tp2.generate([prompt], SamplingParams(max_tokens=6))[0].token_ids
        nxt = conv + tokens(4, 13, vocab=256)
        hit = tp2.generate([nxt], GREEDY)[0]
        assert hit.num_cached_tokens == len(conv)
        state = tp2.export_prefix(conv)
        assert state is not None and state.kv.dtype == FP8
        tp2.cache.tree.clear()
        recomputed = tp2.generate([nxt], GREEDY)[0]
        assert recomputed.num_cached_tokens == 0 and recomputed.token_ids == hit.token_ids
        tp2.cache.tree.clear()
        assert tp2.import_prefix(state)
        resumed = tp2.generate([nxt], GREEDY)[0]
        assert resumed.num_cached_tokens == len(conv) and resumed.token_ids == hit.token_ids
        again = tp2.export_prefix(conv)
        assert again is not None and torch.equal(again.kv.view(torch.uint8), state.kv.view(torch.uint8))
    finally:
        tp2.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_and_flashinfer_on_fp8_pages_follow_the_eager_fresh_path() -> None:
    """bf16 on CUDA: FlashInfer reads the fp8 pages (the Triton decode kernel is off for them),
    decode steps replay CUDA graphs; a prefix hit and two forks give the eager, uncached fp8
    engine's first 8 tokens (the trained model's logits are peaked: no ties that early)."""
    from phloem.engine import EngineConfig, LoadConfig, RunnerConfig

    gpu = EngineConfig(load=LoadConfig(device="cuda", dtype="bfloat16"), cache=replace(CACHE, num_pages=512),
                       scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=8))
    eng = Engine.from_pretrained(trained_model_path(), gpu)
    assert eng.runner.caches.kv.dtype == FP8
    first = tokens(100, 14)
    conv = first + eng.generate([first], GREEDY)[0].token_ids
    branches = [conv + tokens(3, s) for s in (15, 16, 17)]
    hits = eng.generate(branches, SamplingParams(max_tokens=8))
    assert all(h.num_cached_tokens == len(conv) for h in hits)
    eager = Engine.from_pretrained(trained_model_path(), gpu, runner=RunnerConfig(enable_cuda_graph=False),
                                   cache=replace(gpu.cache, enable_prefix_caching=False))
    want = eager.generate(branches, SamplingParams(max_tokens=8))
    assert [h.token_ids for h in hits] == [w.token_ids for w in want]

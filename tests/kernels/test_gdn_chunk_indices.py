"""fla's chunk indices built on the device for a static layout (``kernels.gdn.chunk_indices``): the
same entries as fla's host-built ones, then padding that names the empty last sequence; on a GPU,
fla's chunked GDN over such a layout, captured once in a CUDA graph and replayed with other
lengths, gives the eager call's outputs and states bit for bit."""

from __future__ import annotations

import pytest
import torch

from phloem.kernels.gdn.chunk_indices import CHUNK_SIZE, max_chunks, static_chunk_indices

LAYOUTS = {
    "mixed_step": [1] * 15 + [800, 0],
    "empties_between": [0, 5, 0, 0, 64, 65, 0],
    "one_long": [2048, 0],
    "all_empty": [0, 0, 0],
    "tiny_chunks": [3, 1, 17, 0],
}


def expected(lens: list[int], num_chunks: int, chunk_size: int) -> list[list[int]]:
    """fla's ``prepare_chunk_indices`` (sequence, chunk) pairs, padded with (last sequence, 0)."""
    pairs = [[i, c] for i, n in enumerate(lens) for c in range(-(-n // chunk_size))]
    return pairs + [[len(lens) - 1, 0]] * (num_chunks - len(pairs))


def layout(lens: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=device)


@pytest.mark.parametrize("chunk_size", [CHUNK_SIZE, 16])
@pytest.mark.parametrize("lens", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_indices_are_flas_then_the_empty_last_sequence(lens: list[int], chunk_size: int) -> None:
    num_chunks = max_chunks(sum(lens), len(lens), chunk_size)
    assert num_chunks >= sum(-(-n // chunk_size) for n in lens)
    indices, offsets = static_chunk_indices(layout(lens), num_chunks, chunk_size)
    assert indices.tolist() == expected(lens, num_chunks, chunk_size)
    chunks = [-(-n // chunk_size) for n in lens]
    assert offsets.tolist() == [sum(chunks[:i]) for i in range(len(lens) + 1)]
    out = (torch.full_like(indices, -7), torch.full_like(offsets, -7))
    assert static_chunk_indices(layout(lens), num_chunks, chunk_size, out=out) is out
    assert out[0].equal(indices) and out[1].equal(offsets)


def _gdn_inputs(num_tokens: int, slots: int, device: str) -> dict[str, torch.Tensor]:
    hk, hv, d = 4, 8, 128
    gen = torch.Generator(device=device).manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    return dict(
        q=r(num_tokens, hk, d).bfloat16(), k=r(num_tokens, hk, d).bfloat16(), v=r(num_tokens, hv, d).bfloat16(),
        g=-torch.rand(num_tokens, hv, generator=gen, device=device) * 0.1,
        beta=torch.rand(num_tokens, hv, generator=gen, device=device).bfloat16(),
        ssm_states=r(slots, hv, d, d) * 0.01,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_static_layout_replays_the_eager_calls_bitwise() -> None:
    pytest.importorskip("fla")
    from phloem.kernels.gdn.fla import chunk_gated_delta_rule

    dev, bucket, tier, scratch = "cuda", 1024, 24, 0
    seqs = tier + 2
    inputs = _gdn_inputs(bucket, 64, dev)
    cu = torch.zeros(seqs + 1, dtype=torch.int64, device=dev)
    read = torch.full((seqs,), scratch, dtype=torch.int64, device=dev)
    write, has = read.clone(), torch.zeros(seqs, dtype=torch.bool, device=dev)
    nt = max_chunks(bucket, seqs)
    chunks = (torch.zeros(nt, 2, dtype=torch.int64, device=dev), torch.zeros(seqs + 1, dtype=torch.int64, device=dev))
    states = inputs["ssm_states"].clone()
    out = torch.zeros(bucket, 8, 128, dtype=torch.bfloat16, device=dev)

    def body() -> None:
        static_chunk_indices(cu, nt, out=chunks)
        out.copy_(chunk_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], states,
                                         cu, read, write, has, chunks=chunks))  # fmt: skip

    def fill(lens: list[int]) -> None:
        """The step's sequences, empty ones up to the tier, the padding rows, an empty last one."""
        n, s = sum(lens), len(lens)
        cu.copy_(layout([*lens, *[0] * (tier - s), bucket - n, 0], dev))
        read.fill_(scratch)
        write.fill_(scratch)
        has.fill_(False)
        read[:s] = torch.arange(1, s + 1, device=dev)
        write[:s] = torch.arange(32, 32 + s, device=dev)
        has[:s] = torch.arange(s, device=dev) % 3 != 1

    fill([100])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # compiles and autotunes outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for lens in ([1] * 15 + [800], [1000], [3, 64, 65, 1, 129], [1] * 24):
        n, s = sum(lens), len(lens)
        states.copy_(inputs["ssm_states"])
        fill(lens)
        graph.replay()
        want_states = inputs["ssm_states"].clone()
        want = chunk_gated_delta_rule(
            *(inputs[k][:n] for k in ("q", "k", "v", "g", "beta")), want_states, layout(lens, dev),
            read[:s], write[:s], has[:s],
        )  # fmt: skip
        torch.cuda.synchronize()
        assert out[:n].equal(want), f"outputs of {lens}"
        real = torch.ones(64, dtype=torch.bool, device=dev)
        real[scratch] = False
        assert states[real].equal(want_states[real]), f"states of {lens}"

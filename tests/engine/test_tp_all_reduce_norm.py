"""The all-reduce + residual add + RMSNorm of tensor parallelism over gloo, at 2, 4 and 8 ranks.

Each rank is a spawned process holding its partial sum of a row-parallel output. Three ways to the
layer norm's inputs must agree with the kernel's reference (``kernels.norm.reference.
all_reduce_add_rms_norm``, the one-shot kernel's contract) and with the plain composition
``add_rms_norm(sum(parts) + residual)``: ``TPGroup.all_reduce_add_rms_norm`` (what every norm
after a row-parallel layer calls), and ``TPGroup.reduce_norm_operands`` followed by the op whose
prologue is the norm (the fused one-token path: ``add_rms_norm`` itself, and
``add_rms_norm_linear``). In fp32 the sum order is the only difference (tolerance); in bf16 at two
ranks the reference is a bf16 all-reduce's sum exactly (bits).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from phloem.kernels.linear.reference import add_rms_norm_linear
from phloem.kernels.norm.reference import add_rms_norm, all_reduce_add_rms_norm

EPS = 1e-6
ROWS = (1, 5)  # a one-token call and a small batch
D, N = 96, 24


def _case(world: int, rows: int, dtype: torch.dtype, residual: bool) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(world * 100 + rows)
    parts = [torch.randn(rows, D, generator=gen).to(dtype) for _ in range(world)]
    res = torch.randn(rows, D, generator=gen).to(dtype) if residual else None
    return parts, res, (torch.randn(D, generator=gen) * 0.2).to(dtype), torch.randn(N, D, generator=gen).to(dtype)


def _rank(rank: int, world: int, port: int, queue: Any) -> None:
    from phloem.engine.parallel import TPGroup

    try:
        store = _store(rank, world, port)
        group = TPGroup.connect(rank, world, store, torch.device("cpu"), timedelta(seconds=120))
        results = []
        for dtype in (torch.float32, torch.bfloat16):
            for rows in ROWS:
                for residual in (True, False):
                    parts, res, weight, lin = _case(world, rows, dtype, residual)
                    mine = parts[rank].clone()
                    normed, summed = group.all_reduce_add_rms_norm(mine, res, weight, EPS, add_rms_norm)
                    x, r = group.reduce_norm_operands(parts[rank].clone(), res, weight, EPS)
                    fused_normed, fused_summed = add_rms_norm(x, r, weight, EPS)
                    y, y_summed = add_rms_norm_linear(x, r, weight, EPS, lin)
                    # The plain composition's matmul in this process: bits of a CPU matmul may
                    # differ between processes (thread count, kernel choice), not within one.
                    y_plain = add_rms_norm_linear(summed, None, weight, EPS, lin)[0]
                    # As fp32 numpy arrays (exact for bf16): a tensor through the queue is shared
                    # memory that vanishes with this process.
                    out = (normed, summed, fused_normed, fused_summed, y, y_summed, y_plain)
                    results.append([t.float().numpy() for t in out])
        group.shutdown()
        queue.put((rank, results))
    except BaseException as exc:
        queue.put((rank, repr(exc)))


def _store(rank: int, world: int, port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timedelta(seconds=120))  # type: ignore[attr-defined]


@pytest.mark.slow  # up to eight spawned ranks
@pytest.mark.parametrize("world", [2, 4, 8])
def test_reductions_before_the_norm_equal_the_reference(world: int) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 31000 + (os.getpid() * 8 + world) % 2000
    procs = [ctx.Process(target=_rank, args=(r, world, port, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        answers = dict(queue.get(timeout=300) for _ in procs)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()
    assert all(isinstance(a, list) for a in answers.values()), answers
    it = 0
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            for residual in (True, False):
                parts, res, weight, lin = _case(world, rows, dtype, residual)
                ref, ref_sum = all_reduce_add_rms_norm(parts, res, weight, EPS)
                plain, plain_sum = add_rms_norm(torch.stack(parts).float().sum(0).to(dtype), res, weight, EPS)
                ref_y = add_rms_norm_linear(ref_sum, None, weight, EPS, lin)[0]
                outs = {r: [torch.from_numpy(a).to(dtype) for a in answers[r][it]] for r in range(world)}
                first = outs[0]
                for rank in range(1, world):  # every rank gets the same bits
                    assert all(torch.equal(a, b) for a, b in zip(outs[rank], first)), (rank, it)
                normed, summed, fused_normed, fused_summed, y, y_summed, y_plain = first
                # The fused path's operands give the norm's bits, whichever op runs the prologue.
                assert torch.equal(fused_normed, normed) and torch.equal(fused_summed, summed)
                assert torch.equal(y_summed, summed)
                assert torch.equal(y, y_plain)
                if dtype == torch.bfloat16 and world == 2:
                    assert torch.equal(summed, ref_sum) and torch.equal(normed, ref), it
                    assert torch.equal(ref_sum, plain_sum)
                # bf16 past two ranks: gloo rounds each partial sum, the reference once (an ulp).
                tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=8e-2, rtol=2e-2)
                pairs = [(summed, ref_sum), (normed, ref), (summed, plain_sum), (normed, plain)]
                for a, b in pairs + ([(y, ref_y)] if dtype == torch.float32 else []):
                    torch.testing.assert_close(a, b, **tol)  # type: ignore[arg-type]
                it += 1

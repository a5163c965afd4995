"""The one-shot all-reduce + add + RMSNorm kernel, run by real concurrent processes on CPU.

Each rank is a process running the kernel under the Triton interpreter; the "GPU buffers" are CPU
shared memory every process has mapped (at its own address, as CUDA IPC maps a peer's buffer), so
the flag protocol runs for real: the ranks publish rows, signal each other with release/acquire
atomics, wait, read every rank's row, and must all produce the reference's bits. At world size 1
the kernel is an add + RMSNorm and gives ``triton_norm.add_rms_norm``'s bits (under the
interpreter here; at the real shapes on sm_90, with and without PDL, on a GPU). The two-GPU run
(``benchmarks/sweeps/allreduce_bench.py``, ``test_gpu_engine``) checks the same kernel over NVLink.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import torch.multiprocessing as mp

from phloem.kernels.norm.reference import all_reduce_add_rms_norm

pytest.importorskip("triton")

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernel imports.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

D, MAX_ROWS = 96, 8
HALF = MAX_ROWS * D
EPS = 1e-6


def _run_ranks(world: int, target: Callable[..., None], args: Callable[[int, object], tuple]) -> list:  # type: ignore[type-arg]
    """Run ``target(*args(rank, queue))`` in one spawned process per rank; their answers by rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=args(r, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        return sorted((queue.get(timeout=240) for _ in procs), key=lambda a: a[0])
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.terminate()


def _case(it: int, world: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor | None, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + it)
    rows = (1, 3, MAX_ROWS, 2)[it % 4]
    parts = [torch.randn(rows, D, generator=gen).to(dtype) for _ in range(world)]
    residual = torch.randn(rows, D, generator=gen).to(dtype) if it % 3 else None
    weight = torch.randn(D, generator=gen) * 0.2
    return parts, residual, weight


def _rank(rank: int, world: int, dtype: torch.dtype, iters: int, data: list, flags: list, queue: object) -> None:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module imports (spawned process)
    from phloem.kernels.norm.triton_allreduce import one_shot_add_rms_norm

    try:
        buffers = torch.tensor([d.data_ptr() for d in data], dtype=torch.int64)
        flag_addresses = torch.tensor([f.data_ptr() for f in flags], dtype=torch.int64)
        epochs = torch.zeros(MAX_ROWS, dtype=torch.int64)
        results = []
        for it in range(iters):
            parts, residual, weight = _case(it, world, dtype)
            out, res = one_shot_add_rms_norm(
                parts[rank], residual, weight, EPS, buffers, flag_addresses, epochs, rank, HALF
            )  # fmt: skip
            results.append((out.float().numpy().tobytes(), res.float().numpy().tobytes()))
        queue.put((rank, results, epochs.tolist()))  # type: ignore[attr-defined]
    except BaseException as exc:
        queue.put((rank, repr(exc), None))  # type: ignore[attr-defined]


@pytest.mark.slow  # ranks in processes, under the Triton interpreter
@pytest.mark.parametrize(
    ("world", "dtype"), [(2, torch.float32), (3, torch.float32), (2, torch.bfloat16), (4, torch.float32), (8, torch.float32)]
)
def test_ranks_agree_with_the_reference_and_each_other(world: int, dtype: torch.dtype) -> None:
    iters = 12
    data = [torch.zeros(2 * HALF, dtype=dtype).share_memory_() for _ in range(world)]
    flags = [torch.zeros(world * MAX_ROWS, dtype=torch.int64).share_memory_() for _ in range(world)]
    answers = _run_ranks(world, _rank, lambda r, queue: (r, world, dtype, iters, data, flags, queue))
    for rank, results, epochs in answers:
        assert epochs is not None, f"rank {rank}: {results}"
        # Row r ran once per call with more than r rows.
        assert epochs == [sum(1 for it in range(iters) if _case(it, world, dtype)[0][0].shape[0] > r)
                          for r in range(MAX_ROWS)]  # fmt: skip
    for it in range(iters):
        parts, residual, weight = _case(it, world, dtype)
        ref, ref_res = all_reduce_add_rms_norm(parts, residual, weight, EPS)
        first = answers[0][1][it]
        for rank, results, _ in answers[1:]:
            assert results[it] == first, f"call {it}: rank {rank} differs from rank 0"
        out = torch.frombuffer(bytearray(first[0]), dtype=torch.float32).view(ref.shape)
        res = torch.frombuffer(bytearray(first[1]), dtype=torch.float32).view(ref.shape)
        # The interpreter truncates fp32 -> bf16 where torch rounds: a few bf16 ulps apart.
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(res, ref_res.float(), atol=tol, rtol=tol, msg=f"call {it}: reduced sum")
        torch.testing.assert_close(out, ref.float(), atol=tol, rtol=tol, msg=f"call {it}: normed")


def _one_rank_matches_add_rms_norm(device: torch.device, dim: int, rows: tuple[int, ...], pdl: bool) -> None:
    """At world size 1 the kernel is an add + RMSNorm: the same bits as ``triton_norm.add_rms_norm``
    (fp32 and bf16, with and without a residual), its buffer and flags laid out by ``OneShotAllReduce``."""
    from phloem.engine.parallel import one_shot_allreduce as one_shot
    from phloem.kernels.norm.triton_norm import add_rms_norm

    buffer = torch.zeros(2 * one_shot.HALF_BYTES + 8 * one_shot.MAX_ROWS * 8, dtype=torch.uint8, device=device)
    shot = one_shot.OneShotAllReduce(0, [buffer.data_ptr()], device, lambda: None, pdl=pdl)
    gen = torch.Generator().manual_seed(dim)
    ran: list[int] = []  # the row counts the one-shot buffer took
    for dtype in (torch.float32, torch.bfloat16):
        for n in rows:
            x, residual = (torch.randn(n, dim, generator=gen).to(device, dtype) for _ in range(2))
            weight = (torch.randn(dim, generator=gen) * 0.2).to(device, dtype)
            if not shot.fits(x):  # the engine all-reduces such a call with NCCL instead
                with pytest.raises(ValueError, match="exceed the one-shot buffer"):
                    shot.add_rms_norm(x, residual, weight, EPS)
                continue
            ran.append(n)
            for res in (residual, None):
                out, summed = shot.add_rms_norm(x.clone(), res, weight, EPS)
                ref, ref_sum = add_rms_norm(x, res, weight, EPS)
                assert torch.equal(summed, ref_sum), (dtype, n, res is None)
                assert torch.equal(out, ref), (dtype, n, res is None)
    assert ran and shot.epochs[: max(ran)].min() > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's case (CPU machines)")
def test_one_rank_is_add_rms_norm_bit_for_bit() -> None:
    # 257 rows exceed the buffer's 256: refused, as the real sizes' fp32 calls are on the GPU.
    _one_rank_matches_add_rms_norm(torch.device("cpu"), D, (2, 257), pdl=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_one_rank_is_add_rms_norm_bit_for_bit_on_gpu(pdl: bool) -> None:
    """The real hidden sizes (35B-A3B: 2048, 397B-A17B: 4096) at decode batch sizes, on sm_90 with
    and without PDL."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90")
    for dim in (2048, 4096):
        _one_rank_matches_add_rms_norm(torch.device("cuda"), dim, (1, 2, 7, 64, 128), pdl)


def test_a_call_larger_than_the_buffer_is_refused() -> None:
    from phloem.kernels.norm.triton_allreduce import one_shot_add_rms_norm

    table = torch.zeros(2, dtype=torch.int64)
    epochs = torch.zeros(MAX_ROWS, dtype=torch.int64)
    x = torch.zeros(MAX_ROWS + 1, D)
    with pytest.raises(ValueError, match="exceed the one-shot buffer"):
        one_shot_add_rms_norm(x, None, torch.zeros(D), EPS, table, table, epochs, 0, HALF)
    with pytest.raises(ValueError, match="residual must match"):
        one_shot_add_rms_norm(x[:2], x[:3], torch.zeros(D), EPS, table, table, epochs, 0, HALF)
    assert epochs.sum() == 0  # nothing ran


def _group_rank(rank: int, port: int, data: list, queue: object) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from dataclasses import replace
    from datetime import timedelta

    import torch.distributed as dist

    from phloem.engine.parallel import one_shot_allreduce as one_shot
    from phloem.engine.parallel import TPGroup
    from phloem.kernels.norm.reference import add_rms_norm

    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))  # type: ignore[attr-defined]
        group = TPGroup.connect(rank, 2, store, torch.device("cpu"), timedelta(seconds=60))
        assert group.one_shot is None  # gloo: the process group's all-reduce
        shot = one_shot.OneShotAllReduce(rank, [d.data_ptr() for d in data], torch.device("cpu"), lambda: None)
        group = replace(group, one_shot=shot)
        checked = shot.self_check(group.all_reduce)
        worst, used = 0.0, []
        for it, rows in enumerate((1, 5, one_shot.MAX_ROWS + 1, 2)):
            gen = torch.Generator().manual_seed(it)
            parts = [torch.randn(rows, 64, generator=gen) for _ in range(2)]
            residual, weight = torch.randn(rows, 64, generator=gen), torch.randn(64, generator=gen)
            before = shot.epochs.clone()
            out, res = group.all_reduce_add_rms_norm(parts[rank].clone(), residual, weight, EPS, add_rms_norm)
            used.append(bool((shot.epochs != before).any()))
            ref, ref_res = all_reduce_add_rms_norm(parts, residual, weight, EPS)
            worst = max(worst, (out - ref).abs().max().item(), (res - ref_res).abs().max().item())
            # The fused one-token path's operands: the op whose prologue is the norm gets its bits.
            x, r = group.reduce_norm_operands(parts[rank].clone(), residual, weight, EPS)
            fused = add_rms_norm(x, r, weight, EPS)
            assert r is None or rows > one_shot.MAX_ROWS, "the one-shot kernel adds the residual"
            assert torch.equal(fused[0], out) and torch.equal(fused[1], res), f"call {it}: operands"
        group.shutdown()
        queue.put((rank, checked, worst, used))  # type: ignore[attr-defined]
    except BaseException as exc:
        queue.put((rank, repr(exc), None, None))  # type: ignore[attr-defined]


@pytest.mark.slow  # ranks in processes, under the Triton interpreter
def test_tp_group_takes_the_one_shot_kernel_for_calls_that_fit() -> None:
    """``TPGroup.all_reduce_add_rms_norm`` over a gloo group with one-shot buffers attached (CPU
    shared memory standing in for the IPC-mapped GPU buffers): the self-check passes, calls of at
    most ``MAX_ROWS`` rows take the kernel, a larger one the process group, all give the reference;
    ``reduce_norm_operands`` (the fused one-token path) hands the norm the operands of those bits."""
    from phloem.engine.parallel import one_shot_allreduce as one_shot

    size = 2 * one_shot.HALF_BYTES + 8 * one_shot.MAX_ROWS * 8
    data = [torch.zeros(size, dtype=torch.uint8).share_memory_() for _ in range(2)]
    port = 29000 + os.getpid() % 2000
    answers = _run_ranks(2, _group_rank, lambda r, queue: (r, port, data, queue))
    for rank, checked, worst, used in answers:
        assert checked is True, f"rank {rank}: {checked}"
        assert worst < 1e-5, f"rank {rank}: max error {worst}"
        assert used == [True, True, False, True], f"rank {rank}: one-shot taken per call {used}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the setup failure path (no libcudart loaded)")
def test_a_rank_whose_setup_fails_tells_its_peers_and_the_group_keeps_nccl() -> None:
    """Without CUDA the buffers cannot be mapped: the rank publishes an empty handle (its peers,
    blocked on ``store.get``, learn it at once instead of waiting for the store's timeout) and the
    group's vote says NCCL; not enabled (``KernelConfig.one_shot_allreduce``), nothing is attempted at all."""
    import torch.distributed as dist

    from phloem.engine.parallel import one_shot_allreduce as one_shot

    votes: list[bool] = []

    def agree(ok: bool) -> bool:
        votes.append(ok)
        return ok

    store = dist.HashStore()  # type: ignore[attr-defined]
    got = one_shot.OneShotAllReduce.connect(0, 2, torch.device("cuda", 0), store, agree, lambda t: t, enabled=True)
    assert got is None and votes == [False] and store.get("one-shot/0") == b""
    store2 = dist.HashStore()  # type: ignore[attr-defined]
    assert one_shot.OneShotAllReduce.connect(0, 2, torch.device("cuda", 0), store2, lambda ok: ok, lambda t: t) is None
    assert store2.num_keys() == 0

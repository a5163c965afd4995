"""The TP all-reduce + residual add + RMSNorm on two GPUs: one-shot NVLink kernel against NCCL.

    python3 benchmarks/sweeps/allreduce_bench.py [--iters 200]     # on a machine with two GPUs

Two processes (one per GPU) join a ``TPGroup`` as the engine does (NCCL + the one-shot buffers of
``engine.parallel.one_shot_allreduce``). For each row count it checks, on random bf16 inputs drawn afresh per call,
that the one-shot kernel gives the same bits as NCCL's all-reduce followed by the ``add_rms_norm``
kernel (exact for two ranks: both round the one sum of two bf16 values), on both ranks, eagerly
and replayed from a CUDA graph; then it times 80 calls (one decode step's worth) captured in a
graph both ways and prints µs per call. Prints a table last.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from phloem.runtime.env import use_nccl_defaults

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
HIDDEN = 2048
CALLS_PER_STEP = 80


def _inputs(seed: int, rows: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed * 7919 + rank)
    x = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
    gen.manual_seed(seed)  # the residual stream and the weight are the same on every rank
    residual = torch.randn(rows, HIDDEN, generator=gen, device=device).to(torch.bfloat16)
    weight = (torch.randn(HIDDEN, generator=gen, device=device) * 0.1).to(torch.bfloat16)
    return x, residual, weight


def _graph_us(fn, calls: int) -> float:  # type: ignore[no-untyped-def]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (and the same call count on every rank)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (reps * calls)


def _rank(rank: int, port: int, iters: int, queue) -> None:  # type: ignore[no-untyped-def]
    from phloem.engine.parallel import TPGroup
    from phloem.kernels.config import KernelConfig
    from phloem.kernels.norm.triton_norm import add_rms_norm

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))  # type: ignore[attr-defined]
    # The one-shot kernel is off by default (KernelConfig.one_shot_allreduce).
    tp = TPGroup.connect(rank, 2, store, device, timedelta(seconds=120), kernels=KernelConfig(one_shot_allreduce=True))
    assert tp.one_shot is not None, "the one-shot buffers did not map (see the warning above)"
    one_shot = tp.one_shot
    eps = 1e-6

    def nccl(x, residual, weight):  # type: ignore[no-untyped-def]
        return add_rms_norm(tp.all_reduce(x.clone()), residual, weight, eps)

    rows_out = []
    for rows in ROWS:
        mismatches, worst = 0, 0.0
        for it in range(iters):
            x, residual, weight = _inputs(it, rows, rank, device)
            got = one_shot.add_rms_norm(x, residual if it % 4 else None, weight, eps)
            want = nccl(x, residual if it % 4 else None, weight)
            for g, w in zip(got, want):
                if not torch.equal(g, w):
                    mismatches += 1
                    worst = max(worst, (g.float() - w.float()).abs().max().item())
        # Cross-rank identity of the last call's outputs.
        peer = tp.gather_list(got[0])
        same = True if peer is None else torch.equal(peer[0], peer[1])
        # Replayed from a CUDA graph: static inputs refilled, outputs compared with NCCL eagerly.
        x_s, res_s, w_s = (t.clone() for t in _inputs(0, rows, rank, device))
        graph_out: list[tuple[torch.Tensor, torch.Tensor]] = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            one_shot.add_rms_norm(x_s, res_s, w_s, eps)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out.append(one_shot.add_rms_norm(x_s, res_s, w_s, eps))
        graph_bad = 0
        for it in range(min(iters, 50)):
            x, residual, weight = _inputs(10_000 + it, rows, rank, device)
            x_s.copy_(x), res_s.copy_(residual), w_s.copy_(weight)
            graph.replay()
            want = nccl(x, residual, weight)
            graph_bad += sum(not torch.equal(g, w) for g, w in zip(graph_out[0], want))
        timing = {}
        if rows in (1, 16, 64):
            x, residual, weight = _inputs(1, rows, rank, device)
            timing["one_shot_us"] = _graph_us(lambda: one_shot.add_rms_norm(x, residual, weight, eps), CALLS_PER_STEP)
            timing["nccl_us"] = _graph_us(lambda: nccl(x, residual, weight), CALLS_PER_STEP)
        rows_out.append({"rows": rows, "mismatches": mismatches, "worst": worst, "ranks_same": same,
                         "graph_mismatches": graph_bad, **timing})  # fmt: skip
    torch.cuda.synchronize()
    tp.all_min([0])  # both ranks' kernels are done before either unmaps the other's buffer
    tp.shutdown()
    queue.put((rank, rows_out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    use_nccl_defaults()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29611
    procs = [ctx.Process(target=_rank, args=(r, port, args.iters, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    ok = True
    print("| rows | one-shot vs NCCL+norm (mismatching outputs / max diff) | graph replays | ranks equal | one-shot µs/call | NCCL+norm µs/call |")
    print("|---|---|---|---|---|---|")
    for r0, r1 in zip(results[0], results[1]):
        bad = r0["mismatches"] + r1["mismatches"]
        gbad = r0["graph_mismatches"] + r1["graph_mismatches"]
        ok &= bad == 0 and gbad == 0 and r0["ranks_same"]
        t1 = f"{r0['one_shot_us']:.1f}" if "one_shot_us" in r0 else "-"
        t2 = f"{r0['nccl_us']:.1f}" if "nccl_us" in r0 else "-"
        worst = max(r0["worst"], r1["worst"])
        print(f"| {r0['rows']} | {bad} / {worst:.3g} | {gbad} bad | {r0['ranks_same']} | {t1} | {t2} |")
    print("ALL SAME" if ok else "DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

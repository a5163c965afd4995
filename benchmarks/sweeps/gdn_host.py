"""Host time of one GDN chunked-prefill call (``kernels.gdn.fla.chunk_gated_delta_rule``) at a
mixed step's shape: where the ~1 ms a layer of Python goes, and what calling fla's forward pieces
directly (``direct``, what ``kernels.gdn.fla`` does) saves against fla's public function with its
backend dispatch, autograd Function and input guard (``public``).

    python3 benchmarks/sweeps/gdn_host.py                   # 35B-A3B GDN heads, 15 decodes + 800
    python3 benchmarks/sweeps/gdn_host.py --chunk 2048 --decodes 0

For each path: the host µs per call with the device never waited on (calls queue faster than
they run only if the host is the bottleneck: the figure is then the host's cost), the device µs per
call (CUDA events around a synchronised loop), whether the outputs equal the public path's bit for
bit, and the top functions of a cProfile of the calls (the public path's).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

HK, HV, DK, DV = 16, 32, 128, 128


def inputs(decodes: int, chunk: int, device: torch.device) -> dict:
    lens = [1] * decodes + [chunk]
    t = sum(lens)
    gen = torch.Generator(device=device).manual_seed(0)

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    slots = 64
    return dict(
        q=r(t, HK, DK), k=r(t, HK, DK), v=r(t, HV, DV),
        g=-torch.rand(t, HV, generator=gen, device=device) * 0.1, beta=torch.rand(t, HV, generator=gen, device=device).bfloat16(),
        ssm_states=r(slots, HV, DK, DV, dtype=torch.float32) * 0.01,
        query_start_loc=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=device),
        read_slots=torch.arange(len(lens), device=device), write_slots=torch.arange(len(lens), device=device) + 32,
        has_initial_state=torch.ones(len(lens), dtype=torch.bool, device=device),
    )  # fmt: skip


def public(q, k, v, g, beta, ssm_states, query_start_loc, read_slots, write_slots, has_initial_state, chunk_size=64):  # noqa: ANN001, ANN201
    """The same call through fla's public ``chunk_gated_delta_rule`` (dispatch, autograd Function,
    input guard), as ``kernels.gdn.fla`` made it before calling the forward's pieces."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    initial = torch.where(has_initial_state[:, None, None, None], ssm_states[read_slots], 0.0)
    out, final = fla_chunk(
        q[None], k[None], v[None], g[None].float(), beta[None], scale=q.shape[-1] ** -0.5, initial_state=initial,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=query_start_loc.long(),
        chunk_size=chunk_size,
    )  # fmt: skip
    ssm_states[write_slots] = final.float()
    return out[0]


def host_us(fn, args: dict, calls: int) -> float:  # noqa: ANN001
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(**args)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * host / calls


def device_us(fn, args: dict, calls: int) -> float:  # noqa: ANN001
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn(**args)
    end.record()
    end.synchronize()
    return 1000 * start.elapsed_time(end) / calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decodes", type=int, default=15)
    parser.add_argument("--chunk", type=int, default=800)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    from phloem.kernels.gdn.fla import chunk_gated_delta_rule as direct

    device = torch.device("cuda")
    base = inputs(args.decodes, args.chunk, device)
    paths = {"public": public, "direct": direct}
    outs = {}
    for name, fn in paths.items():
        a = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in base.items()}
        for _ in range(3):
            fn(**{k: (v.clone() if k == "ssm_states" else v) for k, v in a.items()})  # compile, autotune
        outs[name] = (fn(**a), a["ssm_states"])
    same = all(torch.equal(x, y) for x, y in zip(outs["public"], outs["direct"], strict=True))
    print(f"direct == public bit for bit: {same}")
    print(f"{'path':<8}{'host µs/call':>14}{'device µs/call':>16}")
    for name, fn in paths.items():
        print(f"{name:<8}{host_us(fn, base, args.calls):>14.0f}{device_us(fn, base, args.calls):>16.0f}", flush=True)
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(args.calls):
        public(**base)
    prof.disable()
    torch.cuda.synchronize()
    print(f"\ncProfile of {args.calls} public calls (tottime, top {args.top}):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

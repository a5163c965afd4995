"""``phloem bench decode --simulate-tp N``: one rank of a TP=N step, timed alone on one device.

The engine is rank 0's shard of the model (the TP loader's shapes: ``load_model`` with a group of
N ranks) whose collectives are local copies counted per step (``engine.parallel.simulated``).
There are no other ranks: the worker handle sends its step plans to nobody. Each point reports
the rank's step (engine step; on a GPU also its CUDA-graph replay, the compute side of a TP=N
step), the collectives one step issues (counted on one eager step) and two **projections**,
neither a measurement:

- measured: the rank's step + collectives × ``allreduce_us``;
- arithmetic: the rank's bytes (``benchmarks.shard_bytes``) over the copy bandwidth measured
  here + collectives × ``allreduce_us``.

``ALLREDUCE_US`` is the default latency of one collective: SGLang's custom all-reduce at TP=8 on
H100 NVLink (the H200's NVLink 4 and NVSwitch are the same fabric), 5.7 µs at 4 KB and 7.8 µs at
32 KB, rounded up (https://github.com/sgl-project/sglang/pull/2904, "unit test performance in
H100"); NCCL on the same messages takes 10-25 µs.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from phloem.benchmarks.decode import DecodeResult, measure_bandwidth, replay_ms, run_decode
from phloem.benchmarks.progress_lines import phase
from phloem.benchmarks.report import engine_switches
from phloem.benchmarks.shard_bytes import RankStep, rank_step
from phloem.engine import Engine, EngineConfig, LoadConfig, SchedulerConfig
from phloem.engine.build import bind_cuda_device
from phloem.engine.config import ModelConfig
from phloem.engine.loader import load_model
from phloem.engine.parallel.group import TPGroup, check_tp_size
from phloem.engine.parallel.simulated import CollectiveTally, SimulatedCollectives
from phloem.engine.workers import TPWorkers
from phloem.kernels.config import KernelConfig
from phloem.runtime.model_shapes import write_shape

__all__ = ["ALLREDUCE_US", "SimulatedPoint", "bench_simulated_tp", "count_step", "simulated_engine"]

ALLREDUCE_US = 8.0


@dataclass(frozen=True, slots=True)
class SimulatedPoint:
    decode: DecodeResult
    collectives: dict[str, tuple[int, int]]  # kind -> (calls, bytes) of one step
    step: RankStep  # the arithmetic (bytes, and the collectives the config implies)

    @property
    def num_collectives(self) -> int:
        return sum(n for n, _ in self.collectives.values())

    @property
    def compute_ms(self) -> float:
        """The rank's step: graph replay where there is one, else the engine step."""
        return self.decode.gpu_ms_per_step or self.decode.ms_per_step

    def projection_ms(self, allreduce_us: float) -> float:
        return self.compute_ms + self.num_collectives * allreduce_us / 1000.0


def simulated_engine(path: Path, config: EngineConfig, tp_size: int, expert_parallel: bool = False) -> Engine:
    """Rank 0 of ``tp_size`` of the model at ``path``, alone on ``config.load.device``, its
    collectives ``SimulatedCollectives`` (the tally: ``engine.workers.group.pg.tally``).

    Raises:
        ValueError: ``tp_size`` does not shard the model (``check_tp_size``'s message).
    """
    device = torch.device(config.load.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    mc = ModelConfig.from_pretrained(path)
    # The divisibility checks only: the other ranks' GPUs are not needed.
    check_tp_size(mc, tp_size, torch.device("cpu"), expert_parallel)
    group = TPGroup(0, tp_size, device, SimulatedCollectives(tp_size), expert_parallel)
    bind_cuda_device(device)
    model = load_model(path, mc, config.load, group, kernels=config.kernels)
    dtype = next(model.parameters()).dtype
    return Engine(mc, model, config, device, dtype, TPWorkers(group, [], [], None))


def count_step(engine: Engine, tally: CollectiveTally) -> dict[str, tuple[int, int]]:
    """The collectives of one ``engine.step()`` of the running requests, run eagerly (a no-op
    layer hook keeps it off the CUDA graphs, whose replays call no Python)."""
    runner = engine.runner
    assert runner.layer_hook is None, "count_step needs the layer hook slot free"
    engine.drain()
    runner.layer_hook = lambda out: (lambda layer: None)
    tally.reset()
    try:
        engine.step()
        engine.drain()
    finally:
        runner.layer_hook = None
    return tally.snapshot()


def bench_simulated_tp(
    shape: str, model: Path | None, device: str, batches: tuple[int, ...], contexts: tuple[int, ...], steps: int,
    tp_size: int, expert_parallel: bool = False, allreduce_us: float = ALLREDUCE_US, out_json: Path | None = None,
    kernels: KernelConfig = KernelConfig(), show_progress: bool | None = None,
) -> str:
    """Time rank 0 of ``tp_size`` over the batch × context grid; returns the Markdown report."""
    cuda = device.startswith("cuda")
    load = LoadConfig(load_format="safetensors" if model else "dummy", device=device,
                      dtype="bfloat16" if cuda else "auto", show_progress=show_progress)
    config = EngineConfig(load=load, scheduler=SchedulerConfig(max_num_batched_tokens=8192 if cuda else None,
                                                               max_num_seqs=max(batches)), kernels=kernels)
    phase(f"building rank 0 of {tp_size} ({shape if model is None else model}, {device})")
    with tempfile.TemporaryDirectory() as tmp:
        engine = simulated_engine(model or write_shape(shape, Path(tmp)), config, tp_size, expert_parallel)
    if cuda:
        engine.runner.caches.kv.normal_()  # never time on zeros
    tally = engine.workers.group.pg.tally  # type: ignore[union-attr]
    bandwidth = measure_bandwidth(engine.device, nbytes=(2 << 30) if cuda else (64 << 20))
    element_size = engine.dtype.itemsize
    points: list[SimulatedPoint] = []
    for context in contexts:
        for batch in batches:
            phase(f"batch {batch}, context {context}")
            counted: list[dict[str, tuple[int, int]]] = []
            result = run_decode(engine, batch, context, bandwidth, steps=steps, compare_sync=False,
                                before_timing=lambda: counted.append(count_step(engine, tally)))
            graphs = engine.runner.graphs
            if graphs is not None and batch <= graphs.max_batch_size():
                result = replace(result, gpu_ms_per_step=replay_ms(graphs.graphs[graphs.bucket(batch)][0], 20))
            arithmetic = rank_step(engine.model_config, tp_size, batch, context, "bf16", expert_parallel,
                                   element_size=element_size)
            points.append(SimulatedPoint(result, counted[0], arithmetic))
    name = shape if model is None else str(model)
    switches = engine_switches(engine)
    report = ", ".join(f"{k} {v}" for k, v in switches.items()) + "\n"
    report += simulated_table(name, device, tp_size, expert_parallel, bandwidth, allreduce_us, points)
    if out_json is not None:
        out_json.write_text(json.dumps({
            "shape": name, "switches": switches, "simulate_tp": tp_size, "expert_parallel": expert_parallel, "bandwidth": bandwidth,
            "allreduce_us": allreduce_us,
            "points": [{"decode": asdict(p.decode), "collectives": p.collectives, "arithmetic": asdict(p.step),
                        "projection_ms": p.projection_ms(allreduce_us)} for p in points],
        }, indent=2))  # fmt: skip
    engine.close()
    return report


def simulated_table(name: str, device: str, tp_size: int, expert_parallel: bool, bandwidth: float,
                    allreduce_us: float, points: list[SimulatedPoint]) -> str:
    mode = "TP+EP" if expert_parallel else "TP"
    lines = [
        f"rank 0 of {mode}={tp_size}, {name} on {device} (one process; collectives replaced by local copies): "
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; PROJECTION = rank step + collectives × {allreduce_us:g} µs "
        "(--allreduce-us), not a measurement",
        "",
        "| batch | context | rank ms/step | rank GPU ms (graph) | collectives/step | all-reduce KB/step | gather KB/step "
        "| rank GB/step | roofline ms | fraction of roofline | projection ms | collectives' share | projection tok/s "
        "per user | arithmetic projection ms |",
        "|" + "---|" * 14,
    ]
    for p in points:
        d, s = p.decode, p.step
        reduce_kb = p.collectives.get("all_reduce", (0, 0))[1] / 1e3
        gather_kb = p.collectives.get("gather", (0, 0))[1] / 1e3
        gpu = f"{d.gpu_ms_per_step:.3f}" if d.gpu_ms_per_step else "-"
        projection = p.projection_ms(allreduce_us)
        roofline = s.roofline_ms(bandwidth)
        wire = p.num_collectives * allreduce_us / 1000.0
        lines.append(
            f"| {d.batch} | {d.context} | {d.ms_per_step:.3f} | {gpu} | {p.num_collectives} | {reduce_kb:.1f} "
            f"| {gather_kb:.1f} | {s.total / 1e9:.3f} | {roofline:.3f} | {roofline / p.compute_ms:.0%} "
            f"| {projection:.3f} | {wire / projection:.0%} | {1000 / projection:.0f} "
            f"| {s.projection_ms(bandwidth, allreduce_us):.3f} |"
        )
    return "\n".join(lines)

"""The worker ranks of a tensor-parallel engine: spawn, handshake, step plans, shutdown.

Rank 0 is the calling process: it owns the ``Engine`` (scheduler, radix cache, pool bookkeeping,
sampling). Ranks 1..N-1 are spawned processes (``torch.multiprocessing``, spawn context); each
loads its shard, allocates caches of the same shape as rank 0's, then loops: receive a
``StepPlan``, replay its page copies, run the forward, whose collectives pair with rank 0's.

Two channels per worker::

    control  a multiprocessing Pipe: handshake messages, step plans (bytes), shutdown (b"").
             Waiting on a pipe costs nothing while the engine idles (a collective would time
             out), and a worker whose rank 0 died reads EOF and exits.
    data     the c10d process group (gloo on CPU, NCCL on CUDA), meeting at a TCPStore that
             rank 0 binds on a free loopback port.

NCCL's settings are the process environment's, which the workers inherit through spawn; this
module reads and writes none. The runtime sets its defaults (``NCCL_NVLS_ENABLE=0``) before it
builds an engine (``runtime.env.use_nccl_defaults``).

Startup::

    rank 0: bind store, spawn ──▶ wait "hello" ──▶ join group ──▶ load shard ──▶ wait "ready" ──▶ size pools ──▶ send "start" ──▶ capture
    rank r:        import ──▶ send "hello" ──▶ join group ──▶ load shard ──▶ send "ready" ──▶ size pools ──▶ wait "start" ──▶ capture ──▶ serve

"start" carries the CUDA-graph settings rank 0 chose after sizing its pools (bucket limit,
padding page and slot) or None; every rank then captures the same buckets together, since the
warm-up forwards inside a capture run the collectives.

A worker that fails before "ready" sends its traceback and rank 0 raises ``EngineError`` with it,
rather than hanging in a collective. Workers are daemonic and also stopped by a finalizer when
their handle is garbage-collected, so no path leaks a process.

Why this lives in ``engine``: ``Engine.from_pretrained(path, parallel=ParallelConfig(N))`` must
start the ranks, and ``engine`` may not import ``runtime``. Why beside ``engine.build`` rather than in
``engine.parallel``: a worker builds a whole rank (loader, model runner), which sit above the
parallel layer the models import; ``engine.parallel`` stays low level.
"""

from __future__ import annotations

import time
import traceback
import weakref
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from phloem.engine.config import CacheConfig, LoadConfig, ModelConfig, RunnerConfig, SpeculativeConfig
from phloem.engine.errors import EngineError
from phloem.engine.loader import load_model
from phloem.engine.model_runner import build_runner
from phloem.engine.parallel.group import TPGroup
from phloem.engine.speculative import extra_kv_layers
from phloem.engine.speculative_ranks import SpeculativeRanks
from phloem.engine.step_plan import StepPlan, decode_plan, encode_plan
from phloem.kernels.config import KernelConfig

__all__ = ["TPWorkers", "WorkerSpec", "rank_device"]

_HOST = "127.0.0.1"
# Bounds one collective (and joining the group); idle time between steps waits on the pipe.
_COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# How long the workers together get to exit after the shutdown message before they are terminated:
# seven ranks tearing down torch at once on a loaded two-core machine took over 5 s. Only a worker
# stuck in a collective (rank 0 failed mid-step) makes ``close`` wait it out.
_EXIT_TIMEOUT_S = 20.0
_JOIN_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every rank builds from: the model folder and the engine's configs (rank 0's device).
    ``kernels`` reaches every rank's op table, attention backend and group (one-shot all-reduce);
    ``speculative``: each rank loads its shard of the MTP layer and its KV layer when it drafts."""

    path: str
    model_config: ModelConfig
    load_config: LoadConfig
    cache_config: CacheConfig
    runner_config: RunnerConfig
    tp_size: int
    num_threads: int
    expert_parallel: bool = False
    kernels: KernelConfig = KernelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``r`` runs on the ``r``-th GPU from ``device`` (CPU ranks share the CPU)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1, and rank 0's ``TPGroup``.

    Use ``launch``, then load rank 0's shard with ``group``, then ``wait_ready``; ``send`` each
    step's plan; ``close`` (idempotent) stops the processes.
    """

    def __init__(self, group: TPGroup, processes: list[Any], conns: list[Connection], store: Any) -> None:
        self.group = group
        self.processes = processes
        self._conns = conns
        self._store = store
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop, group, processes, conns)

    @classmethod
    def launch(cls, spec: WorkerSpec) -> TPWorkers:
        """Spawn ranks 1..N-1 and join the group as rank 0 (blocks until every rank joined)."""
        device = rank_device(torch.device(spec.load_config.device), 0)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            _HOST, 0, spec.tp_size, is_master=True, wait_for_workers=False, timeout=_COLLECTIVE_TIMEOUT
        )
        ctx = mp.get_context("spawn")
        processes, conns = [], []
        try:
            for rank in range(1, spec.tp_size):
                ours, theirs = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, args=(rank, spec, store.port, theirs), name=f"phloem-tp{rank}", daemon=True
                )
                proc.start()
                theirs.close()
                processes.append(proc)
                conns.append(ours)
            for rank, (proc, conn) in enumerate(zip(processes, conns), start=1):
                _expect(rank, proc, conn, "hello")
            group = TPGroup.connect(
                0, spec.tp_size, store, device, _COLLECTIVE_TIMEOUT, spec.expert_parallel, spec.kernels
            )
        except BaseException:
            _stop(None, processes, conns)
            raise
        return cls(group, processes, conns, store)

    def wait_ready(self) -> None:
        """Block until every worker loaded its shard.

        Raises:
            EngineError: a worker failed to start (its traceback is in the message).
        """
        for rank, (proc, conn) in enumerate(zip(self.processes, self._conns), start=1):
            _expect(rank, proc, conn, "ready")

    def start(self, graphs: tuple[int, int, int] | None) -> None:
        """Let the workers serve, first capturing CUDA graphs with ``(max batch, pad page, pad slot)``."""
        for conn in self._conns:
            conn.send(("start", graphs))

    def send(self, plan: StepPlan) -> None:
        """Send one step's plan to every worker.

        Raises:
            EngineError: the workers were closed, or one has died.
        """
        if self._closed:
            raise EngineError("tensor-parallel engine: its workers were closed")
        data = encode_plan(plan)
        for rank, (proc, conn) in enumerate(zip(self.processes, self._conns), start=1):
            if conn.poll() or not proc.is_alive():
                raise EngineError(f"tensor-parallel rank {rank} died: {_last_words(conn, proc)}")
            conn.send_bytes(data)

    def close(self) -> None:
        """Stop the workers and wait for them (terminating any that hang)."""
        self._closed = True
        self._finalizer()


def _expect(rank: int, proc: Any, conn: Connection, kind: str) -> None:
    exited = f"tensor-parallel rank {rank} exited before {kind!r}"
    if kind == "hello":
        # NOTE: the spawn start method re-imports the parent's main module in every worker.
        exited += (
            "; a script that starts a tensor-parallel engine must do so under "
            "`if __name__ == '__main__':` and be a file (not stdin)"
        )
    while not conn.poll(0.05):
        if not proc.is_alive() and not conn.poll():
            raise EngineError(f"{exited} (exit code {proc.exitcode})")
    try:
        message = conn.recv()
    except EOFError:
        raise EngineError(exited) from None
    if message[0] != kind:
        raise EngineError(f"tensor-parallel rank {rank} failed to start:\n{message[1]}")


def _last_words(conn: Connection, proc: Any) -> str:
    if conn.poll():
        try:
            return str(conn.recv()[1])
        except EOFError:
            pass
    return f"exit code {proc.exitcode}"


def _stop(group: TPGroup | None, processes: list[Any], conns: list[Connection]) -> None:
    for conn in conns:
        try:
            conn.send_bytes(b"")
        except (BrokenPipeError, OSError):
            pass  # that worker is already gone
    deadline = time.monotonic() + _EXIT_TIMEOUT_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(_JOIN_TIMEOUT_S)
    for conn in conns:
        conn.close()
    if group is not None:
        group.shutdown()


def _worker_main(rank: int, spec: WorkerSpec, port: int, conn: Connection) -> None:
    """Entry point of rank ``rank`` (a spawned process)."""
    group: TPGroup | None = None
    try:
        torch.set_num_threads(spec.num_threads)
        device = rank_device(torch.device(spec.load_config.device), rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore(  # type: ignore[attr-defined]
            _HOST, port, spec.tp_size, is_master=False, timeout=_COLLECTIVE_TIMEOUT
        )
        conn.send(("hello", None))
        group = TPGroup.connect(
            rank, spec.tp_size, store, device, _COLLECTIVE_TIMEOUT, spec.expert_parallel, spec.kernels
        )
        # Rank 0 draws the one progress bar; a worker's would garble it.
        load_config = replace(spec.load_config, device=str(device), show_progress=False)
        model = load_model(spec.path, spec.model_config, load_config, group, spec.kernels, spec.speculative)
        conn.send(("ready", None))
        dtype = next(model.parameters()).dtype
        runner, _ = build_runner(
            spec.model_config, model, spec.cache_config, spec.runner_config, group, dtype, kernels=spec.kernels,
            extra_kv_layers=extra_kv_layers(spec.speculative, spec.model_config),
        )
        ranks = SpeculativeRanks(runner) if spec.speculative.enabled else None
        kind, graphs = conn.recv()
        assert kind == "start", f"expected 'start' from rank 0, got {kind!r}"
        if graphs is not None:
            runner.enable_cuda_graphs(*graphs, show_progress=False)
        while data := conn.recv_bytes():
            plan = decode_plan(data)
            if plan.spec is not None:
                assert ranks is not None, "a speculative plan reached a worker that does not speculate"
                ranks.follow(plan)
            else:
                runner.run_plan(plan)
    except EOFError:
        return  # rank 0 is gone
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
        raise
    finally:
        if group is not None:
            group.shutdown()
        conn.close()

"""Buffers every GPU of a tensor-parallel group has mapped, for the one-shot all-reduce + norm.

``OneShotAllReduce.connect`` runs on every rank while the group forms (``TPGroup.connect``): each
rank allocates one device buffer with ``cudaMalloc`` (two halves of ``HALF_BYTES`` for the data,
by epoch parity, then its flags: int64 ``[world, MAX_ROWS]``, zeroed), publishes its CUDA IPC
handle in the group's store, and opens every peer's with ``cudaIpcMemLazyEnablePeerAccess`` on its
own device (the peer's memory becomes addressable from this GPU over NVLink). The kernel
(``kernels.norm.triton_allreduce``) gets the table of addresses and this rank's epoch counters.

Decisions:

- The ranks agree before anyone uses it: every rank reports whether its setup worked and the group
  takes the minimum, so either all ranks run the one-shot kernel or all take NCCL (a mix would
  deadlock: both sides must run the same collective).
- Used only where it pays and fits: decode-sized calls (at most ``MAX_ROWS`` rows and ``HALF_BYTES``
  per call); larger batches (prefill) take NCCL's all-reduce and the ``add_rms_norm`` kernel.
- Off by default until it has run on two GPUs: ``KernelConfig.one_shot_allreduce`` turns it on
  (``connect``'s ``enabled``). Its protocol is tested on CPU by concurrent processes under the
  Triton interpreter and it compiles for sm_90, but a kernel that spins on another GPU's flags
  must be seen to work there before it is the default. Off: NCCL.
- Inside the decode step's PDL chain where the op table is (``KernelConfig.pdl``, sm_90+): the kernel
  waits for the kernel before it first, so the fused one-token path's GEMVs around it keep their
  early launch; NCCL's all-reduce, the fallback, is a launch of its own outside the chain.
- The CUDA runtime calls go through ``engine.parallel.cuda_ipc`` (PyTorch's own libcudart, by ctypes);
  without peer access between every pair of the group's GPUs the group keeps NCCL.
- The buffers live as long as the process group; ``close`` unmaps the peers' (this rank's own
  2 MiB stay allocated until the process ends, see ``close`` in ``_map``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from phloem.engine.parallel.cuda_ipc import CudaRuntime, IpcHandle

__all__ = ["HALF_BYTES", "MAX_ROWS", "OneShotAllReduce"]

log = logging.getLogger(__name__)

MAX_ROWS = 256
HALF_BYTES = 1 << 20  # 256 tokens x hidden 2048 x bf16
_FLAGS_AT = 2 * HALF_BYTES
_WORLD_MAX = 8


class OneShotAllReduce:
    """This rank's view of the mapped buffers: address tables and epoch counters on its GPU."""

    def __init__(
        self, rank: int, addresses: Sequence[int], device: torch.device, close: Callable[[], None], pdl: bool = False
    ) -> None:
        self.rank = rank
        self.pdl = pdl  # launched under programmatic dependent launch, in the decode step's chain
        self.world = len(addresses)
        self.buffers = torch.tensor(list(addresses), dtype=torch.int64, device=device)
        self.flags = torch.tensor([a + _FLAGS_AT for a in addresses], dtype=torch.int64, device=device)
        self.epochs = torch.zeros(MAX_ROWS, dtype=torch.int64, device=device)
        self._close = close

    @classmethod
    def connect(
        cls,
        rank: int,
        world: int,
        device: torch.device,
        store: Any,
        agree: Callable[[bool], bool],
        all_reduce: Callable[[torch.Tensor], torch.Tensor],
        enabled: bool = False,
        pdl: bool = False,
    ) -> OneShotAllReduce | None:
        """Map every rank's buffer on this rank; None on every rank unless ``enabled`` (the same on
        every rank: ``KernelConfig.one_shot_allreduce``), all of them succeeded and a first call
        gave the process group's all-reduce's bits on every rank.

        ``store`` is a c10d store shared by the group (keys ``one-shot/<rank>``); ``agree(ok)``
        returns whether every rank's ``ok`` is true and ``all_reduce`` sums a tensor over the
        ranks (collectives: every rank calls them alike). ``pdl``: the kernel launches under
        programmatic dependent launch (``kernels/common/pdl.py``; the same on every rank).
        """
        made: OneShotAllReduce | None = None
        ok = False
        if enabled and device.type == "cuda" and 1 < world <= _WORLD_MAX:
            try:
                made = cls._map(rank, world, device, store, pdl)
                ok = True
            except Exception as exc:  # noqa: BLE001 - any setup failure means: use NCCL
                log.warning("one-shot all-reduce unavailable on rank %d (%s); using NCCL", rank, exc)
        if agree(ok):
            assert made is not None
            if agree(made.self_check(all_reduce)):
                return made
            log.warning("one-shot all-reduce disagreed with the process group's all-reduce; using NCCL")
        if made is not None:
            made.close()
        return None

    def self_check(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> bool:
        """One call on a known input against ``all_reduce``: the mapping and the flags work."""
        device = self.buffers.device
        x = (torch.arange(4 * 128, device=device).view(4, 128) % 37 + self.rank).to(torch.bfloat16)
        _, summed = self.add_rms_norm(x, None, torch.zeros(128, device=device), 1e-6)
        return bool(torch.equal(summed, all_reduce(x.clone())))

    @classmethod
    def _map(cls, rank: int, world: int, device: torch.device, store: Any, pdl: bool) -> OneShotAllReduce:
        key = f"one-shot/{rank}"
        cudart: CudaRuntime | None = None
        own: int | None = None
        try:
            cudart = CudaRuntime()
            index = device.index if device.index is not None else torch.cuda.current_device()
            for peer in range(world):  # rank r runs on the r-th GPU from rank 0's (workers.rank_device)
                other = index - rank + peer
                if peer != rank and not torch.cuda.can_device_access_peer(index, other):
                    raise RuntimeError(f"cuda:{index} cannot access cuda:{other} (no P2P)")
            torch.cuda.set_device(index)
            cudart.set_device(index)
            own = cudart.malloc_zeroed(_FLAGS_AT + _WORLD_MAX * MAX_ROWS * 8)
            handle = cudart.ipc_handle(own).data
        except BaseException:
            store.set(key, b"")  # the peers waiting for this rank's handle learn it failed
            if cudart is not None and own is not None:
                cudart.free(own)
            raise
        assert own is not None
        opened: list[int] = []

        def close() -> None:
            # Unmap the peers' buffers once this GPU's kernels are done with them. This rank's
            # own buffer is left to the process's end: a peer's last kernel may still be reading
            # it (ranks shut down one after the other), and freeing it first would fault there.
            torch.cuda.synchronize(index)
            for ptr in opened:
                cudart.ipc_close(ptr)

        try:
            store.set(key, handle)
            addresses = []
            for peer in range(world):
                if peer == rank:
                    addresses.append(own)
                    continue
                theirs = bytes(store.get(f"one-shot/{peer}"))
                if not theirs:
                    raise RuntimeError(f"rank {peer} could not set up its buffer")
                ptr = cudart.ipc_open(IpcHandle(theirs))
                opened.append(ptr)
                addresses.append(ptr)
        except BaseException:
            close()
            raise
        return cls(rank, addresses, torch.device("cuda", index), close, pdl)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether one call with ``x`` (this rank's partial sum ``[..., D]``) fits the buffers."""
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        return rows <= MAX_ROWS and x.numel() * x.element_size() <= HALF_BYTES

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(all_reduce(x), residual, weight, eps)`` in one kernel (every rank calls it)."""
        from phloem.kernels.norm.triton_allreduce import one_shot_add_rms_norm

        half = HALF_BYTES // x.element_size()
        return one_shot_add_rms_norm(
            x, residual, weight, eps, self.buffers, self.flags, self.epochs, self.rank, half, pdl=self.pdl
        )

    def close(self) -> None:
        self._close()
        self._close = lambda: None

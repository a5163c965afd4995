"""The engine's operations on cached prefixes, apart from the step loop: pin a session's head,
export/import a prefix (spill and resume), and the two sides of a disaggregated prefill.

``Engine`` inherits them; each runs between steps on the engine's thread, and each that reads or
writes pool memory first ``drain``s the async pipeline and the queued import copies, so no queued
step or copy races it (a TP=1 import itself drains nothing: ``engine.cache.import_fences``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from phloem.engine.cache.radix import RadixNode
from phloem.engine.transfer import pool_side
from phloem.engine.transfer.pool_side import TransferReservation, TransferSource
from phloem.engine.transfer.prefix_export import HostAlloc, PrefixState, export_prefix, import_prefix

if TYPE_CHECKING:
    from phloem.engine.cache.manager import CacheManager
    from phloem.engine.model_runner import ModelRunner
    from phloem.engine.sampling.params import SamplingParams

__all__ = ["PrefixOps"]


class PrefixOps:
    """Prefix and transfer operations of ``Engine`` (which provides the attributes below)."""

    cache: CacheManager
    runner: ModelRunner

    drain: Callable[[], None]  # settle the async pipeline before touching pool memory
    _validate: Callable[[Sequence[int], SamplingParams], list[int]]  # add_request's checks

    def pin_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> RadixNode | None:
        """Pin the deepest checkpoint within ``token_ids`` cached in ``namespace`` (a session's
        head) against eviction.

        Returns an opaque handle for ``unpin_prefix``, or None when nothing of it is cached. The
        pin takes over a turn-end hold of that node (``engine.cache.holds``).
        """
        tree = self.cache.tree
        if tree is None:
            return None
        match = tree.match(list(token_ids), len(token_ids), namespace)
        if match is None:
            return None
        tree.lock(match.node)
        self.cache.holds.release(match.node)
        return match.node

    def unpin_prefix(self, handle: RadixNode) -> None:
        assert self.cache.tree is not None, "unpin without a prefix cache"
        self.cache.tree.unlock(handle)

    def cached_prefix_len(self, token_ids: Sequence[int], namespace: str | None = None) -> int:
        """How many leading tokens of ``token_ids`` a new request in ``namespace`` would take from the cache."""
        tree = self.cache.tree
        match = tree.match(list(token_ids), len(token_ids) - 1, namespace) if tree is not None and token_ids else None
        return match.num_tokens if match else 0

    def export_prefix(self, token_ids: Sequence[int], namespace: str | None = None,
                      host_alloc: HostAlloc | None = None) -> PrefixState | None:
        """Host copies of the KV pages and head checkpoint of the deepest prefix of ``token_ids``
        cached in ``namespace`` (for spilling a session), in the TP=1 layout whatever the
        tensor-parallel size (``engine.parallel.state_shards``); None when nothing of it is cached.
        ``host_alloc`` gives the copies' memory where it can (``engine.transfer.prefix_export``)."""
        self.drain()
        return export_prefix(self.cache, self.runner.read_state, list(token_ids), namespace, host_alloc)

    def import_prefix(self, state: PrefixState, namespace: str | None = None) -> bool:
        """Load a spilled prefix into fresh pages and a fresh slot and publish it in the radix
        cache, in ``namespace``; False (taking nothing) when no room can be made.

        At TP=1 the copy is queued beside the steps, without draining the pipeline
        (``engine.cache.import_fences``); under tensor parallelism (a collective with the
        worker ranks) the pipeline is drained and the copy runs between two steps.

        Raises:
            ValueError: the tensors do not have this model's (TP=1 layout) shapes.
        """
        shapes = self.runner.state_shapes
        if self.runner.tp.size == 1:
            return import_prefix(self.cache, state, shapes, self.runner.write_state_async, namespace, fenced=True)
        self.drain()
        return import_prefix(self.cache, state, shapes, self.runner.write_state, namespace)

    def reserve_transfer(
        self, token_ids: Sequence[int], params: SamplingParams, local_up_to: int = 0, namespace: str | None = None
    ) -> TransferReservation | None:
        """Decode side of a disaggregated prefill: lock the cached prefix of ``token_ids`` and
        reserve pages and a state slot for the rest (``engine.transfer.pool_side``), in ``namespace``.

        Returns None (taking nothing) when a prefix is cached and at most ``local_up_to`` tokens
        lie past it (compute them here), or when no room can be made. Every reservation ends in
        ``install_transfer`` or ``release_transfer``.

        Raises:
            InvalidRequest, CapacityExceeded: as ``add_request`` would for this prompt.
        """
        prompt = self._validate(token_ids, params)
        self.drain()
        return pool_side.reserve(self.cache, prompt, local_up_to, namespace)

    def install_transfer(
        self, reservation: TransferReservation, kv: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
    ) -> None:
        """Copy a transferred prompt's KV (``[attn_layers, reserved pages, 2, ps, Hkv, D]``) and
        final GDN state, in the TP=1 layout, into the reservation (every rank's part under tensor
        parallelism) and publish it in the prefix cache.

        Raises:
            ValueError: the tensors do not match the reservation (it is left as it was).
        """
        self.drain()
        pool_side.install(self.cache, self.runner.state_shapes, self.runner.write_state, reservation, kv, conv, ssm)

    def release_transfer(self, reservation: TransferReservation) -> None:
        """Give back what ``reserve_transfer`` took (idempotent; a no-op after install)."""
        self.drain()
        pool_side.release(self.cache, reservation)

    def transfer_source(
        self, token_ids: Sequence[int], first_page: int, namespace: str | None = None
    ) -> TransferSource | None:
        """Prefill side: the pages (from ``first_page``) and state slot of the checkpoint at the end
        of ``token_ids``, as a prefill-only request in ``namespace`` published it (read in the
        TP=1 layout); None when it is not cached."""
        self.drain()
        return pool_side.transfer_source(self.cache, self.runner.read_state, list(token_ids), first_page, namespace)

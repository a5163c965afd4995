"""The pool side of a prefill/decode transfer: reserve, install or release (decode); read (prefill).

Decode side. Before asking the prefill instance, the decode engine locks the deepest checkpoint
it holds within the prompt (``held_len`` tokens), and reserves one state slot plus the pages the
transfer will fill. Pages before ``first_page`` stay the tree's; the transfer rewrites the whole
page ``first_page`` (its positions before ``held_len`` come back identical to the held tail)::

    prompt:  |<------------- held_len ------------->|<------ computed by prefill ------>|
    pages:   [ tree p0 ][ tree p1 ][ reserved r0 (held tail | new) ][ r1 ][ r2 (partial) ]
             |<-- first_page = held_len // ps -->|

``install`` copies the received KV into the reserved pages and the state into the reserved slot,
then publishes them in the radix tree exactly as a finished request would (checkpoint at the
prompt's end, the partial last page as its tail page), and unlocks the held prefix: a request on
this prompt is then a cache hit. ``release`` gives everything back untouched (any failure).
Pages the tree gained meanwhile for the same positions win; the duplicates are freed by the
tree's insert, as for a request.

Prefill side. ``stream_hook`` (a ``ModelRunner.layer_hook``) copies each full-attention layer's
pages from ``first_page`` on during the request's last prefill step, right after that layer's
forward: every page of the prompt is final for that layer then (earlier chunks wrote the pages
before, this step the rest), so the copy can travel while the later layers compute::

    last step:  attn layer 0 ─▶ emit(0, kv0) │ GDN/MLP layers … │ attn layer 1 ─▶ emit(1, kv1) │ …
    earlier steps, other requests' steps, decode steps: no hook (one None check)

These are the request's own pages. The tree may keep older copies of the same positions when it
publishes (a duplicate prefix computed without a checkpoint in it), which is as good a KV for
the prompt; the stream sends what this request computed, consistent with its GDN state.
``transfer_source`` finds the checkpoint a prefill-only request published at the prompt's end and
lists the pages from ``first_page`` on; ``whole`` and ``state`` read them. The prefill worker
owns its engine alone while it sends, so nothing can evict them meanwhile.

Tensor parallelism. Every tensor crosses the link in the TP=1 layout (all KV heads, all GDN
channels), whatever either side's TP size, like a spilled session (``engine.parallel.state_shards``): the
decode side's ``install`` writes through ``ModelRunner.write_state`` (each rank gets its part)
and the prefill side reads through ``ModelRunner.read_state`` (rank 0 gathers the parts). Under
TP the prefill side cannot stream during the forward (the hook sees rank 0's heads only): it
sends every layer once the prompt is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from phloem.engine.cache.manager import CacheManager
from phloem.engine.cache.radix import Checkpoint, RadixCache, RadixNode
from phloem.engine.forward_batch import ModelCaches
from phloem.engine.model_runner import AttnLayerHook, StepLayerHook
from phloem.engine.parallel.state_shards import StateTensors
from phloem.engine.scheduler import SchedulerOutput

# ModelRunner.read_state / write_state / state_shapes: whole (TP=1 layout) state, every rank.
ReadState = Callable[[list[int], int], StateTensors]
WriteState = Callable[[list[int], int, StateTensors], None]
StateShapes = Callable[[int], tuple[tuple[int, ...], ...]]

__all__ = [
    "TransferReservation", "TransferSource", "install", "release", "reserve", "stream_hook", "transfer_source",
]


@dataclass(eq=False, slots=True)
class TransferReservation:
    """What the decode engine holds for one transfer until ``install`` or ``release``."""

    token_ids: tuple[int, ...]
    held_len: int
    first_page: int
    held_pages: tuple[int, ...]  # tree pages [0, first_page), kept alive by lock_node
    pages: list[int]  # reserved: page indices first_page .. ceil(N / ps) - 1
    slot: int
    lock_node: RadixNode | None
    namespace: str | None = None  # the prefix-cache namespace it is published in
    done: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _tree(cache: CacheManager) -> RadixCache:
    assert cache.tree is not None, "prefill/decode transfers need the prefix cache"
    return cache.tree


def reserve(
    cache: CacheManager, token_ids: list[int], local_up_to: int = 0, namespace: str | None = None
) -> TransferReservation | None:
    """Lock the prefix held in ``namespace`` and reserve pages and a slot for the rest of ``token_ids``.

    Returns None (taking nothing) when a prefix is held and at most ``local_up_to`` tokens lie
    past it (this side holds the conversation: it computes the few new tokens itself), or when
    the pools cannot make room even after eviction.
    """
    tree, n, ps = _tree(cache), len(token_ids), cache.page_size
    assert n >= 1, "a transfer needs at least one token"
    match = tree.match(token_ids, n - 1, namespace)
    held = match.num_tokens if match else 0
    if held and n - held <= local_up_to:
        return None
    if match is not None:
        tree.lock(match.node)
    first_page = held // ps
    slot = cache.allocate_slot()
    pages = cache.allocate_page_list(-(-n // ps) - first_page) if slot is not None else None
    if slot is None or pages is None:
        if slot is not None:
            cache.slot_pool.free(slot)
        if match is not None:
            tree.unlock(match.node)
        return None
    held_pages = match.pages[:first_page] if match else ()
    node = match.node if match else None
    return TransferReservation(tuple(token_ids), held, first_page, held_pages, pages, slot, node, namespace)


def install(cache: CacheManager, shapes: StateShapes, write: WriteState, res: TransferReservation,
            kv: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
    """Copy the received (TP=1 layout) state into the reservation on every rank and publish it at
    the prompt's end.

    Raises:
        ValueError: a tensor does not match the reservation (nothing is taken or changed then).
    """
    assert not res.done, "transfer reservation used twice"
    expect = shapes(len(res.pages))
    got = (tuple(kv.shape), tuple(conv.shape), tuple(ssm.shape))
    if got != expect:
        raise ValueError(f"transfer: expected kv, conv, ssm of shapes {expect}; got {got}")
    write(list(res.pages), res.slot, (kv, conv, ssm))
    ps, n = cache.page_size, res.num_tokens
    full = n // ps
    own_full = full - res.first_page
    tail = res.pages[own_full] if n % ps else None
    res.done = True
    pages = list(res.held_pages) + res.pages[:own_full]
    _tree(cache).insert(list(res.token_ids), pages, Checkpoint(res.slot, tail), res.namespace)
    _unlock(cache, res)


def release(cache: CacheManager, res: TransferReservation) -> None:
    """Give back the reserved pages and slot and unlock the held prefix (idempotent)."""
    if res.done:
        return
    res.done = True
    cache.page_pool.free(res.pages)
    cache.slot_pool.free(res.slot)
    _unlock(cache, res)


def _unlock(cache: CacheManager, res: TransferReservation) -> None:
    if res.lock_node is not None:
        _tree(cache).unlock(res.lock_node)
        res.lock_node = None


@dataclass(frozen=True, slots=True)
class TransferSource:
    """Where the prefill engine holds a prompt's state: its pages from ``first_page`` on, its slot;
    read in the TP=1 layout (gathered from every rank under tensor parallelism)."""

    pages: tuple[int, ...]
    slot: int
    read: ReadState

    def whole(self) -> StateTensors:
        """KV ``[attn_layers, len(pages), 2, page_size, kv_heads, head_dim]`` and copies of the conv
        and recurrent state at the prompt's end (one collective under tensor parallelism)."""
        kv, conv, ssm = self.read(list(self.pages), self.slot)
        return kv, conv.clone(), ssm.clone()

    def state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the conv and recurrent state at the prompt's end, every GDN layer (no KV read)."""
        _, conv, ssm = self.read([], self.slot)
        return conv.clone(), ssm.clone()


def transfer_source(
    cache: CacheManager, read: ReadState, token_ids: list[int], first_page: int, namespace: str | None = None
) -> TransferSource | None:
    """The checkpoint at exactly ``len(token_ids)`` in ``namespace`` and its pages from
    ``first_page``; None if absent."""
    n = len(token_ids)
    match = _tree(cache).match(token_ids, n, namespace)
    if match is None or match.num_tokens != n or not 0 <= first_page <= n // cache.page_size:
        return None
    pages = list(match.pages)
    if match.checkpoint.tail_page is not None:
        pages.append(match.checkpoint.tail_page)
    return TransferSource(tuple(pages[first_page:]), match.checkpoint.slot, read)


def stream_hook(
    caches: ModelCaches, request_id: str, first_page: int, page_size: int, emit: Callable[[int, torch.Tensor], None]
) -> StepLayerHook:
    """A ``ModelRunner.layer_hook`` that streams ``request_id``'s KV during its last prefill step.

    In the step that computes the last tokens of that request, after each full-attention layer
    ``l``, it calls ``emit(l, kv)`` with a copy of the layer's pages ``first_page ..`` of the
    prompt, ``[n, 2, page_size, kv_heads, head_dim]``; every other step runs without a hook.
    ``emit`` runs on the engine's thread inside the forward: it should hand the copy off and
    return (blocking there holds the forward back).
    """

    def for_step(out: SchedulerOutput) -> AttnLayerHook | None:
        for req, n in zip(out.requests, out.num_new_tokens):
            if req.request_id != request_id or req.finalizing or req.num_computed_tokens + n != req.num_tokens:
                continue
            pages = req.page_ids[first_page : -(-req.num_tokens // page_size)]
            index = torch.tensor(pages, dtype=torch.long, device=caches.kv.device)
            return lambda layer: emit(layer, caches.kv[layer].index_select(0, index))
        return None

    return for_step

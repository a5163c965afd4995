"""Moving a cached prefix (KV pages + its GDN checkpoint) off the device and back.

Spilling a session copies, for the deepest checkpoint within its tokens, every KV page on the
tree path (plus the checkpoint's tail page) and the checkpoint's conv and recurrent state to host
memory. Resuming allocates fresh pages and a fresh slot, copies the tensors in, and inserts the
path into the radix tree with its checkpoint, exactly as if a request had computed it: the next
request on that history is a cache hit and computes only what lies past the checkpoint. Pages the
tree still holds for the same positions are kept and the imported duplicates freed; nothing is
ever written into a page the tree shares.

Two orders. With a plain writer (the copy runs on the engine's stream, after the caller drained
the async pipeline: tensor parallelism) the tensors are written, then inserted. With a fenced
writer (TP=1: ``ModelRunner.write_state_async``) the path is inserted first and only what the tree
adopted is written (the pages past what it already held, the slot and tail page when the
checkpoint is new), on a side stream; the writer's fence goes to ``CacheManager.imports``, which
keeps the node locked and makes the engine's stream wait before anything reads it. So a resume
neither drains the pipeline nor stalls the steps of the requests that do not read it. Either way
the imported checkpoint is held for the request about to resume on it (``engine.cache.holds``):
eviction cannot take it between the import and that request's admission.

Layout of the exported tensors (what ``storage`` segments hold), the same whatever the
tensor-parallel size (``engine.parallel.state_shards`` gathers and scatters the ranks' shards)::

    kv    [num_attn_layers, num_pages, 2, page_size, num_kv_heads, head_dim]   model dtype
    conv  [num_gdn_layers, conv_dim, conv_kernel - 1]                           model dtype
    ssm   [num_gdn_layers, num_v_heads, key_head_dim, value_head_dim]           fp32
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from phloem.engine.cache.manager import CacheManager
from phloem.engine.cache.radix import Checkpoint
from phloem.engine.copy_fence import CopyFence
from phloem.engine.parallel.state_shards import StateTensors

__all__ = ["HostAlloc", "PrefixState", "export_prefix", "import_prefix"]

# ``(pages, slot)`` -> the whole (TP=1 layout) state on the device (``engine.parallel.state_shards``).
StateReader = Callable[[Sequence[int], int], StateTensors]
# ``(pages, slot, state)``: write a whole state into the pages and slot of every rank.
StateWriter = Callable[[Sequence[int], int, StateTensors], None]
# ``(pages, slot or None, state)``: queue the writes (kv for ``pages``; conv and ssm into ``slot``
# unless None) and return their fence, or None when they are done already (CPU).
FencedStateWriter = Callable[[Sequence[int], int | None, StateTensors], CopyFence | None]
# ``num_pages`` -> the whole state's kv, conv and ssm shapes.
StateShapes = Callable[[int], tuple[tuple[int, ...], ...]]
# ``(shape, dtype)`` -> an uninitialised host tensor for an export's copy, or None (allocate it
# here): ``storage.PinnedArena.alloc``, whose memory was pinned once at start.
HostAlloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor | None]


@dataclass(frozen=True, slots=True)
class PrefixState:
    token_ids: tuple[int, ...]  # the tokens the state covers (its checkpoint depth)
    kv: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kv, self.conv, self.ssm))


def export_prefix(
    cache: CacheManager, read: StateReader, token_ids: list[int], namespace: str | None = None,
    host_alloc: HostAlloc | None = None,
) -> PrefixState | None:
    """Host copies of the deepest checkpoint within ``token_ids`` cached in ``namespace`` (None
    when nothing is cached), in ``host_alloc``'s memory (the pinned arena, ``storage.pinned_arena``)
    and, where it has no range left, in pageable memory: pinning a fresh block on the engine thread
    costs ~20x the copy and stalls every CUDA call meanwhile, a pageable copy only its own ~6 GB/s.
    Without ``host_alloc`` the copies are allocated here, pinned on CUDA."""
    tree = cache.tree
    match = tree.match(token_ids, len(token_ids), namespace) if tree is not None and token_ids else None
    if match is None:
        return None
    pages = list(match.pages)
    if match.checkpoint.tail_page is not None:
        pages.append(match.checkpoint.tail_page)
    kv, conv, ssm = read(pages, match.checkpoint.slot)
    pin = kv.device.type == "cuda"

    def host(t: torch.Tensor) -> torch.Tensor:
        out = (host_alloc(tuple(t.shape), t.dtype) if host_alloc is not None
               else torch.empty(t.shape, dtype=t.dtype, pin_memory=pin))
        if out is None:
            out = torch.empty(t.shape, dtype=t.dtype)  # the arena is full: pageable, never pinned here
        out.copy_(t, non_blocking=pin and out.is_pinned())
        return out

    state = PrefixState(tuple(token_ids[: match.num_tokens]), host(kv), host(conv), host(ssm))
    if pin:
        torch.cuda.current_stream(kv.device).synchronize()
    return state


def import_prefix(
    cache: CacheManager,
    state: PrefixState,
    shapes: StateShapes,
    write: StateWriter | FencedStateWriter,
    namespace: str | None = None,
    fenced: bool = False,
) -> bool:
    """Load ``state`` into fresh pages and a fresh slot and publish it in the radix tree, in
    ``namespace``; ``fenced``: ``write`` is a ``FencedStateWriter`` (the module docstring's
    second order).

    Returns False (taking nothing) when the pools cannot make room even after eviction.

    Raises:
        ValueError: the tensors do not match this engine's cache layout.
    """
    tree = cache.tree
    assert tree is not None, "importing a prefix needs the prefix cache"
    ps = cache.page_size
    n = state.num_tokens
    full, has_tail = n // ps, n % ps != 0
    expect = shapes(full + has_tail)
    got = tuple(tuple(t.shape) for t in (state.kv, state.conv, state.ssm))
    if got != expect:
        raise ValueError(
            f"state: expected kv {expect[0]}, conv {expect[1]}, ssm {expect[2]}; got kv {got[0]}, conv {got[1]}, ssm {got[2]}"
        )
    slot = cache.allocate_slot()
    if slot is None:
        return False
    pages = cache.allocate_page_list(full + has_tail)
    if pages is None:
        cache.slot_pool.free(slot)
        return False
    ckpt = Checkpoint(slot=slot, tail_page=pages[full] if has_tail else None)
    if not fenced:
        write(pages, slot, (state.kv, state.conv, state.ssm))
        node, _ = tree.insert(list(state.token_ids), pages[:full], ckpt, namespace)
        cache.holds.hold(node)  # for the request about to resume on it (``engine.cache.holds``)
        return True
    node, tree_pages = tree.insert(list(state.token_ids), pages[:full], ckpt, namespace)
    cache.holds.hold(node)
    # Positions the tree already held (a shared prefix: a leading run) keep the tree's pages; the
    # import writes the rest, and its tail and slot only when its checkpoint is the one the tree took.
    own_checkpoint = node.checkpoint is ckpt
    adopted = [i for i, (p, q) in enumerate(zip(pages, tree_pages)) if p == q]
    if has_tail and own_checkpoint:
        adopted.append(full)
    if not adopted and not own_checkpoint:
        return True  # the tree held all of it
    start = adopted[0] if adopted else 0
    if adopted == list(range(start, start + len(adopted))):
        kv = state.kv.narrow(1, start, len(adopted))  # a view of the (pinned) host tensor: no host copy
    else:
        kv = state.kv[:, adopted]
    slot_or_none = slot if own_checkpoint else None
    written = [pages[i] for i in adopted]
    fence = write(written, slot_or_none, (kv, state.conv, state.ssm))  # type: ignore[arg-type]
    if fence is not None:
        cache.imports.add(node, fence, written, slot_or_none)
    return True

"""Hybrid radix prefix cache: a token-keyed tree of immutable KV pages and GDN state checkpoints.

Why this shape. A hybrid model can resume a prefix only where it has *both* the KV of every
full-attention layer and the GDN state at exactly that position; KV is cheap per token and can
be cut anywhere, a GDN state is big (~3,000 tokens' worth of KV) and exists only where it was
saved. So the tree stores KV in full pages along its edges and hangs checkpoints on node
boundaries; a lookup is a hit up to the deepest checkpoint on the matched path.

Page ownership. Edges are token-granular but pages are not: a full page belongs to the node
whose edge contains the page's *last* position, so the pages on the path root→X cover exactly
``floor(X.depth / page_size)`` pages. A checkpoint at a depth that is not page-aligned also owns
a *tail page* holding the KV of the partial last page (handed over by the request that made it,
no copy). A hit copies at most that one tail page into a private page of the new request::

    depth:   0       16      32   40
    pages:  [  p0   ][  p1   ][ tail ]        page_size 16, checkpoint at 40
    path:    root ── A(0..24) ── B(24..40, checkpoint: slot s, tail page t)
             p0 ∈ A (last pos 15 < 24), p1 ∈ B (last pos 31 ∈ [24, 40))

Locks. A running request locks the node it resumed from; a session pins its head. ``lock_ref``
counts locks passing through a node (a node with ``lock_ref > 0`` keeps its pages);
``direct_ref`` counts locks on the node itself (its checkpoint is then kept too). Mid-path
checkpoints of a locked path stay evictable: for a slot, and for a page when they have a tail
page (a checkpoint with children and no tail page frees no page).

Namespaces (tenants, docs/architecture.md, "Invariants"). Every node belongs to the namespace that inserted it, and
every checkpoint to the namespace that computed it; ``None`` is the shared namespace (operator
prefixes, and every caller that names none). A lookup in namespace ``T`` follows nodes and
uses checkpoints of ``T`` and ``None`` only, so one tenant can never observe another's prefixes
(a hit count, or its timing); two tenants inserting the same tokens get separate nodes and
pages. Children are keyed by ``(namespace, first token)``; a tenant's insert follows its own
child, else a shared one (splitting shared nodes is invisible: hits come from checkpoints), and
shared inserts never descend into tenant nodes, so a tenant node only ever has children of its
own namespace: the shared nodes form a trunk with tenant subtrees hanging off it::

    root ── S(system prompt, ckpt ns=None) ─┬─ A(tenant a's turn, ckpt ns=a)
                                            └─ B(tenant b's turn, ckpt ns=b)
         ── C(tenant c's conversation, ckpt ns=c)

A checkpoint that a tenant lands on a shared node (its turn ends inside shared text) is that
tenant's: other namespaces do not see it.

Eviction is ordered by kind, then by recompute cost per byte freed, not recency. Pages of a leaf
below every checkpoint are worth nothing and go first; then *periodic* checkpoints (taken every
``checkpoint_interval`` tokens inside a long prefill: a resume point only for a request that
diverges right there); then *boundary* checkpoints (where a request's prompt or output ended: a
session's turns, where its next turn appends and its forks branch). A periodic or *branch* checkpoint
(where a request's prompt left a path another request had computed, ``CacheManager.admit``)
that a request resumed from is promoted to the boundary kind: it proved its use. Within a kind,
dropping a checkpoint costs the tokens between it and the nearest checkpoint above it, times one
plus the requests that resumed from it (``hits``), per byte freed. Ties go to the least
recently used, then the oldest node id (deterministic, so every tensor-parallel rank evicts the
same nodes). A locked node's own checkpoint (a pinned session head, a running request's resume
point) is never evicted.

One ``evict`` call walks the tree once and keeps its candidates in a heap, so freeing ``V``
victims from ``N`` nodes costs ``O((N + V) log N)``, not a full scan per victim. A victim
can only make other nodes *more* costly (dropping a checkpoint deepens the recompute of those
below it) or newly evictable (a parent losing its last child), so heap keys are re-checked
lazily when popped and newly evictable parents are pushed: the victims and their order are
exactly those of a fresh scan before each victim.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Checkpoint", "PrefixMatch", "RadixCache", "RadixNode"]


@dataclass(slots=True)
class Checkpoint:
    slot: int
    tail_page: int | None  # KV of positions [floor(depth/ps)*ps, depth) when depth % ps != 0
    periodic: bool = False  # taken inside a long prefill, not at a prompt's or output's end
    branch: bool = False  # taken where a request's prompt left a path other requests share
    namespace: str | None = None  # who computed it (set by ``insert``); None: shared


@dataclass(eq=False, slots=True)
class RadixNode:
    node_id: int
    parent: RadixNode | None
    key: list[int]  # the edge's tokens
    depth: int  # tokens from the root to the end of this edge
    pages: list[int] = field(default_factory=list)
    children: dict[tuple[str | None, int], RadixNode] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    lock_ref: int = 0
    direct_ref: int = 0
    last_access: int = 0
    namespace: str | None = None  # who inserted it; None: shared
    hits: int = 0  # requests that resumed from its checkpoint (reset when the checkpoint goes)

    @property
    def start(self) -> int:
        return self.depth - len(self.key)

    @property
    def edge(self) -> tuple[str | None, int]:
        """Its key in ``parent.children``: (namespace, first token)."""
        return self.namespace, self.key[0]

    def visible_to(self, namespace: str | None) -> bool:
        """Whether ``namespace`` may use this node's checkpoint."""
        return self.checkpoint is not None and self.checkpoint.namespace in (None, namespace)


# An eviction candidate: (kind rank, cost per byte, last access, node id, is a checkpoint, push order, node).
_Entry = tuple[int, float, int, int, bool, int, "RadixNode"]
# Eviction ranks: plain leaves and periodic checkpoints first, boundary checkpoints after.
_CHEAP, _BOUNDARY = 0, 1


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """A reusable prefix: ``num_tokens`` tokens with their full pages and the checkpoint at the end."""

    node: RadixNode
    num_tokens: int
    pages: tuple[int, ...]
    checkpoint: Checkpoint


class RadixCache:
    def __init__(
        self,
        page_size: int,
        free_pages: Callable[[list[int]], None],
        free_slot: Callable[[int], None],
        page_bytes: int,
        slot_bytes: int,
    ) -> None:
        self.page_size = page_size
        self._free_pages = free_pages
        self._free_slot = free_slot
        self.page_bytes = page_bytes
        self.slot_bytes = slot_bytes
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self._pushes = itertools.count()  # heap entries of one node may share a key: never compare nodes
        self.root = RadixNode(next(self._ids), None, [], 0)
        self.num_pages = 0
        self.num_checkpoints = 0
        self.checkpoints_created = 0
        self.checkpoints_evicted = 0

    def match(
        self, tokens: list[int], max_tokens: int, namespace: str | None = None, touch: bool = True
    ) -> PrefixMatch | None:
        """Deepest checkpointed prefix of ``tokens`` no longer than ``max_tokens`` that
        ``namespace`` may use (its own nodes and checkpoints, and shared ones); ``touch`` marks
        its path as used (the eviction order's recency)."""
        path = self._visible_path(tokens, max_tokens, namespace)
        if not path:
            return None
        best = path[-1]
        now = next(self._clock) if touch else 0
        pages: list[int] = []
        for n in path:
            if touch:
                n.last_access = now
            pages.extend(n.pages)
        assert best.checkpoint is not None
        return PrefixMatch(best, best.depth, tuple(pages), best.checkpoint)

    def kv_match_len(self, tokens: list[int], max_tokens: int, namespace: str | None = None) -> int:
        """Tokens of ``tokens`` (at most ``max_tokens``) that the tree holds on nodes ``namespace``
        may use, checkpointed or not: past the deepest checkpoint, proof that an earlier request
        computed the same prefix (a branch point, ``CacheManager.admit``)."""
        best = _match_len(self.root, tokens, None)
        if namespace is not None:
            for node in [self.root, *self._descend(self.root, tokens, None)]:
                best = max(best, _match_len(node, tokens, namespace))
        return min(best, max_tokens)

    def record_hit(self, node: RadixNode) -> None:
        """A request resumed from ``node``'s checkpoint (the eviction order weighs it by uses)."""
        node.hits += 1

    def _visible_path(self, tokens: list[int], max_tokens: int, namespace: str | None) -> list[RadixNode]:
        """Root-to-node path of the deepest checkpoint ``namespace`` may use (empty: none): along
        the shared trunk, or into the namespace's own subtree below any trunk node."""
        trunk = self._descend(self.root, tokens, None)
        best = _deepest_usable(trunk, max_tokens, namespace)
        if namespace is None:
            return best
        for i, node in enumerate([self.root, *trunk]):
            hit = _deepest_usable(self._descend(node, tokens, namespace), max_tokens, namespace)
            if hit and (not best or hit[-1].depth > best[-1].depth):
                best = trunk[:i] + hit
        return best

    @staticmethod
    def _descend(node: RadixNode, tokens: list[int], namespace: str | None) -> list[RadixNode]:
        """The nodes of ``namespace`` below ``node`` whose edges spell ``tokens[node.depth:]``."""
        out: list[RadixNode] = []
        pos = node.depth
        while pos < len(tokens):
            child = node.children.get((namespace, tokens[pos]))
            if child is None or tokens[pos : pos + len(child.key)] != child.key:
                break
            out.append(child)
            node, pos = child, child.depth
        return out

    @property
    def has_locks(self) -> bool:
        """Whether any node is locked (a running request's prefix, a pin, a hand-off hold)."""
        return any(child.lock_ref for child in self.root.children.values())

    def lock(self, node: RadixNode) -> None:
        node.direct_ref += 1
        for n in self._path_up(node):
            n.lock_ref += 1

    def unlock(self, node: RadixNode) -> None:
        assert node.direct_ref > 0, f"node {node.node_id} unlocked more than locked"
        node.direct_ref -= 1
        for n in self._path_up(node):
            assert n.lock_ref > 0, f"node {n.node_id} lock_ref underflow"
            n.lock_ref -= 1

    def _path_up(self, node: RadixNode) -> list[RadixNode]:
        out = []
        n: RadixNode | None = node
        while n is not None and n is not self.root:
            out.append(n)
            n = n.parent
        return out

    def insert(
        self, tokens: list[int], pages: list[int], checkpoint: Checkpoint | None, namespace: str | None = None
    ) -> tuple[RadixNode, list[int]]:
        """Insert ``tokens`` with their full ``pages`` (``len(tokens) // page_size`` of them) for
        ``namespace`` (the checkpoint becomes that namespace's).

        Pages the tree already holds for the same positions (on nodes ``namespace`` may use) are
        kept and the caller's duplicates freed; likewise a checkpoint the tree already has at
        that depth. Returns the node ending at ``len(tokens)`` and the page ids the tree now uses
        for those positions (the caller switches its page table to them).
        """
        ps = self.page_size
        assert len(pages) == len(tokens) // ps, f"{len(pages)} pages for {len(tokens)} tokens"
        node, pos, tree_pages = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get((namespace, tokens[pos]))
            if child is None and namespace is not None:
                child = node.children.get((None, tokens[pos]))
            if child is None:
                child = self._add_leaf(node, tokens[pos:], pages, namespace)
            common = _common_prefix(child.key, tokens, pos)
            if common < len(child.key):
                child = self._split(child, common)
            first_page = child.start // ps
            mine = pages[first_page : first_page + len(child.pages)]
            dup = [p for p, q in zip(mine, child.pages) if p != q]
            self._free_pages(dup)
            tree_pages.extend(child.pages)
            node, pos = child, child.depth
        now = next(self._clock)
        for n in self._path_up(node):
            n.last_access = now
        if checkpoint is not None:
            if node.checkpoint is None and node is not self.root:
                checkpoint.namespace = namespace
                node.checkpoint = checkpoint
                self.num_checkpoints += 1
                self.checkpoints_created += 1
            else:
                self._drop_checkpoint_resources(checkpoint)
        return node, tree_pages

    def _add_leaf(self, parent: RadixNode, key: list[int], pages: list[int], namespace: str | None) -> RadixNode:
        ps = self.page_size
        leaf = RadixNode(next(self._ids), parent, list(key), parent.depth + len(key), namespace=namespace)
        # Pages whose last position lies in [leaf.start, leaf.depth): ids start//ps .. depth//ps - 1.
        leaf.pages = list(pages[parent.depth // ps : leaf.depth // ps])
        self.num_pages += len(leaf.pages)
        parent.children[leaf.edge] = leaf
        return leaf

    def _split(self, node: RadixNode, offset: int) -> RadixNode:
        """Cut ``node``'s edge after ``offset`` tokens; returns the new upper node."""
        ps = self.page_size
        parent = node.parent
        assert parent is not None and 0 < offset < len(node.key)
        upper = RadixNode(next(self._ids), parent, node.key[:offset], node.start + offset, namespace=node.namespace)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        num_upper = upper.depth // ps - node.start // ps
        upper.pages, node.pages = node.pages[:num_upper], node.pages[num_upper:]
        node.key = node.key[offset:]
        node.parent = upper
        upper.children[node.edge] = node
        parent.children[upper.edge] = upper
        return upper

    def _drop_checkpoint_resources(self, ckpt: Checkpoint) -> None:
        self._free_slot(ckpt.slot)
        if ckpt.tail_page is not None:
            self._free_pages([ckpt.tail_page])

    def evict(self, num_pages: int, num_slots: int, free_page_count: Callable[[], int], free_slot_count: Callable[[], int]) -> None:
        """Free tree memory until the pools have ``num_pages`` pages and ``num_slots`` slots free
        (or nothing evictable is left), cheapest recompute cost per byte first."""
        if free_page_count() >= num_pages and free_slot_count() >= num_slots:
            return
        heap: list[_Entry] = []
        for node in self._nodes():
            self._push_candidate(heap, node)
        while free_page_count() < num_pages or free_slot_count() < num_slots:
            # Free counts only grow here, so once slots suffice they keep sufficing.
            victim = self._pop_victim(heap, need_slots=free_slot_count() < num_slots)
            if victim is None:
                return
            node, is_checkpoint = victim
            parent = node.parent
            self._free_victim(node, is_checkpoint)
            if is_checkpoint:
                self._push_candidate(heap, node)  # a childless node is now a plain leaf
            elif parent is not None and parent is not self.root:
                self._push_candidate(heap, parent)

    def _free_victim(self, node: RadixNode, is_checkpoint: bool) -> None:
        """Drop ``node``'s checkpoint (slot and tail page), or remove the leaf ``node`` (its pages)."""
        if is_checkpoint:
            assert node.checkpoint is not None
            self._drop_checkpoint_resources(node.checkpoint)
            node.checkpoint = None
            node.hits = 0
            self.num_checkpoints -= 1
            self.checkpoints_evicted += 1
        else:
            self._remove_leaf(node)

    def _candidate_key(self, node: RadixNode) -> tuple[int, float, int, int, bool] | None:
        """The eviction key of ``node`` (checkpoints evictable whatever their children; the caller
        checks that condition against the current need), or None when nothing of it can go."""
        ckpt = node.checkpoint
        if ckpt is not None and node.direct_ref == 0:
            freed = self.slot_bytes + (self.page_bytes if ckpt.tail_page is not None else 0)
            cost = (node.depth - self._checkpoint_above(node)) * (1 + node.hits) / freed
            # A periodic or branch checkpoint no request resumed from yet goes first; once used,
            # it is worth what a boundary one is.
            cheap = (ckpt.periodic or ckpt.branch) and node.hits == 0
            return _CHEAP if cheap else _BOUNDARY, cost, node.last_access, node.node_id, True
        if ckpt is None and not node.children and node.lock_ref == 0:
            return _CHEAP, 0.0, node.last_access, node.node_id, False
        return None

    def _push_candidate(self, heap: list[_Entry], node: RadixNode) -> None:
        key = self._candidate_key(node)
        if key is not None:
            heapq.heappush(heap, (*key, next(self._pushes), node))

    def _pop_victim(self, heap: list[_Entry], need_slots: bool) -> tuple[RadixNode, bool] | None:
        """The cheapest evictable candidate; stale entries are re-keyed or dropped on the way."""
        while heap:
            rank, cost, last, node_id, is_checkpoint, _, node = heapq.heappop(heap)
            parent = node.parent
            if parent is None or parent.children.get(node.edge) is not node:
                continue  # already removed (a duplicate entry)
            key = self._candidate_key(node)
            if key is None:
                continue
            if key != (rank, cost, last, node_id, is_checkpoint):
                heapq.heappush(heap, (*key, next(self._pushes), node))  # costs only grow: re-queue
                continue
            if is_checkpoint and node.children and not need_slots and node.checkpoint.tail_page is None:  # type: ignore[union-attr]
                continue  # frees no page (a slot only); re-pushed when its last child goes
            return node, is_checkpoint
        return None

    def _checkpoint_above(self, node: RadixNode) -> int:
        n = node.parent
        while n is not None and n is not self.root:
            if n.checkpoint is not None:
                return n.depth
            n = n.parent
        return 0

    def _remove_leaf(self, node: RadixNode) -> None:
        assert not node.children and node.lock_ref == 0 and node.parent is not None
        self._free_pages(node.pages)
        self.num_pages -= len(node.pages)
        del node.parent.children[node.edge]

    def _nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def clear(self) -> None:
        """Drop every unlocked node (pages and checkpoints); used by tests and cache resets."""
        self.evict(1 << 62, 1 << 62, lambda: 0, lambda: 0)


def _deepest_usable(path: list[RadixNode], max_tokens: int, namespace: str | None) -> list[RadixNode]:
    """``path`` cut after its deepest node with a checkpoint ``namespace`` may use (empty: none)."""
    for i in range(len(path) - 1, -1, -1):
        if path[i].visible_to(namespace) and path[i].depth <= max_tokens:
            return path[: i + 1]
    return []


def _match_len(node: RadixNode, tokens: list[int], namespace: str | None) -> int:
    """How far ``tokens`` follow edges of ``namespace`` below ``node``, into the middle of an edge."""
    pos = node.depth
    while pos < len(tokens):
        child = node.children.get((namespace, tokens[pos]))
        if child is None:
            break
        common = _common_prefix(child.key, tokens, pos)
        if common < len(child.key):
            return pos + common
        node, pos = child, child.depth
    return pos


def _common_prefix(key: list[int], tokens: list[int], start: int) -> int:
    """The length of the common prefix of ``key`` and ``tokens[start:]``, compared a block at a time
    (list slices compare in C: a turn's whole history is matched again on every insert)."""
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start : start + n]:
        return n
    i = 0
    while i < n:
        j = min(i + 1024, n)
        if key[i:j] != tokens[start + i : start + j]:
            break
        i = j
    while i < n and key[i] == tokens[start + i]:
        i += 1
    return i

"""Memory of running requests: KV pages, GDN state slots and the radix prefix cache.

The scheduler talks to this class only through check/act calls that either fully succeed or
take nothing (``admit``, ``allocate_pages``) and ``release``. When a pool runs short, the radix
cache is asked to evict first; only then does the scheduler preempt.

A request's memory, with the prefix cache::

    page_ids:  [ shared (tree-owned, locked) ... | private ... ]
               |<---- num_shared_pages ---->|
    read_slot: the checkpoint it resumed from (tree-owned) until its first step, then == write_slot
    write_slot: private; handed to the tree when the request publishes a checkpoint

Publishing (at the end of a request, every ``checkpoint_interval`` tokens on the way, one token
before a generating request's prompt ends, and at its branch point: where its prompt leaves
cached KV that an earlier request computed, floored to the page) inserts the full pages into the tree and hands the write slot
over as the checkpoint: integer moves. A checkpoint that ends mid-page needs that partial page as
its tail: at the end of a request it is the request's own page (no copy); at the prompt end the
request keeps writing into it, so the tree gets a copy (one page, every attention layer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from phloem.engine.cache.holds import HandoffHolds
from phloem.engine.cache.import_fences import ImportFences
from phloem.engine.cache.kv_pages import PagePool
from phloem.engine.cache.radix import Checkpoint, RadixCache, RadixNode
from phloem.engine.cache.state_slots import SlotPool
from phloem.engine.request import Request, RequestStatus

__all__ = ["CacheManager", "CacheStats"]


@dataclass(frozen=True, slots=True)
class CacheStats:
    prompt_tokens: int
    cached_tokens: int
    checkpoints: int
    checkpoints_created: int
    checkpoints_evicted: int
    pages_in_use: int
    pages_in_tree: int
    slots_in_use: int
    # Device bytes the prefix cache holds: its pages and its checkpoints' state slots.
    bytes_in_tree: int = 0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class CacheManager:
    def __init__(
        self,
        page_pool: PagePool,
        slot_pool: SlotPool,
        copy_page: Callable[[int, int], None],
        tree: RadixCache | None,
        checkpoint_interval: int = 0,
        checkpoint_prompt_end: bool = False,
        prompt_end_split_min_tokens: int = 256,
        handoff_hold_s: float = 5.0,
    ) -> None:
        self.page_pool = page_pool
        self.slot_pool = slot_pool
        self.copy_page = copy_page
        self.tree = tree
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_prompt_end = checkpoint_prompt_end
        self.prompt_end_split_min_tokens = prompt_end_split_min_tokens
        self.prompt_tokens = 0
        self.cached_tokens = 0
        # Resumed prefixes whose copy into the pools is still queued (``engine.cache.import_fences``).
        self.imports = ImportFences(tree)
        # Turn ends and imports kept locked until their next user locks them (``engine.cache.holds``).
        self.holds = HandoffHolds(tree, handoff_hold_s)

    @property
    def page_size(self) -> int:
        return self.page_pool.page_size

    def stats(self) -> CacheStats:
        t = self.tree
        return CacheStats(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            checkpoints=t.num_checkpoints if t else 0,
            checkpoints_created=t.checkpoints_created if t else 0,
            checkpoints_evicted=t.checkpoints_evicted if t else 0,
            pages_in_use=self.page_pool.num_used_pages,
            pages_in_tree=t.num_pages if t else 0,
            slots_in_use=self.slot_pool.num_used_slots,
            bytes_in_tree=t.num_pages * t.page_bytes + t.num_checkpoints * t.slot_bytes if t else 0,
        )

    def _evict(self, num_pages: int, num_slots: int) -> None:
        if self.tree is not None:
            self.tree.evict(
                num_pages, num_slots, lambda: self.page_pool.num_free_pages, lambda: self.slot_pool.num_free_slots
            )

    def allocate_page_list(self, n: int) -> list[int] | None:
        """``n`` free pages (evicting from the tree if needed), or None taking nothing."""
        pages = self.page_pool.allocate(n)
        if pages is None:
            self._evict(n, 0)
            pages = self.page_pool.allocate(n)
        return pages

    def allocate_slot(self) -> int | None:
        """A free state slot (evicting a checkpoint if needed), or None."""
        slot = self.slot_pool.allocate()
        if slot is None:
            self._evict(0, 1)
            slot = self.slot_pool.allocate()
        return slot

    def cached_len(self, tokens: list[int], namespace: str | None = None) -> int:
        """Tokens of ``tokens`` a request of ``namespace`` would take from the cache now (no
        eviction order touched)."""
        if self.tree is None or not tokens:
            return 0
        match = self.tree.match(tokens, len(tokens) - 1, namespace, touch=False)
        return match.num_tokens if match else 0

    def admit(self, req: Request) -> bool:
        """Give a waiting request its write slot and its cached prefix, or take nothing and return False."""
        assert req.write_slot is None and not req.page_ids, f"request {req.request_id} already holds memory"
        tokens = req.all_token_ids
        # At least one token must be computed: its logits give the next token.
        match = self.tree.match(tokens, len(tokens) - 1, req.namespace) if self.tree is not None else None
        if match is not None:
            # Lock first: the evictions below must not take the prefix we are about to use.
            self.tree.lock(match.node)  # type: ignore[union-attr]
        slot = self.allocate_slot()
        pages: list[int] = list(match.pages) if match else []
        tail: list[int] | None = []
        if slot is not None and match is not None and match.checkpoint.tail_page is not None:
            tail = self.allocate_page_list(1)
        if slot is None or tail is None:
            if slot is not None:
                self.slot_pool.free(slot)
            if match is not None:
                self.tree.unlock(match.node)  # type: ignore[union-attr]
            return False
        if match is not None and self.imports:
            # Resuming on an imported prefix whose copy is still queued: the step reads it.
            self.imports.wait_for((*match.pages, match.checkpoint.tail_page), match.checkpoint.slot)
        if tail:
            assert match is not None and match.checkpoint.tail_page is not None
            self.copy_page(match.checkpoint.tail_page, tail[0])
            pages.append(tail[0])
        hit = match.num_tokens if match else 0
        if req.num_admissions == 0:
            self.prompt_tokens += req.num_prompt_tokens
            self.cached_tokens += hit
            req.num_cached_tokens = hit
            if match is not None:
                self.tree.record_hit(match.node)  # type: ignore[union-attr]
        elif hit < req.served_tokens:
            # Preempted, and the cache evicted part of the prefix it was first admitted on: that
            # part is computed again, and no longer counts as a hit.
            lost = req.num_cached_tokens - hit
            self.cached_tokens -= lost - req.num_cached_lost
            req.num_cached_lost = lost
        req.branch_point = self._branch_point(req, hit)
        req.num_admissions += 1
        req.write_slot = slot
        req.page_ids = pages
        req.num_shared_pages = len(match.pages) if match else 0
        req.num_computed_tokens = hit
        req.has_state = match is not None
        req.read_slot = match.checkpoint.slot if match else None
        req.lock_node = match.node if match else None
        if match is not None:
            self.holds.release(match.node)  # e.g. the import this request resumes on
        return True

    def _branch_point(self, req: Request, hit: int) -> int | None:
        """Where ``req``'s prefill, resuming at ``hit``, passes the end of the cached KV its
        prompt matches (floored to a page), if that is past ``hit``: an earlier request computed
        that prefix and this one leaves it there, so two requests share it and a third likely
        will (a system prompt); a checkpoint there lets it resume at the page.

        Only inside the prompt and before its prompt-end checkpoint (which covers the rest)."""
        if self.tree is None:
            return None
        tokens = req.all_token_ids
        limit = req.num_prompt_tokens - 1
        end = self.prompt_end(req)
        if end is not None:
            limit = end - 1
        if limit <= hit:
            return None
        shared = self.tree.kv_match_len(tokens, limit, req.namespace)
        point = shared // self.page_size * self.page_size
        return point if point > hit else None

    def allocate_pages(self, req: Request, num_new_tokens: int) -> bool:
        """Make ``req.page_ids`` cover ``num_computed_tokens + num_new_tokens`` positions.

        Returns False (allocating nothing) when too few pages are free even after eviction.
        """
        needed = self.page_pool.pages_for(req.num_computed_tokens + num_new_tokens) - len(req.page_ids)
        if needed <= 0:
            return True
        pages = self.allocate_page_list(needed)
        if pages is None:
            return False
        req.page_ids.extend(pages)
        return True

    def maybe_checkpoint(self, req: Request) -> None:
        """After a step: publish a checkpoint if ``req`` just reached a multiple of the interval, or
        the end of its prompt (``checkpoint_prompt_end``; not for prefill-only requests, which
        publish there when they finish). The request continues in a new slot: the one reserved
        for it (``reserve_checkpoint``), else a free one."""
        n = req.num_computed_tokens
        reserved, req.checkpoint_reservation = req.checkpoint_reservation, None
        if not self.checkpoint_due(req, n, req.num_tokens):
            assert reserved is None, f"request {req.request_id}: a reserved checkpoint is not due"
            return
        memory = reserved if reserved is not None else self._checkpoint_memory(n)
        if memory is None:
            req.branch_point = None
            return  # no slot to keep computing into: skip this checkpoint, nothing is lost
        new_slot, tail = memory
        if tail is not None:
            self.copy_page(req.page_ids[n // self.page_size], tail)
        branch = n == req.branch_point
        if branch:
            req.branch_point = None
        periodic = not self._at_prompt_end(req, n) and not branch
        node = self._publish(req, final=False, tail_copy=tail, periodic=periodic, branch=branch)
        assert node.checkpoint is not None
        req.read_slot = node.checkpoint.slot
        req.write_slot = new_slot

    def reserve_checkpoint(self, req: Request, num_computed: int) -> bool:
        """Set aside the slot and tail page of the checkpoint ``maybe_checkpoint`` publishes once
        ``req`` has computed ``num_computed`` tokens, for a step queued before that one is
        collected (``engine.step_pipeline``); False (taking nothing) when the pools are short.

        That step writes the new slot, and its KV of position ``num_computed`` lands in the
        partial page before the tail copy is taken: the copy then holds one position past the
        checkpoint, which whoever resumes from it writes before reading.
        """
        assert req.checkpoint_reservation is None, f"request {req.request_id} already holds a reservation"
        req.checkpoint_reservation = self._checkpoint_memory(num_computed)
        return req.checkpoint_reservation is not None

    def _checkpoint_memory(self, num_computed: int) -> tuple[int, int | None] | None:
        """What a checkpoint at ``num_computed`` tokens takes: a free slot for the request to
        continue in, and a page for the tail copy when it ends mid-page; None taking nothing."""
        slot = self.allocate_slot()
        if slot is None:
            return None
        if num_computed % self.page_size == 0:
            return slot, None
        copy = self.allocate_page_list(1)
        if copy is None:
            self.slot_pool.free(slot)
            return None
        return slot, copy[0]

    def checkpoint_due(self, req: Request, num_computed: int, num_tokens: int) -> bool:
        """Whether ``maybe_checkpoint`` publishes once ``req`` has computed ``num_computed`` of
        ``num_tokens`` tokens (the async scheduler asks one step ahead: a step queued behind one
        whose checkpoint hands its write slot over writes a reserved slot, ``reserve_checkpoint``)."""
        n, every = num_computed, self.checkpoint_interval
        if self.tree is None or n == 0:
            return False
        periodic = every > 0 and n % every == 0 and n < num_tokens
        return periodic or self._at_prompt_end(req, n) or n == req.branch_point

    def chunk_stops(self, req: Request) -> tuple[int, ...]:
        """Positions a prefill chunk of ``req`` must end at, so that the state there is a step's
        final state and can be published: its prompt end (``prompt_end``) and its branch point."""
        stops = []
        end = self.prompt_end(req)
        if end is not None:
            stops.append(end)
        if req.branch_point is not None:
            stops.append(req.branch_point)
        return tuple(stops)

    def prompt_end(self, req: Request) -> int | None:
        """Where the prompt-end checkpoint of ``req`` goes (None: it gets none): one token before
        its prompt's end, so that a resend of the same prompt resumes there and recomputes only
        the last position, whose logits it needs (docs/decisions.md, "A resent prompt is a full
        hit"); at the end itself for a turn resumed from the cache that adds fewer than
        ``prompt_end_split_min_tokens`` (``CacheConfig``). Fixed at the first admission."""
        p = req.num_prompt_tokens
        if self.tree is None or not self.checkpoint_prompt_end or req.prefill_only or p < 2:
            return None
        hit = req.num_cached_tokens
        if hit > 0 and p - hit < self.prompt_end_split_min_tokens:
            return p
        return p - 1

    def checkpoints_at_end(self, req: Request) -> bool:
        """Whether the last prefill chunk of ``req`` (its prompt's end) ends at a checkpoint
        anyway: the prompt-end one (one token before the end, ``prompt_end``), or a prefill-only
        request's on release."""
        if self.tree is None or req.num_tokens != req.num_prompt_tokens:
            return False
        return req.prefill_only or self.checkpoint_prompt_end

    def _at_prompt_end(self, req: Request, n: int) -> bool:
        return n == self.prompt_end(req)

    def release(self, req: Request, publish: bool) -> None:
        """Return what ``req`` holds; with ``publish``, first hand its computed prefix to the tree."""
        # The write slot holds the state at num_computed_tokens only once a step ran after admission.
        owns_state = req.has_state and req.read_slot == req.write_slot
        if publish and self.tree is not None and owns_state and req.num_computed_tokens > 0:
            node = self._publish(req, final=True)
            if req.hold_turn_end and req.status is RequestStatus.FINISHED:
                self.holds.hold(node)
        else:
            self.page_pool.free(req.page_ids[req.num_shared_pages :])
            if req.write_slot is not None:
                self.slot_pool.free(req.write_slot)
        self._unlock(req)
        if req.checkpoint_reservation is not None:
            slot, tail = req.checkpoint_reservation
            self.slot_pool.free(slot)
            if tail is not None:
                self.page_pool.free([tail])
            req.checkpoint_reservation = None
        req.page_ids = []
        req.num_shared_pages = 0
        req.write_slot = None
        req.read_slot = None
        req.has_state = False

    def _publish(
        self, req: Request, final: bool, tail_copy: int | None = None, periodic: bool = False, branch: bool = False
    ) -> RadixNode:
        assert self.tree is not None and req.write_slot is not None
        ps = self.page_size
        done = req.num_computed_tokens
        full = done // ps
        tail = req.page_ids[full] if final and done % ps else tail_copy
        ckpt = Checkpoint(slot=req.write_slot, tail_page=tail, periodic=periodic, branch=branch)
        node, tree_pages = self.tree.insert(req.all_token_ids[:done], req.page_ids[:full], ckpt, req.namespace)
        if final:
            # Pages past the published part and its tail were allocated ahead and never written.
            self.page_pool.free(req.page_ids[full + (1 if tail is not None else 0) :])
        else:
            # A new list, never an in-place rewrite: page-id mirrors are keyed by the list
            # (``engine.cache.page_lists``).
            if self.imports:
                self.imports.wait_for(tree_pages)  # the tree's pages for these positions may be an import's
            req.page_ids = tree_pages + req.page_ids[full:]
            req.num_shared_pages = full
            self.tree.lock(node)
            self._unlock(req)
            req.lock_node = node
        return node

    def _unlock(self, req: Request) -> None:
        if req.lock_node is not None and self.tree is not None:
            self.tree.unlock(req.lock_node)
        req.lock_node = None

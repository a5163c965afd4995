"""What every rank runs in one step, and its compact wire form (rank 0 -> worker ranks).

Under tensor parallelism only rank 0 schedules. Each step it sends the other ranks a
``StepPlan``: the KV page copies its scheduler made since the last plan (the copy-on-write tail
page of a prefix hit or fork), then the step's ``StepInputs``. A plan without inputs may instead
carry a ``StateMove``: export a cached prefix's pages and state slot to rank 0, or import them
from rank 0 (session spill and resume, ``engine.parallel.state_shards``). A worker replays the copies and
runs the same forward; it never samples (rank 0 alone turns the gathered logits into tokens,
and the next plan carries them as input ids), so sampling needs no agreement between ranks. A
step that rank 0 queued before reading the previous step's ids (async scheduling) is sent with
``device_ids``: its host ids are placeholders and every rank takes the real ones from rank 0's
device by a broadcast just before the forward. A speculating engine's step also sends its
drafting work as plans with a ``SpecOp`` (``engine.speculative_ranks``): the MTP layer over the
plan's inputs, the LM head, or a GDN-state snapshot or restore.

Wire form: one flat int64 array in native byte order (the ranks share a host; no pickle)::

    [B, T, S, C, M | copies (2C) | input_ids, positions, slot_mapping (T each) | query_start_loc (B+1)
     | seq_lens, read_slots, write_slots, has_state, query_lens, num_pages (B each)
     | sample_rows (S) | page ids (sum num_pages)]

``B = 0`` means no forward: copies only (``M = 0``), or copies then a state move ``M`` (1 export,
2 import) followed by ``[slot, num_pages | page ids]``, or a ``SpecOp`` ``M`` (3 logits, 4
snapshot, 5 restore) followed by ``[n | values (n)]``. With a forward (``B > 0``), ``M = 1`` means
``device_ids``, ``M = 2`` the MTP layer's forward (``SpecOp("mtp")``). An empty message means
shut down.
"""

from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass
from typing import Literal

__all__ = ["SpecOp", "StateMove", "StepInputs", "StepPlan", "decode_plan", "encode_plan"]

_MOVE_KINDS: tuple[Literal["export", "import"], ...] = ("export", "import")
SpecKind = Literal["mtp", "logits", "snapshot", "restore"]
# Wire codes (``M``) of the ops without a forward; ``mtp`` rides on a forward as ``M = 2``.
_SPEC_CODES: dict[str, int] = {"logits": 3, "snapshot": 4, "restore": 5}


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One step gathered on the host; ``sample_rows`` index requests (and logits rows) to sample."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    read_slots: list[int]
    write_slots: list[int]
    has_state: list[bool]
    query_lens: tuple[int, ...]
    page_ids: list[list[int]]
    sample_rows: list[int]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens) and all(self.has_state)

    def then(self, other: StepInputs) -> StepInputs:
        """This step's rows followed by ``other``'s (a queued decode step and the requests admitted
        beside it, ``engine.step_pipeline``)."""
        rows, tokens = len(self.query_lens), len(self.input_ids)
        return StepInputs(
            self.input_ids + other.input_ids,
            self.positions + other.positions,
            self.slot_mapping + other.slot_mapping,
            self.query_start_loc + [tokens + q for q in other.query_start_loc[1:]],
            self.seq_lens + other.seq_lens,
            self.read_slots + other.read_slots,
            self.write_slots + other.write_slots,
            self.has_state + other.has_state,
            self.query_lens + other.query_lens,
            self.page_ids + other.page_ids,
            self.sample_rows + [rows + i for i in other.sample_rows],
        )

    @classmethod
    def scratch(cls, page: int, page_size: int, slot: int) -> StepInputs:
        """A one-token decode step that touches only a scratch page and slot (graph warm-up)."""
        return cls([0], [0], [page * page_size], [0, 1], [1], [slot], [slot], [True], (1,), [[page]], [0])


@dataclass(frozen=True, slots=True)
class StateMove:
    """Move a cached prefix's KV ``pages`` and state ``slot`` between the ranks and rank 0's host:
    ``export`` gathers every rank's shard to rank 0, ``import`` scatters rank 0's to the ranks."""

    kind: Literal["export", "import"]
    pages: tuple[int, ...]
    slot: int


@dataclass(frozen=True, slots=True)
class SpecOp:
    """A speculative step's work besides trunk forwards, that every rank runs alike
    (``engine.speculative_ranks``): ``mtp``, the plan's inputs through the MTP layer over hidden
    rows broadcast from rank 0; ``logits``, the LM head over ``values[0]`` rows broadcast from
    rank 0; ``snapshot``, keep a copy of the GDN states of the slots ``values``; ``restore``,
    write the snapshot's rows ``values[:n]`` into the slots ``values[n:]`` (``n = len // 2``)."""

    kind: SpecKind
    values: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Page copies ``(src, dst)`` to apply in order, then the forward (None: none), or a state move.

    ``device_ids``: the forward's input ids are broadcast from rank 0's device (``inputs.input_ids``
    are placeholders).
    """

    page_copies: tuple[tuple[int, int], ...]
    inputs: StepInputs | None
    move: StateMove | None = None
    device_ids: bool = False
    spec: SpecOp | None = None

    def __post_init__(self) -> None:
        assert self.inputs is None or self.move is None, "a step plan runs a forward or moves state, not both"
        assert self.inputs is not None or not self.device_ids, "device ids without a forward"
        assert self.move is None or self.spec is None, "a step plan moves state or runs a SpecOp, not both"
        if self.spec is not None:
            assert (self.spec.kind == "mtp") == (self.inputs is not None) and not self.device_ids, (
                f"SpecOp {self.spec.kind!r}: only 'mtp' runs the plan's inputs (host ids)"
            )


def encode_plan(plan: StepPlan) -> bytes:
    inp = plan.inputs
    copies = list(itertools.chain.from_iterable(plan.page_copies))
    if inp is None:
        move, spec = plan.move, plan.spec
        if spec is not None:
            words = [0, 0, 0, len(plan.page_copies), _SPEC_CODES[spec.kind], *copies, len(spec.values), *spec.values]
            return array("q", words).tobytes()
        if move is None:
            return array("q", [0, 0, 0, len(plan.page_copies), 0, *copies]).tobytes()
        kind = _MOVE_KINDS.index(move.kind) + 1
        words = [0, 0, 0, len(plan.page_copies), kind, *copies, move.slot, len(move.pages), *move.pages]
        return array("q", words).tobytes()
    mode = 2 if plan.spec is not None else int(plan.device_ids)
    header = [len(inp.query_lens), len(inp.input_ids), len(inp.sample_rows), len(plan.page_copies), mode]
    words = array("q", header)
    words.extend(copies)
    for field in (inp.input_ids, inp.positions, inp.slot_mapping, inp.query_start_loc, inp.seq_lens):
        words.extend(field)
    for field in (inp.read_slots, inp.write_slots, [int(h) for h in inp.has_state], list(inp.query_lens)):
        words.extend(field)
    words.extend(len(p) for p in inp.page_ids)
    words.extend(inp.sample_rows)
    for pages in inp.page_ids:
        words.extend(pages)
    return words.tobytes()


def decode_plan(data: bytes) -> StepPlan:
    assert data, "an empty message is the shutdown signal, not a plan"
    words = array("q")
    words.frombytes(data)
    values = words.tolist()
    num_seqs, num_tokens, num_samples, num_copies, move_kind = values[:5]
    pos = 5

    def take(n: int) -> list[int]:
        nonlocal pos
        pos += n
        return values[pos - n : pos]

    flat = take(2 * num_copies)
    copies = tuple(zip(flat[0::2], flat[1::2]))
    if num_seqs == 0:
        move = None
        if move_kind in _SPEC_CODES.values():
            kind = next(k for k, code in _SPEC_CODES.items() if code == move_kind)
            op = SpecOp(kind, tuple(take(take(1)[0])))  # type: ignore[arg-type]
            assert pos == len(values), f"step plan: {len(values) - pos} trailing words"
            return StepPlan(copies, None, spec=op)
        if move_kind:
            slot, num_pages = take(2)
            move = StateMove(_MOVE_KINDS[move_kind - 1], tuple(take(num_pages)), slot)
        assert pos == len(values), f"step plan: {len(values) - pos} trailing words"
        return StepPlan(copies, None, move)
    ids, positions, slots = take(num_tokens), take(num_tokens), take(num_tokens)
    qsl = take(num_seqs + 1)
    seq_lens, read, write, has_state, query_lens, num_pages = (take(num_seqs) for _ in range(6))
    sample_rows = take(num_samples)
    pages = [take(n) for n in num_pages]
    assert pos == len(values), f"step plan: {len(values) - pos} trailing words"
    inputs = StepInputs(
        ids, positions, slots, qsl, seq_lens, read, write, [bool(h) for h in has_state], tuple(query_lens), pages,
        sample_rows,
    )
    spec = SpecOp("mtp") if move_kind == 2 else None
    return StepPlan(copies, inputs, device_ids=move_kind == 1, spec=spec)

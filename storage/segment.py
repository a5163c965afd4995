"""Segments: the unit of session state that leaves the GPU.

A segment is one session head's state: the KV pages of the full-attention layers, the GDN head
checkpoint (conv and recurrent state) and the token ids it covers. It is self-describing: its
`SegmentMeta` carries everything needed to validate the tensors without the index or the model
(model fingerprint, sha256 of the token ids, model geometry, page size, dtype), which is what lets
the index be rebuilt from the data directory alone.

Tensors (names are the safetensors keys on disk)::

    kv         [num_attn_layers, num_pages, 2, page_size, num_kv_heads, head_dim]   kv_dtype
    conv       [num_gdn_layers, conv_dim, conv_kernel_size - 1]                     conv_dtype
    ssm        [num_gdn_layers, num_v_heads, key_head_dim, value_head_dim]          float32
    token_ids  [num_tokens]                                                          int64

    num_pages = ceil(num_tokens / page_size); the last page may be partial.

Decisions: a segment always covers tokens ``[0, num_tokens)`` of its session (the head), so one
segment is enough to resume; the KV pages' dtype is ``kv_dtype`` (the model's, or fp8 with an
fp8 KV cache), the conv state's is the model's, ``conv_dtype`` (absent from segments written
before fp8 KV: then ``kv_dtype``), and the recurrent state is always fp32 (docs/architecture.md,
"Invariants"). The token-id hash is sha256 over the ids as
little-endian int64, so it is stable across machines and Python versions.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

from ._fs import check_id
from .pinned_arena import HostAlloc

__all__ = ["TENSOR_NAMES", "Segment", "SegmentLayout", "SegmentMeta", "hash_token_ids"]

TENSOR_NAMES = ("kv", "conv", "ssm", "token_ids")
SSM_DTYPE = torch.float32
_DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
}


def hash_token_ids(token_ids: Sequence[int] | torch.Tensor) -> str:
    """Return the sha256 hex digest of ``token_ids`` as little-endian int64.

    Raises:
        ValueError: ``token_ids`` is a floating-point tensor.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.is_floating_point():
            raise ValueError(f"token ids must be integers, got dtype {token_ids.dtype}")
        ids = token_ids.detach().to("cpu", torch.int64).reshape(-1).contiguous()
    else:
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    return hashlib.sha256(ids.numpy().astype("<i8", copy=False).tobytes()).hexdigest()


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class SegmentLayout:
    """Model geometry of a segment's tensors; the same for every segment of one model."""

    num_attn_layers: int
    num_kv_heads: int
    head_dim: int
    num_gdn_layers: int
    conv_dim: int
    conv_kernel_size: int
    num_v_heads: int
    key_head_dim: int
    value_head_dim: int

    def __post_init__(self) -> None:
        for f in fields(self):
            minimum = 1 if f.name == "conv_kernel_size" else 0
            _check_int("SegmentLayout", f.name, getattr(self, f.name), minimum)


@dataclass(frozen=True, slots=True)
class SegmentMeta:
    """Self-describing header of a segment; stored as JSON in the safetensors metadata.

    Raises:
        ValueError: an id is not filesystem-safe, or a field has the wrong type or range.
    """

    session_id: str
    segment_id: str
    model_fingerprint: str
    num_tokens: int
    token_ids_hash: str
    page_size: int
    kv_dtype: str
    layout: SegmentLayout
    created_at: float = field(default_factory=time.time)
    conv_dtype: str | None = None

    def __post_init__(self) -> None:
        check_id(self.session_id, "session_id")
        check_id(self.segment_id, "segment_id")
        fingerprint = self.model_fingerprint
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError(f"model_fingerprint must be a non-empty str, got {fingerprint!r}")
        _check_int("SegmentMeta", "num_tokens", self.num_tokens, 0)
        _check_int("SegmentMeta", "page_size", self.page_size, 1)
        h = self.token_ids_hash
        if not isinstance(h, str) or len(h) != 64 or h.strip("0123456789abcdef"):
            raise ValueError(f"token_ids_hash must be 64 lowercase hex digits, got {h!r:.80}")
        if self.kv_dtype not in _DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(_DTYPES)}, got {self.kv_dtype!r}")
        if self.conv_dtype is not None and self.conv_dtype not in _DTYPES:
            raise ValueError(f"conv_dtype must be None or one of {sorted(_DTYPES)}, got {self.conv_dtype!r}")
        if not isinstance(self.layout, SegmentLayout):
            raise ValueError(f"layout must be a SegmentLayout, got {type(self.layout).__name__}")
        if isinstance(self.created_at, bool) or not isinstance(self.created_at, (int, float)):
            raise ValueError(f"created_at must be a float, got {self.created_at!r}")

    @property
    def num_pages(self) -> int:
        """KV pages covering ``num_tokens`` tokens (the last one may be partial)."""
        return math.ceil(self.num_tokens / self.page_size)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each tensor implied by this header."""
        lay = self.layout
        return {
            "kv": (
                lay.num_attn_layers, self.num_pages, 2, self.page_size,
                lay.num_kv_heads, lay.head_dim,
            ),
            "conv": (lay.num_gdn_layers, lay.conv_dim, lay.conv_kernel_size - 1),
            "ssm": (lay.num_gdn_layers, lay.num_v_heads, lay.key_head_dim, lay.value_head_dim),
            "token_ids": (self.num_tokens,),
        }

    def expected_dtypes(self) -> dict[str, torch.dtype]:
        """Dtype of each tensor implied by this header."""
        kv_dtype = _DTYPES[self.kv_dtype]
        conv_dtype = _DTYPES[self.conv_dtype or self.kv_dtype]
        return {"kv": kv_dtype, "conv": conv_dtype, "ssm": SSM_DTYPE, "token_ids": torch.int64}

    def to_json(self) -> str:
        """Serialise to a JSON object string (stable key order)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SegmentMeta:
        """Parse `to_json` output.

        Raises:
            ValueError: ``text`` is not a valid serialised `SegmentMeta`.
        """
        try:
            raw = json.loads(text)
            layout = SegmentLayout(**raw.pop("layout"))
            return cls(layout=layout, **raw)
        except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a serialised SegmentMeta: {e}") from e


@dataclass(frozen=True, slots=True, eq=False)
class Segment:
    """A segment's header and its four tensors (see the module docstring for shapes)."""

    meta: SegmentMeta
    tensors: dict[str, torch.Tensor]

    def on_host(self, pinned: bool, alloc: HostAlloc | None = None) -> Segment:
        """This segment with its tensors in host memory, page-locked with ``pinned`` (copies only
        what is not there yet): a pinned state's host-to-device copy on resume is queued, not waited
        for. ``alloc`` gives the pinned memory (``PinnedArena.alloc``); where it has no range left the
        tensor stays in, or is copied to, pageable memory: pinning anew on a serving thread stalls
        every CUDA call of the process (``storage.pinned_arena``), and a pageable state's copy back
        only costs its own import a synchronous copy. Without ``alloc`` the tensor is pinned here."""
        tensors = {}
        for name, t in self.tensors.items():
            if pinned and not t.is_pinned():
                out = alloc(tuple(t.shape), t.dtype) if alloc is not None else torch.empty_like(
                    t, device="cpu", pin_memory=True)
                # No range left: pageable (a CPU tensor as it is, not copied).
                t = t.to("cpu") if out is None else out.copy_(t)
            elif t.device.type != "cpu":
                t = t.to("cpu")
            tensors[name] = t
        return Segment(self.meta, tensors)

    @classmethod
    def from_tensors(
        cls,
        *,
        session_id: str,
        segment_id: str,
        model_fingerprint: str,
        tensors: Mapping[str, torch.Tensor],
        created_at: float | None = None,
    ) -> Segment:
        """Build a segment, deriving its header (layout, page size, dtype, hash) from the tensors.

        Args:
            session_id: The session the state belongs to (filesystem-safe id).
            segment_id: A unique id for this segment (filesystem-safe id).
            model_fingerprint: Identifies the model (weights and config) that produced the state.
            tensors: ``kv``, ``conv``, ``ssm`` and ``token_ids`` with the documented shapes.
            created_at: Unix time; now if omitted.

        Raises:
            ValueError: missing tensors, wrong ranks, dtypes or inconsistent shapes, or bad ids.
        """
        missing = [n for n in TENSOR_NAMES if n not in tensors]
        if missing or len(tensors) != len(TENSOR_NAMES):
            raise ValueError(f"tensors must be exactly {list(TENSOR_NAMES)}, got {sorted(tensors)}")
        kv, conv, ssm, ids = (tensors[n] for n in TENSOR_NAMES)
        ranks = {"kv": 6, "conv": 3, "ssm": 4, "token_ids": 1}
        for name, rank in ranks.items():
            shape = tuple(tensors[name].shape)
            if len(shape) != rank:
                raise ValueError(f"{name} must have {rank} dims, got shape {shape}")
        kv_dtype = str(kv.dtype).removeprefix("torch.")
        layout = SegmentLayout(
            num_attn_layers=kv.shape[0], num_kv_heads=kv.shape[4], head_dim=kv.shape[5],
            num_gdn_layers=conv.shape[0], conv_dim=conv.shape[1],
            conv_kernel_size=conv.shape[2] + 1,
            num_v_heads=ssm.shape[1], key_head_dim=ssm.shape[2], value_head_dim=ssm.shape[3],
        )
        meta = SegmentMeta(
            session_id=session_id, segment_id=segment_id, model_fingerprint=model_fingerprint,
            num_tokens=ids.shape[0], token_ids_hash=hash_token_ids(ids), page_size=kv.shape[3],
            kv_dtype=kv_dtype, layout=layout, conv_dtype=str(conv.dtype).removeprefix("torch."),
            created_at=time.time() if created_at is None else created_at,
        )
        segment = cls(meta, dict(tensors))
        problems = segment.problems()
        if problems:
            raise ValueError("inconsistent segment tensors: " + "; ".join(problems))
        return segment

    @property
    def nbytes(self) -> int:
        """Exact payload size: the sum of the tensors' ``numel * element_size``."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def problems(self) -> list[str]:
        """Every way the tensors disagree with the header; empty when the segment is consistent."""
        if sorted(self.tensors) != sorted(TENSOR_NAMES):
            return [f"tensors must be exactly {list(TENSOR_NAMES)}, got {sorted(self.tensors)}"]
        found: list[str] = []
        dtypes = self.meta.expected_dtypes()
        for name, shape in self.meta.expected_shapes().items():
            t = self.tensors[name]
            if tuple(t.shape) != shape:
                found.append(f"{name} has shape {tuple(t.shape)}, header implies {shape}")
            if t.dtype != dtypes[name]:
                found.append(f"{name} has dtype {t.dtype}, header implies {dtypes[name]}")
        if not found and hash_token_ids(self.tensors["token_ids"]) != self.meta.token_ids_hash:
            found.append(f"token_ids do not hash to the header's {self.meta.token_ids_hash}")
        return found

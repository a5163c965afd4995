"""The transfer interface of prefill/decode disaggregation: typed messages over one peer link.

A decode instance and a prefill instance exchange, per request (``xfer_id``)::

    decode                                               prefill
      Hello(layout) ─────────────────────────────────▶               once per link,
      ◀───────────────────────────────────────────── Hello(layout)  both ways
      PrefillRequest(token_ids, held_len, sampling) ─▶
      ◀── PrefillDeclined(num_cached)       instead of all below: the decode side is the cheaper
                                            side to prefill on (``may_decline``; see the class)
      ◀── PrefillProgress(num_computed)     after every prefill step (a heartbeat)
      ◀── KVLayer(layer, first_page, kv)    one per full-attention layer
      ◀── GDNState(conv, ssm)               the state at the prompt's end, every GDN layer
      ◀── PrefillDone(first_token, num_cached)
          or, instead of any of the four:  ◀── TransferError(message)  (that request failed)
      Goodbye ────────────────────────────────────────▶               the decode closes the link

``KVTransport`` is the seam: ``engine.transfer.dist_transport`` implements it over ``torch.distributed``
(gloo on CPU, NCCL for the tensors between GPUs), and it is what a NIXL or Mooncake backend would
implement later (one-sided RDMA writes into the decode side's pre-registered pages instead of
messages; the handshake above stays). Any ``TransportError`` leaves the link unusable: both sides
drop it, release what the request held, and the decode side reconnects for the next request.

Messages are frozen dataclasses dispatched on their type. On the wire (``split_message`` /
``join_message``) a message is its kind code, a dict of its plain fields (ints, floats, strings,
int tuples, None) and its tensors in field order; joining validates every field, so a malformed
or hostile peer raises ``TransportError`` and never builds a half-valid message.
"""

from __future__ import annotations

import abc
import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from phloem.engine.errors import EngineError

__all__ = [
    "GDNState",
    "Goodbye",
    "Hello",
    "KVLayer",
    "KVTransport",
    "Message",
    "PrefillDeclined",
    "PrefillDone",
    "PrefillProgress",
    "PrefillRequest",
    "TransferError",
    "TransportError",
    "join_message",
    "split_message",
]


class TransportError(EngineError):
    """The link to the peer failed (peer gone, timeout, malformed message); it is unusable now."""


@dataclass(frozen=True, slots=True)
class Hello:
    """Each side's cache layout; the link is refused unless both agree (same model and page size).

    ``kv_shape`` is the KV pool's shape without its page axis: ``[attn_layers, 2, page_size,
    kv_heads, head_dim]``; ``conv_shape`` / ``ssm_shape`` are one slot's state, every GDN layer.
    """

    role: str
    page_size: int
    vocab_size: int
    kv_shape: tuple[int, ...]
    kv_dtype: str
    conv_shape: tuple[int, ...]
    conv_dtype: str
    ssm_shape: tuple[int, ...]

    def layout(self) -> tuple[object, ...]:
        """Everything but the role: what must be equal on both sides."""
        return dataclasses.astuple(self)[1:]


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """Compute ``token_ids`` (the prompt, int64 ``[N]``) and sample its first token.

    The decode side already holds the first ``held_len`` tokens (a checkpoint there) and has
    pre-allocated pages for page indices ``held_len // page_size`` .. ``ceil(N / page_size) - 1``
    and one state slot; only those pages come back. ``may_decline`` (1 or 0): the prefill side may
    answer ``PrefillDeclined`` instead of computing. ``namespace``: the prefix-cache namespace
    (tenant) of the request; the prefill side matches and publishes in it.
    """

    xfer_id: int
    token_ids: torch.Tensor
    held_len: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    may_decline: int
    namespace: str | None = None


@dataclass(frozen=True, slots=True)
class PrefillDeclined:
    """The prefill side will not compute the request: it holds ``num_cached`` tokens of the prompt,
    so it would recompute more tokens the decode side already holds (``held_len - num_cached``)
    than the decode side has left to compute itself (``N - held_len``). The decode side releases
    its reservation and prefills locally. Happens after the prefill side lost the conversation
    (evicted, restarted, a failed transfer retried locally) or when a session was resumed on the
    decode side; not an error (the link stays up)."""

    xfer_id: int
    num_cached: int


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    xfer_id: int
    num_computed: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class KVLayer:
    """KV of one full-attention layer, pages ``first_page ..`` of the prompt: ``[n, 2, ps, Hkv, D]``."""

    xfer_id: int
    layer: int
    first_page: int
    kv: torch.Tensor


@dataclass(frozen=True, slots=True)
class GDNState:
    """Conv ``[G, conv_dim, kernel - 1]`` and recurrent ``[G, Hv, Dk, Dv]`` (fp32) state at the prompt's end."""

    xfer_id: int
    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass(frozen=True, slots=True)
class PrefillDone:
    """Success: the first sampled token, and how many prompt tokens the prefill side took from its cache."""

    xfer_id: int
    first_token: int
    num_cached: int


@dataclass(frozen=True, slots=True)
class TransferError:
    """The request failed on the prefill side (the link stays up); ``message`` says why."""

    xfer_id: int
    message: str


@dataclass(frozen=True, slots=True)
class Goodbye:
    """The decode side closes the link."""


Message: TypeAlias = (
    Hello | PrefillRequest | PrefillProgress | KVLayer | GDNState | PrefillDone | TransferError | Goodbye
    | PrefillDeclined
)

# Wire kind codes: stable, never reused.
_KINDS: dict[type, int] = {
    Hello: 1, PrefillRequest: 2, PrefillProgress: 3, KVLayer: 4, GDNState: 5, PrefillDone: 6,
    TransferError: 7, Goodbye: 8, PrefillDeclined: 9,
}  # fmt: skip
_BY_KIND = {code: cls for cls, code in _KINDS.items()}


def split_message(message: Message) -> tuple[int, dict[str, Any], list[torch.Tensor]]:
    """``(kind, plain fields, tensors in field order)`` of ``message``."""
    kind = _KINDS[type(message)]
    meta: dict[str, Any] = {}
    tensors: list[torch.Tensor] = []
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        else:
            meta[f.name] = list(value) if isinstance(value, tuple) else value
    return kind, meta, tensors


def join_message(kind: int, meta: dict[str, Any], tensors: list[torch.Tensor]) -> Message:
    """Rebuild a message from its wire parts.

    Raises:
        TransportError: unknown kind, missing or extra fields, or a field of the wrong type.
    """
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise TransportError(f"bad message: unknown kind {kind!r}")
    if not isinstance(meta, dict):
        raise TransportError(f"bad message: expected a field dict, got {type(meta).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    tensor_names = [n for n in names if hints[n] is torch.Tensor]
    plain = [n for n in names if n not in tensor_names]
    if sorted(meta) != sorted(plain) or len(tensors) != len(tensor_names):
        raise TransportError(
            f"bad message: {cls.__name__} expects fields {plain} and {len(tensor_names)} tensor(s), got "
            f"{sorted(meta)} and {len(tensors)} tensor(s)"
        )
    values = {n: _checked(cls.__name__, n, hints[n], meta[n]) for n in plain}
    values.update(zip(tensor_names, tensors))
    return cls(**values)  # type: ignore[no-any-return]


def _checked(owner: str, name: str, hint: Any, value: Any) -> Any:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, list):
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return tuple(value)
    raise TransportError(f"bad message: {owner}.{name}: expected {hint}, got {value!r:.80}")


class KVTransport(abc.ABC):
    """One link between a decode and a prefill instance: ordered, reliable, typed messages.

    The interface NIXL or Mooncake would implement later (see the module docstring). ``send``
    and ``recv`` are called from one thread at a time per side; the link carries one transfer at
    a time. Every failure is a ``TransportError``, after which the link is dead (``close`` it).
    """

    @property
    @abc.abstractmethod
    def peer(self) -> str:
        """Who is at the other end, for messages (e.g. ``"prefill 10.0.0.2:9555 (link 3)"``)."""

    @abc.abstractmethod
    def send(self, message: Message, timeout_s: float) -> None:
        """Send ``message`` (its tensors are copied or sent before this returns).

        Raises:
            TransportError: the peer is gone or did not take it within ``timeout_s``.
        """

    @abc.abstractmethod
    def recv(self, timeout_s: float | None) -> Message:
        """The next message; ``timeout_s`` None waits as long as the link lives (an idle peer).

        Raises:
            TransportError: the peer is gone, nothing came within ``timeout_s``, or the message
                is malformed.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Drop the link (idempotent); a peer blocked on it gets a ``TransportError``."""

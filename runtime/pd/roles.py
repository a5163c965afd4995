"""Roles of prefill/decode disaggregation and their settings (``phloem serve --role``).

    both     one process prefills and decodes (the default; nothing below applies)
    prefill  computes prompts for one decode instance and streams their KV and GDN state to it;
             serves no HTTP. ``--pd-peer HOST:PORT`` is the address it listens on.
    decode   the HTTP server; it sends each request's prompt to the prefill instance at
             ``--pd-peer HOST:PORT``, installs the returned state and decodes.

Decisions (docs/disaggregation.md has the whole picture):

- Whichever side holds the prefix computes the new tokens. The decode side holds a session's
  whole history (its outputs were decoded there; the prefill side only ever saw prompts), so a
  prompt that extends a prefix cached on the decode side by at most ``local_prefill_tokens``
  tokens (default 512: a later turn of an agent) is prefilled there, locally; anything else (a
  fresh prompt, a long append) goes to the prefill instance, which computes from its own deepest
  checkpoint and sends back only the pages the decode side lacks. 0 sends every prompt.
- A transfer that fails (peer gone, timeout, malformed message, the prefill refused) releases
  everything on both sides; with ``retry_local`` (default) the request is then retried once on the
  decode instance, which has the model too, else it fails with ``EngineError``.
- After a failed connection attempt the decode side does not try again for
  ``reconnect_interval_s``; requests in that window take the failure path at once.

This module imports no torch: the CLI builds it (``cli.config.ServerConfig.pd``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ROLES", "PDConfig", "parse_peer"]

ROLES = ("both", "prefill", "decode")


def parse_peer(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` for IPv6); port 0 lets a prefill instance pick a free one.

    Raises:
        ValueError: not ``HOST:PORT`` with a port in [0, 65535].
    """
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"pd_peer: expected HOST:PORT with a port in [0, 65535], got {text!r}")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class PDConfig:
    """Prefill/decode disaggregation settings of one instance.

    Args:
        role: ``"both"``, ``"prefill"`` or ``"decode"``.
        peer: ``HOST:PORT`` of the rendezvous: the prefill instance listens there, the decode
            instance connects to it. Required for ``prefill`` and ``decode``; None for ``both``.
        timeout_s: Longest wait for one message once a transfer started (the prefill side sends
            a heartbeat after every prefill step, so this bounds one step, not a whole prompt).
        connect_timeout_s: Longest wait to reach the peer and join a link.
        reconnect_interval_s: After a failed connection, how long the decode side waits before
            trying again.
        local_prefill_tokens: The decode side computes a prompt itself when it extends a prefix
            cached there by at most this many tokens (0: never).
        retry_local: A failed transfer is retried once on the decode instance (else the request
            fails with a clear error).

    Raises:
        ValueError: a field is out of range, or ``peer`` is missing / given for ``both``.
    """

    role: str = "both"
    peer: str | None = None
    timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    reconnect_interval_s: float = 5.0
    local_prefill_tokens: int = 512
    retry_local: bool = True

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"pd_role: expected one of {ROLES}, got {self.role!r}")
        if self.role == "both" and self.peer is not None:
            raise ValueError("pd_peer: only a prefill or decode instance has a peer (--role prefill|decode)")
        if self.role != "both":
            if self.peer is None:
                raise ValueError(f"pd_peer: --role {self.role} needs the peer address HOST:PORT (--pd-peer)")
            parse_peer(self.peer)
        for name in ("timeout_s", "connect_timeout_s", "reconnect_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86_400:
                raise ValueError(f"pd_{name}: expected seconds in (0, 86400], got {value!r}")
        if isinstance(self.local_prefill_tokens, bool) or not isinstance(self.local_prefill_tokens, int) or (
                self.local_prefill_tokens < 0):
            raise ValueError(f"pd_local_prefill_tokens: expected an integer >= 0, got {self.local_prefill_tokens!r}")

    @property
    def is_disaggregated(self) -> bool:
        return self.role != "both"

    @property
    def address(self) -> tuple[str, int]:
        """The peer's ``(host, port)``.

        Raises:
            ValueError: this instance has no peer (role ``both``).
        """
        if self.peer is None:
            raise ValueError("pd_peer: this instance has no peer (role 'both')")
        return parse_peer(self.peer)

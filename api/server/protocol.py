"""uvicorn's HTTP/1.1 protocol with a deadline for request heads and a cap on connections.

uvicorn closes a keep-alive connection that stays silent (``timeout_keep_alive``), but a client
that sends one header byte every few seconds keeps a connection, and its buffer, forever; a few
hundred such clients hold the server's sockets without ever authenticating. So each connection
here gets a deadline: from when it opens (and from the end of each response) it must deliver a
whole request head within ``header_timeout_s``, or it is closed. Connections beyond
``max_connections`` are closed as soon as they open. A body that trickles in after its head is
the route's to time out (and a reverse proxy's: docs/api.md, "Security model").
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "guarded_http_protocol"]

logger = logging.getLogger(__name__)


class GuardedH11Protocol(H11Protocol):
    """``H11Protocol`` with a request-head deadline and a connection cap (module docstring).

    Args:
        header_timeout_s: Seconds a connection may take to send a whole request head.
        max_connections: Open connections at most (this one included).
        *args, **kwargs: ``H11Protocol``'s.
    """

    def __init__(self, *args: Any, header_timeout_s: float, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout_s = header_timeout_s
        self._max_connections = max_connections
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._max_connections:
            logger.warning("connection refused: %d connections are open, the most allowed (--max-connections)",
                           len(self.connections) - 1)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_deadline is not None and self._head_complete():
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self._head_complete():
            self._arm()  # a keep-alive connection: the next request head has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _head_complete(self) -> bool:
        """The peer sent a whole request head (or the socket became a WebSocket)."""
        return self.conn.their_state is not h11.IDLE or self.transport.get_protocol() is not self

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self._header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _expire(self) -> None:
        self._head_deadline = None
        if not self._head_complete() and not self.transport.is_closing():
            logger.info("connection closed: no whole request head within %.1f s (--header-timeout)",
                        self._header_timeout_s)
            self.transport.close()


def guarded_http_protocol(header_timeout_s: float, max_connections: int) -> Any:
    """The ``http`` argument of ``uvicorn.Config``: ``GuardedH11Protocol`` with these limits."""
    return functools.partial(GuardedH11Protocol, header_timeout_s=header_timeout_s,
                             max_connections=max_connections)

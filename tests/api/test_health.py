"""The body of ``GET /health``: ``ok``, or ``degraded`` with the sessions layer's reason."""

from __future__ import annotations

from typing import Any, cast

from phloem.api.server.health import health_body


class _Manager:
    def __init__(self, reason: str | None) -> None:
        self.reason = reason

    def health(self) -> str | None:
        return self.reason


def test_ok_and_degraded_bodies() -> None:
    assert health_body(cast(Any, _Manager(None)), "m") == {"status": "ok", "model": "m"}
    reason = "session index unavailable (sessions are served from the journal): refused"
    assert health_body(cast(Any, _Manager(reason)), "m") == {
        "status": "degraded", "model": "m", "reason": reason}

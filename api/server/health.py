"""The body of ``GET /health`` while the engine runs: ``ok``, or ``degraded`` with a reason.

Degraded is still 200: the server serves every request (e.g. with the session index
unreachable, sessions keep working on the journal and the index is resynced once it answers),
so a load balancer must not take it out of rotation; monitoring reads ``status`` and ``reason``.
A stopped engine is 503 (``app.create_app``).
"""

from __future__ import annotations

from typing import Any

from phloem.sessions import SessionManager

__all__ = ["health_body"]


def health_body(manager: SessionManager, model_id: str) -> dict[str, Any]:
    """``{"status": "ok", "model": ...}``, or ``"degraded"`` with a ``reason``.

    Args:
        manager: The session manager (it knows whether its index answers).
        model_id: The served model's name.

    Returns:
        The JSON body.
    """
    reason = manager.health()
    if reason is None:
        return {"status": "ok", "model": model_id}
    return {"status": "degraded", "model": model_id, "reason": reason}

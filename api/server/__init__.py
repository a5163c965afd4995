"""The server: the Litestar app (``app.create_app``) and ``phloem serve`` (``app.serve``).

``app`` wires the routes of each protocol to the sessions layer: the native sessions API
(``native/``: REST routes, the WebSocket, conversions to the wire schemas), the OpenAI-compatible
routes (``openai/``), the Responses API (``responses/``) and Anthropic's Messages API
(``anthropic/``). Beside them, what every route shares: ``context`` (the per-request context
and streaming helpers), ``errors`` (problem+json and each protocol's error envelope), ``auth``,
``guard`` (Host/Origin and content-type checks), ``idempotency``, ``limits`` (per-key quotas),
``pacing`` (keep-alives, idle timeout), ``metrics``, ``observe`` (request ids, access log),
``health`` and ``protocol`` (uvicorn's guarded HTTP protocol).

May import: ``phloem.api.schemas``, ``phloem.sessions``, ``phloem.runtime``, ``phloem.storage``;
never ``phloem.api.sdk``.
"""

"""HTTP/WebSocket API (Litestar + msgspec) and the Python SDK (``api/client.py``).

May import: ``phloem.sessions``, ``phloem.runtime``. The SDK imports only the wire schemas.
"""

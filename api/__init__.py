"""The HTTP/WebSocket API: the server (``api/server/``) and the Python SDK (``api/sdk/``).

    from phloem.api import Client, AsyncClient      # the SDK (docs/sdk.md)
    from phloem.api.server.app import create_app    # the Litestar app (``phloem serve``)

The two share only the wire schemas (``api/schemas.py`` and ``api/_wire_agents.py``, msgspec
Structs). This package exports the SDK, which imports no torch and no server module, so
``import phloem.api`` stays light; the server is imported from ``phloem.api.server.app``.
``phloem.api.client`` is the SDK's former import path, kept for one release.

May import: ``phloem.sessions``, ``phloem.runtime`` (the server only). The SDK imports only the
wire schemas (import-linter contracts in pyproject.toml).
"""

from phloem.api.sdk import *  # noqa: F403  (the SDK's names are this package's)
from phloem.api.sdk import __all__ as __all__

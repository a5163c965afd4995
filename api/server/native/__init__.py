"""The native sessions API: REST routes (``routes``), the WebSocket (``ws``) and conversions
between the sessions layer and the wire schemas (``convert``)."""

"""The OpenAI-compatible routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``
(``routes``), their request schemas (``schemas``), response bodies (``output``) and streamed
chunks (``stream``)."""

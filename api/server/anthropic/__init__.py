"""Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens`` (``routes``),
its schemas (``schemas``), the conversion to and from sessions (``convert``) and its stream
events (``stream``)."""

"""The Responses API, a view of sessions: ``/v1/responses`` (``routes``), its schemas
(``schemas``), input items (``input``), planning (``plan``) and starting (``start``) a turn, its
output items (``output``) and stream events (``stream``)."""

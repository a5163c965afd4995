"""The engine's error hierarchy: bad input at the engine boundary, and expected shortages."""

from __future__ import annotations

__all__ = ["CapacityExceeded", "CorruptStep", "EngineError", "InvalidRequest"]


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequest(EngineError, ValueError):
    """A request the engine can never serve as given (bad token ids, empty prompt, too long...).

    The message names the offending field and states what was expected and what was received.
    """


class CapacityExceeded(EngineError):
    """The request is valid but cannot fit the engine's pools even when they are empty."""


class CorruptStep(EngineError):
    """A step produced what no correct forward can (a sampled id outside the vocabulary).

    Its requests are dropped without publishing anything to the prefix cache: their state on
    the device no longer matches their counters.
    """

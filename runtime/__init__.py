"""Processes and loops: config, the engine loop thread, the asyncio bridge, the demo model.

Role: run one ``Engine`` on its own thread (``EngineLoop``) and give the asyncio API an
``EngineClient`` that never blocks the event loop; the ``PHLOEM_*`` environment (``env``, also
the process's NCCL defaults); preflight checks; the
built-in models (the trained default, ``builtin_model``; the random-weight one for tests,
``default_model``) and the benchmark shapes (``model_shapes``); the prefill/decode instances
(``runtime.pd``). The ``phloem`` command that wires it all is ``phloem.cli``.

May import: the engine's public API only (``phloem.engine``, ``phloem.engine.config``,
``phloem.engine.transfer``, ``phloem.engine.parallel``; an import-linter contract), and
``phloem.storage``.

The engine-backed names load on first access, so ``phloem --help`` and the SDK side of
``phloem demo`` never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phloem._lazy import lazy_exports
from phloem.engine.config import EngineConfig

if TYPE_CHECKING:
    from phloem.runtime.default_model import ensure_default_model
    from phloem.runtime.engine_client import EngineClient
    from phloem.runtime.engine_commands import EngineStats, PrefixState
    from phloem.runtime.engine_loop import EngineLoop
    from phloem.runtime.host_memory import ProcessMemory, process_memory

__all__ = [
    "EngineClient", "EngineConfig", "EngineLoop", "EngineStats", "PrefixState", "ProcessMemory",
    "ensure_default_model", "process_memory",
]

_LAZY = {
    "EngineClient": "phloem.runtime.engine_client",
    "EngineLoop": "phloem.runtime.engine_loop",
    "EngineStats": "phloem.runtime.engine_commands",
    "PrefixState": "phloem.runtime.engine_commands",
    "ensure_default_model": "phloem.runtime.default_model",
    "ProcessMemory": "phloem.runtime.host_memory",
    "process_memory": "phloem.runtime.host_memory",
}


__getattr__ = lazy_exports(__name__, _LAZY)

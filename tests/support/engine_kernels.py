"""Give the engines a test builds a ``KernelConfig``.

``Engine.from_pretrained`` takes no kernel choices yet: it reaches ``engine.loader.load_model``,
``engine.model_runner.build_runner`` and ``engine.tp_workers.WorkerSpec``, whose ``kernels``
arguments default to ``KernelConfig()``. ``use_kernels`` binds ``config`` into the names
``engine.engine`` calls, so the op table, the attention backend and every tensor-parallel rank
take it, exactly as a ``kernels`` option of the engine would pass it down.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from phloem.kernels.config import KernelConfig


def use_kernels(config: KernelConfig, set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Engines built after this call take ``config`` (``set_attr``: ``monkeypatch.setattr`` in a
    test, so the change ends with it; ``setattr`` in a script of its own)."""
    from phloem.engine import engine, loader, model_runner, tp_workers

    set_attr(engine, "load_model", functools.partial(loader.load_model, kernels=config))
    set_attr(engine, "build_runner", functools.partial(model_runner.build_runner, kernels=config))
    set_attr(engine, "WorkerSpec", functools.partial(tp_workers.WorkerSpec, kernels=config))

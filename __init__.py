"""Phloem: an inference runtime for LLM agents.

The repository root is the ``phloem`` package. Sub-packages, in import order (a package may import
only those to its right; ``storage`` is a leaf importable from ``runtime`` and ``sessions``)::

    cli -> benchmarks -> api -> sessions -> runtime -> engine -> kernels        storage (leaf)

``cli`` is the ``phloem`` command (the composition root); ``benchmarks`` every ``phloem bench``
and the sweep tools.

See ``docs/architecture.md`` for the data flow.
"""

__version__ = "0.1.0"

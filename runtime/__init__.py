"""Processes and loops: config, the engine loop thread, the asyncio bridge, CLI.

May import: ``phloem.engine``, ``phloem.storage``.
"""

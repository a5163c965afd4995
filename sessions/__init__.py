"""Sessions as first-class objects: lifecycle, pins/TTL, fork, spill/resume, chat templates.

May import: ``phloem.runtime``, ``phloem.storage``.
"""

"""Benchmarks: every ``phloem bench`` command, its reporting and plots, and the sweep tools.

Role: ``benchmarks.cli`` adds the ``phloem bench`` subcommands (decode, long-context,
prefix-cache, agentic, trie) to the CLI; ``decode`` / ``served`` / ``report`` time decode and
prefill against the rooflines measured in the same run; ``simulated_tp`` times one rank of a
TP=N step alone and ``shard_bytes`` gives a rank's bytes and collectives from the config (the
projection of ``--simulate-tp``); ``eight_gpu`` is the eight-GPU run (``python3 -m``, with a CPU
dry mode); ``prefix_cache`` and ``resume`` time the
prefix cache and session resume on the engine; ``agentic`` / ``plots`` / ``trie`` drive a server
over HTTP (our SDK, and the external harness tokenspeed-trie), started by ``local_server``;
``tool_wait`` draws the agents' waits and ``fleet_report`` reads the tiers' figures from
``/metrics``. ``benchmarks/sweeps/`` holds
scripts run by path (kernel tile sweeps, traces, CPU data-structure benchmarks). The current
figures are in ``docs/benchmarks.md``.

May import: ``phloem.api``, ``phloem.sessions``, ``phloem.runtime``, ``phloem.engine``,
``phloem.kernels``, ``phloem.storage``; only ``phloem.cli`` imports it.
"""

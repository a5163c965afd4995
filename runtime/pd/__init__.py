"""Prefill/decode disaggregation: the roles, the link handshake and the two instances.

Modules::

    roles    ``PDConfig`` (``--role``, ``--pd-peer``) and its parsing; imports without torch
    link     the decode side's link to its prefill instance: hello, one transfer, its outcome
    decode   the decode instance: an ``EngineClient`` that asks the prefill instance first
    prefill  the prefill instance: serves transfers, no HTTP API
    sender   the prefill side's sender thread (layer ``l`` travels while later layers compute)

The transport and the messages are the engine's (``phloem.engine.transfer``); docs/disaggregation.md
describes the protocol. Nothing is imported here, so ``cli.config`` can read ``roles``
without torch.
"""

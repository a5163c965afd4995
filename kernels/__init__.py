"""Compute kernels: plain-PyTorch references and (later) Triton kernels with the same signatures.

Role: every op the model needs that is more than one torch call, expressed over the engine's
memory layout (KV pages addressed by page tables, GDN state addressed by slot indices) so that a
fused GPU kernel can replace the reference without changing its caller.

May import: torch, triton, flashinfer. Nothing of ours.
"""

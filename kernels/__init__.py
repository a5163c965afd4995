"""Compute kernels: plain-PyTorch references and the Triton / FlashInfer / fla versions that replace them.

Role: every op the model needs that is more than one torch call, expressed over the engine's
memory layout (KV pages addressed by page tables, GDN state addressed by slot indices) so that a
fused GPU kernel can replace the reference without changing its caller.

One folder per op family, each with its torch reference beside the versions that replace it
(same signature and semantics)::

    attention/   paged attention, RoPE, the QK norm + RoPE prologue; FlashInfer, Triton decode
    gdn/         gated delta rule and its causal conv1d; fla-core prefill, Triton decode
    moe/         routing and experts, the router folded into the projection before it; Triton
    linear/      projections, alone and fused with the row ops around them; Triton one-token GEMVs
    norm/        RMS norms, the TP all-reduce fused with add + norm; Triton
    sampling/    argmax; Triton
    common/      launch helpers the Triton kernels share (grid sizing, programmatic dependent launch)

In every folder ``reference.py`` is the torch reference (other torch modules beside it say so
in their docstring), ``triton_*.py`` the Triton launchers and kernels, ``flashinfer.py`` /
``fla.py`` the library wrappers. ``dispatch.get_ops`` binds the model's op table to the
references or the Triton versions; ``config.KernelConfig`` holds the choices.

NOTE: ``@triton.jit`` reads ``TRITON_INTERPRET`` when a module is imported, so on CPU set
``TRITON_INTERPRET=1`` before the first import of any ``triton_*`` module. The folders'
``__init__`` import nothing, so importing a reference imports no Triton code.

May import: torch, triton, flashinfer, fla. Nothing of ours.
"""

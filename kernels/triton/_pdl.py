"""Programmatic dependent launch (PDL) for the decode kernels: opt-in with ``PHLOEM_PDL=1``.

With PDL a kernel may be launched while the kernel before it in the stream is still finishing
(Hopper's ``griddepcontrol``; Triton 3.6 launches with ``launch_pdl=True``, and CUDA graphs keep it
as a programmatic edge), so the gap between dependent launches shrinks. Each kernel that opts in
starts with ``gdc_wait()`` before it touches memory: that waits for the previous kernel to complete
and its writes to be visible, so the results are the same as without PDL; no kernel triggers its
dependents early (``gdc_launch_dependents``), so the overlap is only the launch itself.

Why opt-in: it has not run on a GPU yet (the batch-1 decode step is ~500 launches, and the gaps
between them are part of what keeps it at 47% of the roofline; ``docs/benchmarks.md``). ``PDL`` is a
``tl.constexpr`` global read by the kernels (``if PDL: gdc_wait()``; the Triton interpreter cannot
run the instruction, so it stays off there) and ``LAUNCH_PDL`` the launch option.
"""

from __future__ import annotations

import os

import triton.language as tl

__all__ = ["ENV_VAR", "LAUNCH_PDL", "PDL"]

ENV_VAR = "PHLOEM_PDL"

LAUNCH_PDL: bool = os.environ.get(ENV_VAR, "") == "1" and os.environ.get("TRITON_INTERPRET", "") in ("", "0")
PDL = tl.constexpr(LAUNCH_PDL)

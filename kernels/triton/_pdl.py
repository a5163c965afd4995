"""Programmatic dependent launch (PDL) for the decode kernels: on for sm_90+ GPUs (``PHLOEM_PDL``).

With PDL a kernel may be launched while the kernel before it in the stream is still finishing
(Hopper's ``griddepcontrol``; Triton 3.6 launches with ``launch_pdl=True``, and CUDA graphs keep it
as a programmatic edge), so the gap between dependent launches shrinks. Each kernel that opts in
starts with ``gdc_launch_dependents(); gdc_wait()``: the first lets the next kernel launch as soon
as every program of this one has started (its programs then wait, resident, in their own
``gdc_wait``), the second waits for the previous kernel to complete and its writes to be visible
before this one reads anything the previous one may write, so the results are the same as
without PDL. What a kernel reads before its wait must be written by no kernel before it in the
step: the weights (the one-token GEMVs load their first tile there, ``kernels/triton/gemv.py``;
the experts' kernels the shared expert's, ``kernels/triton/moe_token.py``), the step's inputs
(copied in before its first kernel) and a layer's own conv and recurrent state, whose only writer
in a step is the kernel that reads it (the in_proj GEMV's conv operands, the GDN decode step's
state tile). So the memory stream starts while the kernel before finishes. (What was queued
before the step, the input copies or a copy-on-write of a state slot, has completed by then: a
kernel that does not trigger its dependents lets the next one launch only when it ends.)

On by default where the GPU has it (compute capability 9.0 and up: ``griddepcontrol`` is a
Hopper instruction): measured on an H200, the batch-1 decode graph of the 35B-A3B shape went from
2.56 to 2.41 ms, with the same tokens bit for bit (``tests/engine/test_gpu_engine.py``).
``PHLOEM_PDL=0`` turns it off, ``PHLOEM_PDL=1`` forces it on (the codegen test compiles both ways on
a machine without a GPU). ``PDL`` is a ``tl.constexpr`` global read by the kernels (``if PDL:``;
the Triton interpreter cannot run the instructions, so it stays off there) and ``LAUNCH_PDL`` the
launch option; both are fixed when this module is first imported.
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

from phloem.kernels.triton._env import interpreting

__all__ = ["ENV_VAR", "LAUNCH_PDL", "PDL", "pdl_wanted"]

ENV_VAR = "PHLOEM_PDL"


def pdl_wanted() -> bool:
    """``PHLOEM_PDL`` ``1``: on, ``0``: off; unset: on when the current CUDA GPU is sm_90 or newer.
    Never under the Triton interpreter."""
    if interpreting():
        return False
    choice = os.environ.get(ENV_VAR, "").strip()
    if choice in ("0", "1"):
        return choice == "1"
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


LAUNCH_PDL: bool = pdl_wanted()
PDL = tl.constexpr(LAUNCH_PDL)

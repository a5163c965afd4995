"""Programmatic dependent launch (PDL) for the decode kernels: whether a launch uses it.

With PDL a kernel may be launched while the kernel before it in the stream is still finishing
(Hopper's ``griddepcontrol``; Triton launches with ``launch_pdl=True``, and CUDA graphs keep it as
a programmatic edge), so the gap between dependent launches shrinks. Each kernel that opts in
takes a ``PDL: tl.constexpr`` argument and, with it, starts with ``gdc_launch_dependents();
gdc_wait()``: the first lets the next kernel launch as soon as every program of this one has
started (its programs then wait, resident, in their own ``gdc_wait``), the second waits for the
previous kernel to complete and its writes to be visible before this one reads anything the
previous one may write, so the results are the same as without PDL. What a kernel reads before
its wait must be written by no kernel before it in the step: the weights (the one-token GEMVs load
their first tile there, ``kernels/linear/triton_gemv.py``; the experts' kernels the shared expert's,
``kernels/moe/triton_token.py``), the step's inputs (copied in before its first kernel) and a
layer's own conv and recurrent state, whose only writer in a step is the kernel that reads it. So
the memory stream starts while the kernel before finishes. (What was queued before the step, the
input copies or a copy-on-write of a state slot, has completed by then: a kernel that does not
trigger its dependents lets the next one launch only when it ends.)

Every launcher of such a kernel takes ``pdl: bool = False`` and passes it as both the constexpr
and ``launch_pdl``, which must agree (a kernel launched early that does not wait would read
unfinished writes). ``kernels.dispatch.get_ops`` binds the choice ``use_pdl`` makes from
``KernelConfig.pdl`` into the op table once, so the model never passes it.
"""

from __future__ import annotations

import torch
import triton

__all__ = ["use_pdl"]


def use_pdl(choice: bool | None, device: torch.device) -> bool:
    """``choice`` (``KernelConfig.pdl``) resolved for ``device``: ``None`` is on for CUDA GPUs of
    compute capability 9.0 and up (``griddepcontrol`` is a Hopper instruction). Never under the
    Triton interpreter, which cannot run the instructions."""
    if triton.knobs.runtime.interpret:
        return False
    if choice is not None:
        return choice
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9

"""The kernel choices from the environment (``runtime.env.kernel_config``): the only place a
``PHLOEM_*`` kernel variable is read; ``kernels/`` itself takes a ``KernelConfig``."""

from __future__ import annotations

import pytest

from phloem.kernels.config import KernelConfig
from phloem.runtime.env import VARIABLES, kernel_config


def test_unset_or_empty_is_the_default_config() -> None:
    assert kernel_config({}) == KernelConfig()
    assert kernel_config({name: "" for name in (v.name for v in VARIABLES)}) == KernelConfig()


def test_each_variable_sets_its_field() -> None:
    env = {"PHLOEM_KERNELS": " Triton ", "PHLOEM_TRITON_GEMV": "0", "PHLOEM_TRITON_DECODE_ATTENTION": "no",
           "PHLOEM_FUSED_DECODE": "false", "PHLOEM_PDL": "1", "PHLOEM_ONE_SHOT_ALLREDUCE": "on"}
    assert kernel_config(env) == KernelConfig(backend="triton", triton_gemv=False, triton_decode_attention=False,
                                              fused_decode=False, pdl=True, one_shot_allreduce=True)
    assert kernel_config({"PHLOEM_PDL": "0"}).pdl is False
    assert kernel_config({"PHLOEM_KERNELS": "torch"}).backend == "torch"


@pytest.mark.parametrize(("name", "value", "match"), [
    ("PHLOEM_KERNELS", "cuda", "PHLOEM_KERNELS must be 'auto', 'torch', 'triton' or unset, got 'cuda'"),
    ("PHLOEM_PDL", "2", r"PHLOEM_PDL: expected 1/true/yes/on or 0/false/no/off, got '2'"),
    ("PHLOEM_TRITON_GEMV", "maybe", "PHLOEM_TRITON_GEMV: expected"),
])  # fmt: skip
def test_anything_else_is_a_clear_error(name: str, value: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kernel_config({name: value})


def test_every_kernel_field_has_its_variable() -> None:
    """A new ``KernelConfig`` field needs its row in ``runtime.env.VARIABLES`` (and so in the docs)."""
    names = {v.name for v in VARIABLES}
    fields = {"backend": "PHLOEM_KERNELS"} | {f: f"PHLOEM_{f.upper()}" for f in KernelConfig.__dataclass_fields__ if f != "backend"}
    assert set(fields.values()) <= names, set(fields.values()) - names

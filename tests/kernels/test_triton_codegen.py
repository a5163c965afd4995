"""The Triton kernels compile for the H200 (sm_90) all the way to a cubin, on a machine without a GPU.

The interpreter tests check what a kernel computes; this checks that the compiler accepts it for
the device it runs on (a construct the interpreter tolerates can still fail in codegen), with the
dtypes of the real model and each constexpr variant (``tests/support/triton_codegen.py``, run in a
process of its own without ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).parents[1] / "support" / "triton_codegen.py"
sys.path.insert(0, str(SCRIPT.parent))
from triton_codegen import CASES  # noqa: E402

pytestmark = pytest.mark.slow  # compiles every kernel twice, in processes


@pytest.fixture(scope="module", params=["plain", "pdl"])
def results(request: pytest.FixtureRequest) -> dict[str, str]:
    """Every case compiled as launched by default, and with programmatic dependent launch
    (``PHLOEM_PDL=1``, read by the script through ``runtime.env.kernel_config``: the decode kernels'
    ``PDL`` constexpr, so they start with ``griddepcontrol.wait``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PHLOEM_PDL")}
    if request.param == "pdl":
        env["PHLOEM_PDL"] = "1"
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_h200(results: dict[str, str], case: str) -> None:
    assert results[case] == "ok", results[case]

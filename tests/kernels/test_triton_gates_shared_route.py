"""GDN gates and shared-expert routing: Triton vs reference, and reference vs HF's formulas."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

# @triton.jit binds to the interpreter at import time: on CPU switch it on before the kernels import.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from phloem.kernels.gdn.reference import gdn_gates as ref_gates  # noqa: E402
from phloem.kernels.gdn.triton_gates import gdn_gates  # noqa: E402
from phloem.kernels.moe.reference import moe_route, moe_route_shared as ref_route_shared  # noqa: E402
from phloem.kernels.moe.triton_route import moe_route_shared  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(("tokens", "heads"), [(1, 1), (3, 5), (7, 32)], ids=["T1H1", "T3H5-odd", "T7H32"])
def test_gdn_gates_match_reference_and_hf_formula(assert_close, tokens: int, heads: int) -> None:
    gen = torch.Generator().manual_seed(tokens * heads)
    ba = (torch.randn(tokens, 2 * heads, generator=gen) * 8).to(DEVICE)  # reaches softplus' >20 branch
    a, b = ba[:, heads:], ba[:, :heads]  # strided views, as the model passes them
    a_log = torch.rand(heads, generator=gen).mul(16).add(0.01).log().to(DEVICE)
    dt_bias = torch.randn(heads, generator=gen).to(DEVICE)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    g_ref, beta_ref = ref_gates(a, b, a_log, dt_bias)
    assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    assert_close(beta, beta_ref, atol=1e-6, rtol=1e-6)
    # HF Qwen3NextGatedDeltaNet: g = -A_log.float().exp() * softplus(a.float() + dt_bias)
    assert_close(g_ref, -a_log.float().exp() * F.softplus(a.float() + dt_bias), exact=True)


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 8, 2), (4, 16, 3), (5, 6, 6)], ids=["T1", "T4", "T5-k=E"])
def test_shared_route_matches_reference(assert_close, tokens: int, experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(experts)
    logits = torch.randn(tokens, experts + 1, generator=gen).to(DEVICE)
    w, ids = moe_route_shared(logits, top_k, True)
    w_ref, ids_ref = ref_route_shared(logits, top_k, True)
    assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(ids.sort(dim=1).values, ids_ref.sort(dim=1).values)
    # The last column is the shared expert: id E, weight sigmoid(gate logit).
    assert torch.equal(ids_ref[:, -1], torch.full((tokens,), experts, device=DEVICE))
    assert_close(w_ref[:, -1], torch.sigmoid(logits[:, -1]), exact=True)
    routed_w, routed_ids = moe_route(logits[:, :experts], top_k, True)
    assert torch.equal(ids_ref[:, :-1], routed_ids) and torch.equal(w_ref[:, :-1], routed_w)

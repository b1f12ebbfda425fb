"""Inside ``gdn_kcp.trace_host_path()``, ``torch.compile`` traces the host path:
the compiled code runs every program and pool itself (no opaque
``gdn_kcp::fwd`` / ``bwd`` call), Inductor reuses the pools' buffers, and the
results equal eager (fp64, outputs, final states and every gradient). One
compile of a forward and backward (about 2 minutes on 2 cores) serves every
test here."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs
from torch._inductor.utils import run_and_get_code

import gdn_kcp
from gdn_kcp import chunk_gated_delta_rule

CU = torch.tensor([0, 30, 70])  # two documents, one over two chunks (a walk of two steps)
T, H_qk, HV, K, V = 70, 1, 2, 16, 16


def leaves():
    q, k, v, g, beta = make_inputs(T, H_qk, HV, K, V, l2=False, seed=3)
    h0 = torch.randn(2, HV, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


def flat(q, k, v, g, beta, h0):
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=CU)


def step(fn, inputs):
    """Outputs, final states and the gradient of every input of one loss."""
    o, final_state = fn(*inputs)
    weight = torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((o * weight).sum() + final_state.square().sum(), inputs)
    return (o, final_state, *grads)


@pytest.fixture(scope="module")
def compiled():
    inputs = leaves()
    torch._dynamo.reset()
    with gdn_kcp.trace_host_path():
        results, codes = run_and_get_code(step, torch.compile(flat, fullgraph=True), inputs)
    return inputs, results, codes


def test_compiled_host_path_equals_eager(compiled):
    inputs, results, _ = compiled
    expected = step(flat, inputs)
    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state")
    for name, got, want in zip(names, results, expected, strict=True):
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=0, atol=1e-10), (name, float((got - want).abs().max()))


def test_output_code_runs_the_programs_and_reuses_pools(compiled):
    _, _, codes = compiled
    assert len(codes) == 2, "a forward and a backward graph"
    for code in codes:
        assert "gdn_kcp" not in code, "an opaque gdn_kcp op is still called"
        assert "# reuse" in code, "Inductor reused no buffer"


def test_without_the_block_compile_keeps_the_opaque_ops():
    inputs = leaves()
    torch._dynamo.reset()
    results, codes = run_and_get_code(step, torch.compile(flat, fullgraph=True), inputs)
    assert any("torch.ops.gdn_kcp.fwd" in code for code in codes)
    assert any("torch.ops.gdn_kcp.bwd" in code for code in codes)
    for got, want in zip(results, step(flat, inputs), strict=True):
        assert torch.allclose(got, want, rtol=0, atol=1e-10)

"""docs/compile.md, "Lowering: the traced host path": inside
``gdn_kcp.trace_host_path()``, ``torch.compile`` traces the host path. The
page's block (fp64, two documents, initial states, the in-kernel norm) runs
here: its compiled outputs, final states and every gradient equal eager, the
output code runs every program and pool itself (no opaque ``gdn_kcp::fwd`` /
``bwd`` call) and Inductor reuses buffers. One compile of a forward and
backward (about 2 minutes on 2 cores) serves the first two tests."""

from __future__ import annotations

import pytest
import torch
from doc_blocks import run_block
from torch._inductor.utils import run_and_get_code

HEADING = "Lowering: the traced host path"
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


@pytest.fixture(scope="module")
def block():
    torch._dynamo.reset()
    return run_and_get_code(run_block, "docs/compile.md", HEADING)


def eager_step(ns):
    """The block's step run eagerly on copies of its leaves: outputs and gradients."""
    leaves = [ns[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "b", "h0")]
    o, final_state = ns["step"](*leaves)
    grads = torch.autograd.grad(o.square().sum() + final_state.square().sum(), leaves)
    return (o, final_state, *grads)


def test_compiled_host_path_equals_eager(block):
    ns, _ = block
    got = (ns["o"], ns["final_state"], *(ns[n].grad for n in ("q", "k", "v", "g", "b", "h0")))
    for name, a, b in zip(NAMES, got, eager_step(ns), strict=True):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=0, atol=1e-10), (name, float((a - b).abs().max()))


def test_output_code_runs_the_programs_and_reuses_pools(block):
    _, codes = block
    assert len(codes) == 2, "a forward and a backward graph"
    for code in codes:
        assert "gdn_kcp" not in code, "an opaque gdn_kcp op is still called"
        assert "# reuse" in code, "Inductor reused no buffer"


def test_without_the_block_compile_keeps_the_opaque_ops(block):
    ns, _ = block
    torch._dynamo.reset()
    leaves = [ns[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "b", "h0")]

    def run():
        o, final_state = torch.compile(ns["step"], fullgraph=True)(*leaves)
        return (o, final_state, *torch.autograd.grad(o.square().sum() + final_state.square().sum(), leaves))

    got, codes = run_and_get_code(run)
    assert any("torch.ops.gdn_kcp.fwd" in code for code in codes)
    assert any("torch.ops.gdn_kcp.bwd" in code for code in codes)
    for name, a, b in zip(NAMES, got, eager_step(ns), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name

"""Each Triton program under TRITON_INTERPRET=1 against its torch twin: odd T,
several documents (zero-length and one-token ones among them), GVA, the L2 norm, crossing
fragments with S_in / lambda_end, K = V in {32, 64}, V = 128 (two value tiles); fp32 and bf16 inputs."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs, rel_rms
from program_cases import compare_with_torch

from gdn_kcp import build_kcp_context, gdn_kcp
from gdn_kcp.host.programs import use_programs

triton = pytest.importorskip("triton")

CASES = {
    "fp32-crossing-l2-K32": dict(bounds=(0, 70, 70, 71, 150), H_qk=1, HV=2, K=32, V=32, dtype=torch.float32,
                                 seed=1, l2=True, crossing=True),
    "fp32-gva-K64": dict(bounds=(0, 5, 5, 6, 97, 131), H_qk=2, HV=4, K=64, V=64, dtype=torch.float32, seed=2,
                         l2=False, crossing=False),
    "bf16-crossing-K32": dict(bounds=(0, 65, 65, 129), H_qk=1, HV=2, K=32, V=32, dtype=torch.bfloat16, seed=3,
                              l2=True, crossing=True),
    # V = 128: two value tiles of 64, so the programs that walk value tiles loop more than once
    "bf16-V128": dict(bounds=(0, 70, 131), H_qk=1, HV=1, K=32, V=128, dtype=torch.bfloat16, seed=7, l2=True,
                      crossing=False),
    # capped indexes: sentinel rows after the real ones, summaries from the device flags
    "fp32-capped-crossing": dict(bounds=(0, 70, 70, 71, 150), H_qk=1, HV=2, K=32, V=32, dtype=torch.float32,
                                 seed=5, l2=True, crossing=True, capped=True),
    "fp32-capped-local": dict(bounds=(0, 5, 5, 97, 131), H_qk=1, HV=2, K=32, V=32, dtype=torch.float32,
                              seed=6, l2=False, crossing=False, capped=True),
}
# fp32 inputs: both backends compute in fp32 in a different order; bf16 inputs
# also round the outputs and gradients to bf16 (2^-8 relative).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}

@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_programs_match_torch_twins(name):
    from gdn_kcp.kernels import triton as triton_programs

    case = CASES[name]
    errors = compare_with_torch(triton_programs, **case)
    assert len(errors) >= 20  # 22 without crossing (no summaries), 24 with the norm tapes
    bad = {k: v for k, v in errors.items() if not v < TOLERANCE[case["dtype"]]}
    assert not bad, bad

def test_forward_and_backward_through_the_ops_with_triton_programs():
    """A whole gdn_kcp call (ops, host path, workspace) on the Triton programs
    equals the same call on the torch programs."""
    bounds = [0, 20, 20, 150, 170]
    ctx = build_kcp_context(bounds)
    inputs = make_inputs(170, 1, 2, 32, 32, dtype=torch.float32, seed=4, l2=True)
    do = torch.randn(1, 170, 2, 32, generator=torch.Generator().manual_seed(5))
    results = []
    for backend in ("torch", "triton"):
        leaves = [x.clone().requires_grad_() for x in inputs]
        with use_programs("cpu", backend):
            o = gdn_kcp(*leaves, ctx, use_qk_l2norm=True)
            grads = torch.autograd.grad((o * do).sum(), leaves)
        results.append([o.detach(), *grads])
    for ours, twin in zip(*results):
        assert rel_rms(ours, twin) < 1e-5

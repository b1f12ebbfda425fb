"""FLA's gate and beta keywords of chunk_gated_delta_rule and gdn_kcp
(A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
allow_neg_eigval): equal to the gate and beta computed by hand, gradients
reach A_log, dt_bias and the raw inputs, bad values raise."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs
from torch.nn import functional as F

from gdn_kcp import build_kcp_context, chunk_gated_delta_rule, gdn_kcp

BOUNDS = [0, 30, 30, 150]


def raw_inputs():
    q, k, v, _, _ = make_inputs(150, 1, 2, 16, 16, l2=True)
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(1, 150, 2, generator=gen, dtype=torch.float64), torch.randn(1, 150, 2, generator=gen,
                                                                                    dtype=torch.float64)
    A_log = torch.tensor([-1.0, 0.5], dtype=torch.float64)
    dt_bias = torch.tensor([0.3, -2.0], dtype=torch.float64)
    return [q, k, v, a, b, A_log, dt_bias]


@pytest.mark.parametrize("entry", ["chunk", "kcp"])
@pytest.mark.parametrize("neg", [False, True])
def test_keywords_equal_the_gate_by_hand(entry, neg):
    leaves = [x.clone().requires_grad_() for x in raw_inputs()]
    q, k, v, a, b, A_log, dt_bias = leaves
    cu = torch.tensor(BOUNDS)
    if entry == "chunk":
        o, _ = chunk_gated_delta_rule(q, k, v, a, b, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, A_log=A_log,
                                      dt_bias=dt_bias, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                      allow_neg_eigval=neg)
    else:
        o = gdn_kcp(q, k, v, a, b, build_kcp_context(BOUNDS), use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias,
                    use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    beta = b.sigmoid() * (2 if neg else 1)
    ref, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, ref)
    do = torch.randn_like(o)
    ours = torch.autograd.grad((o * do).sum(), leaves)
    expected = torch.autograd.grad((ref * do).sum(), leaves)
    for name, x, y in zip("q k v a b A_log dt_bias".split(), ours, expected):
        assert torch.equal(x, y) and x.abs().max() > 0, name  # every leaf gets its gradient


def test_bad_gate_keywords():
    q, k, v, a, b, A_log, dt_bias = raw_inputs()
    call = lambda **kw: chunk_gated_delta_rule(q, k, v, a, b, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="use_gate_in_kernel=True needs A_log"):
        call(use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="A_log is only read with use_gate_in_kernel=True"):
        call(A_log=A_log)
    with pytest.raises(ValueError, match="dt_bias is only read with use_gate_in_kernel=True"):
        call(dt_bias=dt_bias)
    with pytest.raises(ValueError, match=r"A_log must have shape \[HV\] = \[2\], got \(3,\)"):
        call(use_gate_in_kernel=True, A_log=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match="dt_bias has dtype torch.int64"):
        call(use_gate_in_kernel=True, A_log=A_log, dt_bias=torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="use_beta_sigmoid_in_kernel must be a bool"):
        call(use_beta_sigmoid_in_kernel=1)
    with pytest.raises(TypeError, match="allow_neg_eigval must be a bool"):
        call(allow_neg_eigval="yes")

"""FLA's gate and beta keywords of chunk_gated_delta_rule and gdn_kcp
(A_log, dt_bias, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
allow_neg_eigval): equal to the gate and beta computed by hand, gradients
reach A_log, dt_bias and the raw inputs, bad values raise."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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
        o, _ = gdn_kcp(q, k, v, a, b, build_kcp_context(BOUNDS), use_qk_l2norm=True, A_log=A_log, dt_bias=dt_bias,
                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    beta = b.sigmoid() * (2 if neg else 1)
    ref, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    # fp64: the programs compute the gate as they load it, in another order than by hand
    assert rel_max(o, ref) < 1e-12
    do = torch.randn_like(o)
    ours = torch.autograd.grad((o * do).sum(), leaves)
    expected = torch.autograd.grad((ref * do).sum(), leaves)
    for name, x, y in zip("q k v a b A_log dt_bias".split(), ours, expected):
        assert rel_max(x, y) < 1e-12 and x.abs().max() > 0, name  # every leaf gets its gradient


def rel_max(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.detach(), y.detach()
    return float((x - y).abs().max() / y.abs().max()) if y.numel() else 0.0


class NewTensors(TorchDispatchMode):
    """Shapes of the tensors the ops of a block allocate (views excluded)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.shapes.append((str(func), tuple(t.shape)))
        return out


def test_no_gate_or_beta_tensor_in_the_forward():
    """With the keywords the forward allocates no [T, HV] tensor around the
    programs (no gate, no beta): only the [2, HV] gate parameters and the op's outputs."""
    q, k, v, a, b, A_log, dt_bias = (x.requires_grad_() for x in raw_inputs())
    with NewTensors() as seen:
        chunk_gated_delta_rule(q, k, v, a, b, cu_seqlens=torch.tensor(BOUNDS), use_qk_l2norm_in_kernel=True,
                               A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    per_token_heads = [(op, shape) for op, shape in seen.shapes if shape[-1:] == (2,) and 150 in shape]
    assert not per_token_heads, per_token_heads
    assert any(shape == (2, 2) for _, shape in seen.shapes)  # the gate parameters, -exp(A_log) and dt_bias


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_triton_programs_compute_the_keywords_like_the_torch_programs(dtype, tolerance):
    """The gate and beta in the Triton programs (interpreter) against the torch
    programs: outputs and every leaf's gradient. fp32: both compute in fp32 in
    another order; bf16: outputs and input gradients are rounded to bf16."""
    from gdn_kcp.host.programs import use_programs

    results = []
    for backend in ("torch", "triton"):
        leaves = [x.to(dtype if i < 5 else torch.float32).requires_grad_() for i, x in enumerate(raw_inputs())]
        q, k, v, a, b, A_log, dt_bias = leaves
        with use_programs("cpu", backend):
            o, _ = chunk_gated_delta_rule(q, k, v, a, b, cu_seqlens=torch.tensor(BOUNDS),
                                          use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                          allow_neg_eigval=True)
            do = torch.ones_like(o)
            results.append([o, *torch.autograd.grad((o.float() * do.float()).square().sum(), leaves)])
    for name, ours, twin in zip("o q k v a b A_log dt_bias".split(), results[1], results[0]):
        assert rel_max(ours.double(), twin.double()) < tolerance, name


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

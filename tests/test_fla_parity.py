"""flash-linear-attention's call forms of ``chunk_gated_delta_rule``: its
positional order, ``state_v_first`` states, ``cu_seqlens_cpu``,
``chunk_indices`` (exact and fixed-shape), ``chunk_size``, its gate and beta
keywords, and its errors. Each form runs against the fp64 token loop
(``naive_recurrence``: FLA's naive recurrence, S decays, erases, writes, then
o reads it), outputs, final states and gradients."""

from __future__ import annotations

import warnings

import pytest
import torch
from gdn_inputs import make_inputs
from torch.nn import functional as F

from gdn_kcp import OptionsKcp, build_kcp_context, chunk_gated_delta_rule, gdn_kcp, naive_recurrence
from gdn_kcp.fla_compat import expected_chunk_indices

BOUNDS = [0, 70, 70, 71, 200]
T, H_qk, HV, K, V = 200, 1, 2, 16, 8
N = len(BOUNDS) - 1


def leaves(seed: int = 0):
    q, k, v, g, beta = make_inputs(T, H_qk, HV, K, V, l2=True, seed=seed)
    h0 = torch.randn(N, HV, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


def reference(q, k, v, g, beta, h0, *, scale=None, l2=False):
    return naive_recurrence(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                            use_qk_l2norm=l2, cu_seqlens=torch.tensor(BOUNDS))


def assert_same_with_grads(ours, expected, inputs, what):
    """Outputs, final states and every input gradient within fp64 rounding."""
    gen = torch.Generator().manual_seed(9)
    weights = [torch.randn(x.shape, generator=gen, dtype=torch.float64) for x in expected]
    for name, a, b in zip(("o", "final_state"), ours, expected):
        assert a.shape == b.shape, (what, name)
        assert torch.allclose(a, b, rtol=0, atol=1e-10), (what, name, float((a - b).abs().max().detach()))
    got = torch.autograd.grad(sum((a * w).sum() for a, w in zip(ours, weights)), inputs, retain_graph=True)
    want = torch.autograd.grad(sum((b * w).sum() for b, w in zip(expected, weights)), inputs, retain_graph=True)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.allclose(a, b, rtol=0, atol=1e-9), (what, i, float((a - b).abs().max()))


CU = torch.tensor(BOUNDS)
FORMS = {
    # FLA's positional order: scale, initial_state, output_final_state, use_qk_l2norm_in_kernel
    "positional": lambda q, k, v, g, b, h0: chunk_gated_delta_rule(q, k, v, g, b, 0.3, h0, True, True,
                                                                   cu_seqlens=CU),
    "keywords": lambda q, k, v, g, b, h0: chunk_gated_delta_rule(
        q=q, k=k, v=v, g=g, beta=b, scale=0.3, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=CU),
    "cu_seqlens_cpu": lambda q, k, v, g, b, h0: chunk_gated_delta_rule(
        q, k, v, g, b, 0.3, h0, True, True, cu_seqlens=CU, cu_seqlens_cpu=CU.clone()),
    "chunk_indices": lambda q, k, v, g, b, h0: chunk_gated_delta_rule(
        q, k, v, g, b, 0.3, h0, True, True, cu_seqlens=CU, chunk_indices=expected_chunk_indices(CU, 6)),
    "chunk_indices_fixed_shape": lambda q, k, v, g, b, h0: chunk_gated_delta_rule(
        q, k, v, g, b, 0.3, h0, True, True, cu_seqlens=CU, chunk_indices=expected_chunk_indices(CU, 9),
        chunk_size=64),
    # every parameter by position, in FLA 0.6's order (state_v_first, cu_seqlens, cu_seqlens_cpu,
    # chunk_indices, cp_context after the beta flags)
    "all_positional": lambda q, k, v, g, b, h0: chunk_gated_delta_rule(
        q, k, v, g, b, 0.3, h0, True, True, False, False, False, CU, CU.clone(), expected_chunk_indices(CU, 6),
        None),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_call_forms_equal_the_naive_recurrence(form):
    inputs = leaves()
    ours = FORMS[form](*inputs)
    assert_same_with_grads(ours, reference(*inputs, scale=0.3, l2=True), inputs, form)


def test_chunk_indices_are_flas():
    """FLA's table of the bounds: (document, chunk in it) per chunk of 64, the
    zero-length document holding none; the fixed-shape form pads with (-1, 0)."""
    table = expected_chunk_indices(CU, 7).tolist()
    assert table == [[0, 0], [0, 1], [2, 0], [3, 0], [3, 1], [3, 2], [-1, 0]]


@pytest.mark.parametrize("spelling", ["state_v_first", "transpose_state_layout"])
def test_state_v_first_takes_and_gives_v_first_states(spelling):
    """``[N, HV, V, K]`` states in and out; the deprecated name warns as FLA's does."""
    q, k, v, g, b, h0 = inputs = leaves()
    h0_v_first = h0.transpose(-1, -2).contiguous().detach().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o, ht = chunk_gated_delta_rule(q, k, v, g, b, initial_state=h0_v_first, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, cu_seqlens=CU, **{spelling: True})
    deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == (spelling == "transpose_state_layout")
    assert ht.shape == (N, HV, V, K)
    o_ref, ht_ref = reference(*inputs, l2=True)
    assert_same_with_grads([o, ht.transpose(-1, -2)], [o_ref, ht_ref], [q, k, v, g, b], spelling)
    d_h0 = torch.autograd.grad(ht.sum() + o.sum(), h0_v_first)[0]
    d_h0_ref = torch.autograd.grad(ht_ref.sum() + o_ref.sum(), h0)[0]
    assert torch.allclose(d_h0, d_h0_ref.transpose(-1, -2), rtol=0, atol=1e-9)


def test_gate_keywords_and_beta_sigmoid():
    """FLA's in-kernel gate and beta: g = -exp(A_log) softplus(g + dt_bias),
    beta = 2 sigmoid(beta) with allow_neg_eigval."""
    q, k, v, a, b, h0 = inputs = leaves()
    A_log = torch.tensor([0.2, -1.0], dtype=torch.float64, requires_grad=True)
    dt_bias = torch.tensor([0.5, -0.5], dtype=torch.float64, requires_grad=True)
    ours = chunk_gated_delta_rule(q, k, v, a, b, None, h0, True, True, True, True, cu_seqlens=CU,
                                  use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    g = -A_log.exp() * F.softplus(a + dt_bias)
    expected = reference(q, k, v, g, 2 * b.sigmoid(), h0, l2=True)
    assert_same_with_grads(ours, expected, [*inputs, A_log, dt_bias], "gate keywords")


def test_gdn_kcp_speaks_the_same():
    """``gdn_kcp`` takes ``use_qk_l2norm_in_kernel`` (and the old spelling) and
    returns ``(o, final_state)`` as the FLA entry does, final_state None unless asked."""
    q, k, v, g, b, _ = leaves()
    ctx = build_kcp_context(BOUNDS)
    o, final_state = gdn_kcp(q, k, v, g, b, ctx, use_qk_l2norm_in_kernel=True)
    o_old, _ = gdn_kcp(q, k, v, g, b, ctx, use_qk_l2norm=True)
    o_fla, _ = chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True, cu_seqlens=CU)
    assert final_state is None and torch.equal(o, o_old) and torch.allclose(o, o_fla, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="use_qk_l2norm_in_kernel=True disagrees with use_qk_l2norm=False"):
        gdn_kcp(q, k, v, g, b, ctx, use_qk_l2norm_in_kernel=True, use_qk_l2norm=False)
    with pytest.raises(ValueError, match=r"^use_qk_l2norm_in_kernel=False disagrees with options.use_qk_l2norm=True"):
        gdn_kcp(q, k, v, g, b, ctx, use_qk_l2norm_in_kernel=False, options=OptionsKcp(use_qk_l2norm=True))
    with pytest.raises(TypeError, match="use_qk_l2norm must be a bool or None, got int 1"):
        gdn_kcp(q, k, v, g, b, ctx, use_qk_l2norm_in_kernel=True, use_qk_l2norm=1)
    with pytest.raises(TypeError, match="use_qk_l2norm must be a bool or None, got str 'no'"):
        naive_recurrence(q, k, v, g, b, use_qk_l2norm="no")


def error_cases():
    q, k, v, g, b, h0 = (x.detach() for x in leaves())
    cu_shifted = torch.tensor([0, 70, 71, 71, 200])
    return {
        "allow_neg_eigval needs the sigmoid": (ValueError, "allow_neg_eigval=True requires use_beta_sigmoid_in_kernel",
                                               dict(allow_neg_eigval=True)),
        "head_first": (DeprecationWarning, "head_first", dict(head_first=False)),
        "chunk_size": (ValueError, r"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got chunk_size = 48",
                       dict(chunk_size=48)),
        "chunk_size float": (ValueError, r"`chunk_size` must be .*, got chunk_size = 64.0", dict(chunk_size=64.0)),
        "state_v_first state": (TypeError, r"initial_state must be a torch.Tensor \[N, HV, V, K\], got str",
                                dict(state_v_first=True, initial_state="h0")),
        "state_v_first shape": (ValueError, r"initial_state must have shape \[N, HV, V, K\] = \(4, 2, 8, 16\), "
                                r"got \(4, 2, 16, 8\)", dict(state_v_first=True, initial_state=h0, cu_seqlens=CU)),
        "cu_seqlens a list": (TypeError, r"cu_seqlens must be a torch.Tensor \[N \+ 1\], got list",
                              dict(cu_seqlens=BOUNDS, cu_seqlens_cpu=CU)),
        "both state names": (ValueError, "not both", dict(state_v_first=True, transpose_state_layout=True)),
        "unknown keyword": (TypeError, r"unexpected keyword arguments \['use_qk_norm'\]", dict(use_qk_norm=True)),
        "cp_context": (ValueError, "cp_context", dict(cp_context=object())),
        "cu_seqlens_cpu differs": (ValueError, r"cu_seqlens_cpu disagrees with cu_seqlens from row 2 on",
                                   dict(cu_seqlens=CU, cu_seqlens_cpu=cu_shifted)),
        "cu_seqlens_cpu alone": (ValueError, "without cu_seqlens", dict(cu_seqlens_cpu=CU)),
        "chunk_indices differ": (ValueError, r"chunk_indices disagrees with .* from row 2 on: chunk_indices\[2\] = "
                                 r"\[1, 0\], expected \[2, 0\]",
                                 dict(cu_seqlens=CU, chunk_indices=expected_chunk_indices(cu_shifted, 6))),
        "chunk_indices too short": (ValueError, "fewer than the chunks",
                                    dict(cu_seqlens=CU, chunk_indices=expected_chunk_indices(CU, 5))),
        "chunk_indices shape": (ValueError, r"\[NT, 2\]", dict(cu_seqlens=CU, chunk_indices=torch.zeros(4, 3).long())),
        "chunk_indices dtype": (TypeError, "chunk_indices must be int32 or int64", dict(
            cu_seqlens=CU, chunk_indices=expected_chunk_indices(CU, 6).float())),
    }, (q, k, v, g, b, h0)


@pytest.mark.parametrize("case", sorted(error_cases()[0]))
def test_flas_errors(case):
    cases, (q, k, v, g, b, _) = error_cases()
    error, message, kwargs = cases[case]
    with pytest.raises(error, match=message):
        chunk_gated_delta_rule(q, k, v, g, b, **kwargs)

"""chunk_gated_delta_rule against the fp64 naive recurrence: outputs, final
states and every gradient, on odd sizes, packings, GVA, norm and initial states."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import against_oracle, make_inputs, max_abs, random_bounds, rel_rms

from gdn_kcp import chunk_gated_delta_rule, naive_recurrence


def run_both(T, K, V, H_qk, HV, packing, l2, h0, dtype, seed=0):
    """Return {name: (ours, oracle)} for outputs and gradients of a random loss."""
    inputs = make_inputs(T, H_qk, HV, K, V, dtype=dtype, seed=seed, l2=l2)
    bounds = [0, T] if packing == "one" else random_bounds(T, seed)
    return against_oracle(inputs, bounds, l2=l2, h0=h0, seed=seed)


# (T, K, V, H_qk, HV, packing, l2, h0): every T, every K and V, both packings,
# GVA, norm and initial state on and off, spread over a covering set.
FP64_CASES = [
    (1, 16, 16, 1, 2, "one", False, True),
    (1, 32, 100, 2, 2, "many", True, False),
    (63, 32, 100, 2, 4, "many", True, False),
    (63, 128, 16, 1, 1, "one", True, True),
    (64, 100, 32, 1, 3, "one", False, True),
    (64, 16, 16, 2, 2, "many", False, False),
    (65, 128, 128, 2, 2, "many", True, True),
    (65, 100, 100, 1, 1, "one", True, True),
    (130, 16, 32, 1, 4, "one", True, False),
    (130, 128, 100, 2, 4, "many", False, True),
    (1000, 32, 16, 1, 2, "many", True, True),
    (1000, 128, 128, 1, 2, "one", False, False),
]


def case_id(case):
    T, K, V, H_qk, HV, packing, l2, h0 = case
    return f"T{T}-K{K}-V{V}-H{H_qk}x{HV}-{packing}-{'l2' if l2 else 'nol2'}-{'h0' if h0 else 'noh0'}"


@pytest.mark.parametrize("case", FP64_CASES, ids=case_id)
def test_fp64_matches_oracle(case):
    results = run_both(*case, dtype=torch.float64)
    for name, (ours, ref) in results.items():
        assert ours.dtype == torch.float64, name
        assert max_abs(ours, ref) < 1e-9, (name, max_abs(ours, ref))


LOW_PRECISION_CASES = [
    (torch.float32, 1e-4, (130, 128, 128, 2, 4, "many", True, True)),
    (torch.float32, 1e-4, (1000, 100, 32, 1, 2, "one", False, True)),
    (torch.float32, 1e-4, (65, 16, 100, 1, 1, "many", False, False)),
    (torch.bfloat16, 1e-2, (130, 128, 128, 2, 4, "many", True, True)),
    (torch.bfloat16, 1e-2, (1000, 64, 64, 1, 2, "one", False, False)),
    (torch.float16, 1e-2, (63, 32, 32, 1, 2, "many", True, True)),
]


@pytest.mark.parametrize(
    "dtype,tol,case", LOW_PRECISION_CASES, ids=[f"{d}-{case_id(c)}" for d, _, c in LOW_PRECISION_CASES]
)
def test_low_precision_matches_oracle(dtype, tol, case):
    results = run_both(*case, dtype=dtype)
    assert results["o"][0].dtype == dtype
    assert results["final_state"][0].dtype == torch.float32
    for name, (ours, ref) in results.items():
        assert rel_rms(ours, ref) < tol, (name, rel_rms(ours, ref))


def test_batch_without_cu_seqlens_is_b_documents():
    T, K, V = 70, 16, 16
    q, k, v, g, beta = make_inputs(T, 1, 2, K, V, seed=3, B=3)
    o, fs = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    ro, rfs = naive_recurrence(q, k, v, g, beta, output_final_state=True)
    assert o.shape == (3, T, 2, V) and fs.shape == (3, 2, K, V)
    assert max_abs(o, ro) < 1e-9 and max_abs(fs, rfs) < 1e-9


def test_no_final_state_unless_asked():
    q, k, v, g, beta = make_inputs(10, 1, 1, 8, 8)
    o, fs = chunk_gated_delta_rule(q, k, v, g, beta)
    assert fs is None and o.shape == (1, 10, 1, 8)


def test_scale_is_applied():
    q, k, v, g, beta = make_inputs(70, 1, 1, 16, 8, seed=5)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3)
    ro, _ = naive_recurrence(q, k, v, g, beta, scale=0.3)
    assert max_abs(o, ro) < 1e-9
    o_default, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    assert max_abs(o_default, ro * (16**-0.5 / 0.3)) < 1e-9


def test_gradcheck_tiny():
    q, k, v, g, beta = make_inputs(7, 1, 2, 3, 2, seed=7, l2=True)
    state0 = torch.randn(2, 2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    cu = torch.tensor([0, 3, 7])
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, state0)]

    def fn(q, k, v, g, beta, s0):
        return chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=s0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        )

    assert torch.autograd.gradcheck(fn, leaves, atol=1e-8, rtol=1e-6)

"""The precision rule (docs/design.md, "Precision"; :mod:`gdn_kcp.kernels.precision`): bf16
inputs multiply bf16 operands with fp32 accumulation, fp32 inputs follow
``torch.get_float32_matmul_precision()``, fp64 stays fp64. The whole op on the
Triton programs (interpreter) at bf16 against the fp64 oracle, in the
relative-RMS classes flash-linear-attention's own GDN tests use; the rounding
helpers themselves."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs, rel_rms

from gdn_kcp import chunk_gated_delta_rule, naive_recurrence
from gdn_kcp.host.programs import use_programs
from gdn_kcp.kernels.precision import matmul_mode, mm, round_operands

pytest.importorskip("triton")

BOUNDS = [0, 70, 71, 200, 333]
# flash-linear-attention's chunk GDN tests (relative RMS, its get_err_ratio, at bf16/fp16):
# o and the final state 0.005, dq/dk/dv and dh0 0.008, dbeta and dg 0.02.
FLA_CLASS = {"o": 0.005, "final_state": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "dbeta": 0.02,
             "d_initial_state": 0.008}  # in the order of the table in docs/api.md


def run(backend: str | None, dtype: torch.dtype):
    q, k, v, g, beta = make_inputs(BOUNDS[-1], 1, 2, 32, 32, dtype=dtype, seed=11, l2=True)
    h0 = torch.randn(len(BOUNDS) - 1, 2, 32, 32, generator=torch.Generator().manual_seed(12))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    cu = torch.tensor(BOUNDS)
    if backend is None:  # the fp64 oracle on the same (rounded) inputs
        fp64 = [x.detach().double().requires_grad_() for x in leaves]
        o, s = naive_recurrence(*fp64[:5], initial_state=fp64[5], output_final_state=True, use_qk_l2norm=True,
                                cu_seqlens=cu)
        wrt = fp64
    else:
        with use_programs("cpu", backend):
            o, s = chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        wrt = leaves
    gen = torch.Generator().manual_seed(13)
    do, ds = torch.randn(o.shape, generator=gen), torch.randn(s.shape, generator=gen)
    loss = (o.double() * do.double()).sum() + (s.double() * ds.double()).sum()
    with use_programs("cpu", backend or "torch"):  # the backward runs the programs of this block too
        grads = torch.autograd.grad(loss, wrt)
    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state")
    return dict(zip(names, [o, s, *grads]))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bf16_whole_op_against_the_fp64_oracle(backend):
    """Forward and backward at bf16 (products on bf16 operands, fp32 states)
    against the fp64 oracle on the same inputs: every output and gradient
    within FLA's relative-RMS class (measured: 7.1e-4 to 5.2e-3; see docs/api.md)."""
    ours, oracle = run(backend, torch.bfloat16), run(None, torch.bfloat16)
    errors = {name: rel_rms(ours[name], oracle[name]) for name in FLA_CLASS}
    print(backend, {k: f"{v:.1e}" for k, v in errors.items()})
    bad = {name: err for name, err in errors.items() if not err < FLA_CLASS[name]}
    assert not bad, (errors, bad)
    stated = stated_figures()  # docs/api.md's table states these figures (to 10 %)
    assert all(abs(errors[name] - stated[name]) <= 0.1 * stated[name] for name in FLA_CLASS), (errors, stated)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_states_and_their_gradients_are_held_in_fp32(backend):
    """At bf16 inputs the final state and the initial-state gradient are
    running fp32 states: fp32 tensors whose values are not bf16 values. A
    state held in bf16 on the way (and cast back) has every value on the bf16
    grid; an fp32 value lands there by chance once in 2^16."""
    ours = run(backend, torch.bfloat16)
    for name in ("final_state", "d_initial_state"):
        x = ours[name]
        on_bf16_grid = float((x == x.to(torch.bfloat16).float()).double().mean())
        assert x.dtype == torch.float32 and on_bf16_grid < 0.01, (name, x.dtype, on_bf16_grid)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fp16_zero_rows_under_the_norm_stay_finite(backend):
    """A zero q or k row has a reciprocal norm of 1,000 (eps 1e-6). The walks
    keep the norm on the q / k side of their products and put only decays (at
    most 1) on the other operand, so no fp16 operand overflows: with the norm
    on the value side, |v_new| above 65 gave inf there, then NaN from that
    chunk on. Against the fp64 oracle on the same inputs: o, dv, dg and dbeta
    (dq and dk of the zero rows are 3.6e5 in the oracle itself, past fp16's
    65,504, so they are not compared)."""
    q, k, v, g, beta = make_inputs(256, 1, 2, 32, 32, seed=21, l2=True)
    q[:, 100], k[:, 10], k[:, 150] = 0.0, 0.0, 0.0
    v = v * 300.0
    fp16 = [x.to(torch.float16) for x in (q, k, v, g, beta)]
    results = {}
    for name, dtype in (("fp16", torch.float16), ("fp64", torch.float64)):
        leaves = [x.to(dtype).requires_grad_() for x in fp16]
        if name == "fp16":
            with use_programs("cpu", backend):
                o, _ = chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True)
        else:
            o, _ = naive_recurrence(*leaves, use_qk_l2norm=True)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(22))
        with use_programs("cpu", backend):  # the backward runs the programs of the forward's block too
            _, _, dv, dg, dbeta = torch.autograd.grad((o.double() * do.double()).sum(), leaves)
        results[name] = (o, dv, dg, dbeta)
    for ours, oracle in zip(results["fp16"], results["fp64"]):
        assert torch.isfinite(ours).all()
        assert rel_rms(ours, oracle) < 2e-3, rel_rms(ours, oracle)


def stated_figures() -> dict[str, float]:
    """The "measured" row of the precision table of docs/api.md, by output name."""
    from doc_tables import doc

    row = next(line.strip() for line in doc("api.md").splitlines() if line.strip().startswith("| measured |"))
    return dict(zip(FLA_CLASS, (float(cell) for cell in row.strip("|").split("|")[1:])))


def test_matmul_mode_follows_the_rule():
    assert matmul_mode(torch.bfloat16) == "bf16" and matmul_mode(torch.float16) == "fp16"
    assert matmul_mode(torch.float64) == "ieee"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_mode(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("high")
        assert matmul_mode(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_operand_rounding():
    x = torch.tensor([1 + 2**-9, 1 + 3 * 2**-9, 1 + 2**-12, 1 + 3 * 2**-12, float("inf"), -2.5])
    bf16, = round_operands("bf16", x)
    assert torch.equal(bf16, x.to(torch.bfloat16).float())  # round to nearest even, as the cast does
    tf32, = round_operands("tf32", x)
    assert tf32.tolist() == [1 + 2**-9, 1 + 3 * 2**-9, 1.0, 1 + 2**-10, float("inf"), -2.5]
    assert round_operands("ieee", x)[0] is x
    a, b = torch.randn(3, 4), torch.randn(4, 2)
    assert torch.equal(mm(a, b, "bf16"), a.bfloat16().float() @ b.bfloat16().float())

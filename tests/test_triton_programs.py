"""Each Triton program under TRITON_INTERPRET=1 against its torch twin: odd T,
several documents (zero-length and one-token ones among them), GVA, the L2 norm, crossing
fragments with S_in / lambda_end, K = V in {32, 64}, V = 128 (two value tiles), K and V off the
tile grid (24 / 40, 8 / 100), K = 256 and V = 512 (FLA's layer head sizes); fp32 and bf16 inputs.
Intra-rank segments: the four segment programs and the walks over a segmented
index with carry planes, and a whole call at P = 3."""

from __future__ import annotations

import pytest
import torch
from extended import extended_at
from gdn_inputs import make_inputs, rel_rms
from gdn_kcp.kernels.twin_check import compare_segments_with_torch, compare_with_torch, run_segment_programs

from gdn_kcp import OptionsKcp, build_kcp_context, gdn_kcp
from gdn_kcp.host.programs import use_programs
from gdn_kcp.kernels import ChunkIndex

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
    # head dims off the tile grid: K, V not multiples of (or smaller than) their tiles, so every
    # row and column mask cuts a tile
    "fp32-K24-V40": dict(bounds=(0, 70, 70, 71, 150), H_qk=1, HV=2, K=24, V=40, dtype=torch.float32, seed=8,
                         l2=True, crossing=True),
    "bf16-K8-V100": dict(bounds=(0, 65, 65, 129), H_qk=1, HV=2, K=8, V=100, dtype=torch.bfloat16, seed=9,
                         l2=True, crossing=True),
    # FLA's layer head sizes (head_dim 256, expand_v 2), one at a time to keep the interpreter's time small:
    # K = 256 (walk states of two [128, BV] halves), V = 512 (16 walk value tiles)
    "bf16-K256": dict(bounds=(0, 65, 65, 66, 80), H_qk=1, HV=1, K=256, V=32, dtype=torch.bfloat16, seed=11,
                      l2=True, crossing=True),
    "bf16-V512": dict(bounds=(0, 65, 65, 66, 80), H_qk=1, HV=1, K=32, V=512, dtype=torch.bfloat16, seed=12,
                      l2=True, crossing=True),
    # one chunk in all: every launch has a grid of one chunk
    "fp32-one-chunk": dict(bounds=(0, 40), H_qk=1, HV=2, K=32, V=32, dtype=torch.float32, seed=10, l2=True,
                           crossing=False),
}
# fp32 inputs: both backends compute in fp32 in a different order; bf16 inputs
# also round the outputs and gradients to bf16 (2^-8 relative).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2}

# FLA's layer head sizes, 43 s and 27 s: make test-extended (bf16-V128 loops over value tiles in CI; the GPU
# check's programs stage runs K = V = 128)
EXTENDED_CASES = {"bf16-V512", "bf16-K256"}


@pytest.mark.parametrize("name", extended_at(sorted(CASES), EXTENDED_CASES))
def test_triton_programs_match_torch_twins(name):
    from gdn_kcp.kernels import triton as triton_programs

    case = CASES[name]
    errors = compare_with_torch(triton_programs, **case)
    assert len(errors) >= 20  # 22 without crossing (no summaries), 24 with the norm tapes
    bad = {k: v for k, v in errors.items() if not v < TOLERANCE[case["dtype"]]}
    assert not bad, bad


GROUPS = [(1, 1), (2, 6), (2, 4), (1, 4), (2, 8)]
"""(H_qk, HV): groups of 1 and 3 (a program per value head), of 2 (one pair
per key head, the roofline's shape), of 4 (two pairs per key head) and of 4
under two key heads."""


def one_head_at_a_time(run, q, k, head_inputs, H_qk: int, HV: int) -> list[torch.Tensor]:
    """``run(q, k, *inputs)`` for each value head alone, with its key head's q
    and k, its ``head_inputs`` sliced to ``[T, 1, ...]``."""
    group = HV // H_qk
    return [run(q[:, h // group:h // group + 1].contiguous(), k[:, h // group:h // group + 1].contiguous(),
                *[x[:, h:h + 1].contiguous() for x in head_inputs])[:, 0] for h in range(HV)]


@pytest.mark.parametrize("H_qk, HV", GROUPS)
def test_local_dv_serves_each_value_head_of_its_key_head(H_qk, HV):
    """The local dv forms ``Q K^T`` once for a pair of one key head's value
    heads: each head's dv is its twin's, and bit for bit the program's run
    one value head at a time (a group of 1)."""
    from gdn_kcp.kernels import torch as torch_programs
    from gdn_kcp.kernels import triton as triton_programs

    T, K, V = 150, 32, 40
    index = ChunkIndex.from_fragments([0, 70, 70, 150], device="cpu")
    q, k, _, g, _ = [x[0] for x in make_inputs(T, H_qk, HV, K, V, dtype=torch.float32, seed=3)]
    do = torch.randn(T, HV, V, generator=torch.Generator().manual_seed(4))

    def local_dv(programs, q, k, g, do):
        dv = torch.empty(T, g.shape[1], V)
        programs.bwd_local_dv(q, k, g, do, index, scale=0.5, q_rstd=None, k_rstd=None, dv_out=dv)
        return dv

    ours = local_dv(triton_programs, q, k, g, do)
    assert rel_rms(ours, local_dv(torch_programs, q, k, g, do)) < TOLERANCE[torch.float32]
    alone = one_head_at_a_time(lambda *x: local_dv(triton_programs, *x), q, k, [g, do], H_qk, HV)
    for h in range(HV):
        assert torch.equal(alone[h], ours[:, h]), h


@pytest.mark.parametrize("segments", [1, 3])
def test_forward_and_backward_through_the_ops_with_triton_programs(segments):
    """A whole gdn_kcp call (ops, host path, workspace) on the Triton programs
    equals the same call on the torch programs; at P = 3 the 3-chunk document
    walks as 3 segments."""
    bounds = [0, 20, 20, 150, 170]
    ctx = build_kcp_context(bounds)
    inputs = make_inputs(170, 1, 2, 32, 32, dtype=torch.float32, seed=4, l2=True)
    do = torch.randn(1, 170, 2, 32, generator=torch.Generator().manual_seed(5))
    results = []
    for backend in ("torch", "triton"):
        leaves = [x.clone().requires_grad_() for x in inputs]
        with use_programs("cpu", backend):
            o, _ = gdn_kcp(*leaves, ctx, options=OptionsKcp(segments=segments, use_qk_l2norm=True))
            grads = torch.autograd.grad((o * do).sum(), leaves)
        results.append([o.detach(), *grads])
    for ours, twin in zip(*results):
        assert rel_rms(ours, twin) < 1e-5


# Intra-rank segments: phase 1 and 2 programs and the walks over a segmented
# index with carry_in. "several": fragments of 2, 1, 6 and 1 chunks at P = 3
# (L = 2: the long one has 3 segments, the crossing ones 1 row each, the short
# inner one none); "middle": one fragment that crosses in and out (its fold has
# an M) on a capped index (sentinel rows after it), 4 chunks at P = 2.
SEGMENT_CASES = {
    "fp32-several-l2-K32": dict(bounds=(0, 70, 75, 400, 460), H_qk=1, HV=2, K=32, V=32, dtype=torch.float32,
                                seed=11, l2=True, crossing=True, P=3),
    "bf16-several-gva-K32": dict(bounds=(0, 70, 75, 400, 460), H_qk=1, HV=2, K=32, V=32, dtype=torch.bfloat16,
                                 seed=12, l2=False, crossing=True, P=3),
    "fp32-middle-capped": dict(bounds=(0, 200), H_qk=1, HV=1, K=32, V=32, dtype=torch.float32, seed=13, l2=True,
                               crossing=True, P=2, capped=True),
    # V = 128: two value tiles of the states, three column tiles of [S | M] (V + K = 160)
    "bf16-V128": dict(bounds=(0, 5, 200), H_qk=1, HV=1, K=32, V=128, dtype=torch.bfloat16, seed=14, l2=True,
                      crossing=True, P=2),
}


@pytest.mark.parametrize("name", sorted(SEGMENT_CASES))
def test_triton_segment_programs_match_torch_twins(name):
    from gdn_kcp.kernels import triton as triton_programs

    case = SEGMENT_CASES[name]
    errors = compare_segments_with_torch(triton_programs, **case)
    assert len(errors) == 16  # with the walk with the output: o and the final states
    bad = {k: v for k, v in errors.items() if not v < TOLERANCE[case["dtype"]]}
    assert not bad, bad


@pytest.mark.parametrize("name", [n for n in sorted(SEGMENT_CASES) if SEGMENT_CASES[n]["dtype"] == torch.float32])
def test_torch_segment_programs_equal_the_unsegmented_walks(name):
    """The torch segment programs (the twins' reference) give the states, tapes,
    folds and gradients of the unsegmented torch programs (fp32: to rounding)."""
    from gdn_kcp.kernels import torch as torch_programs

    case = SEGMENT_CASES[name]
    segmented = run_segment_programs(torch_programs, **case)
    plain = run_segment_programs(torch_programs, **case, segmented=False)
    assert plain["m"].any() == (name == "fp32-middle-capped")
    errors = {}
    for key, expected in plain.items():
        scale = expected.double().abs().max()
        if scale == 0:  # no final state / initial-state gradient / M of this case: none written
            assert not segmented[key].any(), key
            continue
        errors[key] = ((segmented[key].double() - expected.double()).abs().max() / scale).item()
    bad = {k: v for k, v in errors.items() if not v < 1e-5}
    assert not bad, bad


@pytest.mark.parametrize("gate", ["scalar", "channel"])
@pytest.mark.parametrize("name", ["k", "v"])
def test_prep_spreads_a_non_finite_row_over_every_column(name, gate):
    """A NaN in one column of k (or v) at token t makes rows t.. of its chunk
    NaN in every column of w (or u), and leaves the rows before t finite, on
    both backends: the Triton W, U launch computes in column slices (K = 80:
    two key slices, the second cut by the mask; V = 96: three value slices)
    and must not keep the NaN to its own slice, as the torch twin's
    lower_matmul does not. Also with a gate per key channel (KDA), whose
    A comes from the channel products' two parts."""
    from gdn_kcp.kernels import CHUNK_SIZE
    from gdn_kcp.kernels import torch as torch_programs
    from gdn_kcp.kernels import triton as triton_programs
    from gdn_kcp.kernels.chunk_index import ChunkIndex

    T, K, V, t, column = 100, 80, 96, 70, 5  # token 70: row 6 of the second chunk
    q, k, v, g, beta = make_inputs(T, 1, 1, K, V, dtype=torch.float32, seed=11)
    flat = [x[0].contiguous() for x in (q, k, v, g, beta)]
    if gate == "channel":
        flat[3] = flat[3][..., None] * torch.linspace(0.5, 1.5, K)  # [T, 1, K]
    flat[1 if name == "k" else 2][t, 0, column] = float("nan")
    index = ChunkIndex.from_fragments((0, T), frag_flags=[0], device="cpu")
    out = {}
    for backend, programs in (("torch", torch_programs), ("triton", triton_programs)):
        A, w, u = torch.empty(T, 1, CHUNK_SIZE), torch.empty(T, 1, K), torch.empty(T, 1, V)
        programs.prep(*flat, index, A_out=A, w_out=w, u_out=u)
        out[backend] = w if name == "k" else u
    for backend, x in out.items():
        rows_nan = torch.isnan(x[:, 0]).all(-1)
        assert rows_nan[t:].all(), backend  # every column of rows t..99 (one chunk from 64)
        assert torch.isfinite(x[:t, 0]).all(), backend
    assert rel_rms(out["triton"][:t], out["torch"][:t]) < 1e-5  # the rows before t as the twin computes them


CHANNEL_CASES = {
    "fp64-K32-hard-resets": dict(bounds=(0, 70, 70, 71, 150), H_qk=1, HV=2, K=32, dtype=torch.float64, gate=False,
                                 l2=True, hard=True),
    "fp32-gva-K64": dict(bounds=(0, 5, 5, 97, 131), H_qk=2, HV=4, K=64, dtype=torch.float32, gate=False, l2=False),
    "bf16-K40-gate": dict(bounds=(0, 65, 65, 129), H_qk=1, HV=2, K=40, dtype=torch.bfloat16, gate=True, l2=True),
}
CHANNEL_V = {"fp64-K32-hard-resets": 16, "fp32-gva-K64": 32, "bf16-K40-gate": 24}  # prep's U
CHANNEL_EXTENDED = {"fp32-gva-K64"}
"""The walks' and the backward's fp32 GVA case (about 15 and 24 s under the
interpreter) runs in make test-extended; CI keeps fp64 and bf16 (scores and
prep keep all three)."""


@pytest.mark.parametrize("name", sorted(CHANNEL_CASES))
def test_channel_scores_match_the_torch_twin(name):
    """KDA's scores (a gate per key channel) in Triton against the torch
    program (``twin_check.compare_channel_scores``, which the GPU check runs
    too): sub-chunks of 16 rows here, 8 there, so the two agree to the
    rounding of the products' operands (exact in fp64, with -inf and -1000
    gates on some channels and rows), K off the tile grid, GVA, FLA's gate
    in kernel; every entry written (both outputs start as NaN)."""
    from gdn_kcp.kernels import triton as triton_programs
    from gdn_kcp.kernels.twin_check import compare_channel_scores

    case = CHANNEL_CASES[name]
    error = compare_channel_scores(triton_programs, **case, seed=case["K"] + case["HV"])
    tolerance = 1e-14 if case["dtype"] == torch.float64 else TOLERANCE[case["dtype"]]
    assert error < tolerance, error


@pytest.mark.parametrize("name", sorted(CHANNEL_CASES))
def test_channel_prep_matches_the_torch_twin(name):
    """KDA's prep in Triton (``channel_wy_inverse_kernel`` for A, whose
    diagonal blocks are the channel products' sub-chunks, then ``prep_kernel``
    with W's per-channel decays) against the torch program
    (``twin_check.compare_channel_prep``, also run by the GPU check): A, W
    and U, every entry written, at the cases of the scores above."""
    from gdn_kcp.kernels import triton as triton_programs
    from gdn_kcp.kernels.twin_check import compare_channel_prep

    case = CHANNEL_CASES[name]
    errors = compare_channel_prep(triton_programs, **case, V=CHANNEL_V[name], seed=case["K"] + case["HV"])
    tolerance = 1e-14 if case["dtype"] == torch.float64 else TOLERANCE[case["dtype"]]
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize("name", extended_at(sorted(CHANNEL_CASES), CHANNEL_EXTENDED))
def test_channel_walks_match_the_torch_twins(name):
    """KDA's forward walks in Triton (``tape_walk_kernel``,
    ``walk_output_kernel`` and ``summary_walk_kernel`` with ``CHANNEL``: each
    state row decays by its own channel, and q by its channels' cumsums)
    against the torch programs (``twin_check.compare_channel_walks``, also
    run by the GPU check): chunk start states, v_new, o, both walks' final
    states, with initial states and fragments crossing in and out, and a
    middle rank's S_loc and M; and ``output_kernel`` with ``CHANNEL`` (o from
    the tapes: the channel scores inside it); every h, v_new, o and summary
    entry written."""
    from gdn_kcp.kernels import triton as triton_programs
    from gdn_kcp.kernels.twin_check import compare_channel_walks

    case = CHANNEL_CASES[name]
    errors = compare_channel_walks(triton_programs, **case, V=CHANNEL_V[name], seed=case["K"] + case["HV"])
    tolerance = 1e-14 if case["dtype"] == torch.float64 else TOLERANCE[case["dtype"]]
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize("name", extended_at(sorted(CHANNEL_CASES), CHANNEL_EXTENDED))
def test_channel_backward_matches_the_torch_twins(name):
    """KDA's backward programs in Triton so far (``bwd_local_dv_kernel``,
    ``adjoint_summary_kernel``, ``adjoint_walk_kernel``, ``bwd_dqkwg_kernel``
    and ``bwd_wy_kernel`` with ``CHANNEL``: the output's channel scores
    transposed, each row of the state adjoint decaying by its own channel,
    and the gradients of the scores and of L pulled through the anchored
    sub-chunks) against the torch programs
    (``twin_check.compare_channel_backward``, also run by the GPU check), on
    the torch programs' tapes: the local dv, nu, dh, dv_new, the
    initial-state adjoints (with final-state adjoints and lambda_end), dq,
    dk, dw and the per-channel dg, and the WY backward's dk, dg, dv and
    dbeta; every entry written."""
    from gdn_kcp.kernels import triton as triton_programs
    from gdn_kcp.kernels.twin_check import compare_channel_backward

    case = CHANNEL_CASES[name]
    errors = compare_channel_backward(triton_programs, **case, V=CHANNEL_V[name], seed=case["K"] + case["HV"])
    tolerance = 1e-14 if case["dtype"] == torch.float64 else TOLERANCE[case["dtype"]]
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize("dtype,K", [(torch.float64, 40), (torch.float32, 100)])
def test_channel_gate_cumsum_matches_the_torch_twin(dtype, K):
    """KDA's backward of the in-chunk gate cumsum (``[T, HV, K]``; K = 100:
    two channel tiles, the second cut) against the torch program; every
    entry written."""
    from gdn_kcp.kernels import torch as torch_programs
    from gdn_kcp.kernels import triton as triton_programs

    bounds = (0, 70, 70, 71, 150)
    index = ChunkIndex.from_fragments(list(bounds), device="cpu")
    dgcum = torch.randn(150, 3, K, generator=torch.Generator().manual_seed(K), dtype=dtype)
    outs = []
    for programs in (torch_programs, triton_programs):
        out = torch.full_like(dgcum, float("nan"))
        programs.bwd_gate_cumsum(dgcum, index, dg_out=out)
        outs.append(out)
    assert torch.isfinite(outs[1]).all()
    assert rel_rms(outs[1], outs[0]) < (1e-14 if dtype == torch.float64 else 1e-6)

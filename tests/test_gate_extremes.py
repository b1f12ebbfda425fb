"""Hard resets (``g = -inf``), very strong decays and non-finite inputs, on
both program backends.

A gate of -inf resets the state at its token (``exp(-inf) = 0``); the fp64
oracle stays finite there, and so must every output and gradient. A NaN in v,
k, g or beta at token t must leave every output before t untouched: the chunk
form reaches t's row through masked products, which must be selects."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import NAMES, against_oracle, make_inputs, max_abs, rel_rms

from gdn_kcp import chunk_gated_delta_rule
from gdn_kcp.host.programs import use_programs

BACKENDS = ("torch", "triton")
BOUNDS = [0, 3, 150, 150, 200]  # documents of 3, 147, 0 and 50 tokens
T, H_qk, HV, K, V = 200, 1, 2, 16, 16
RESETS = [
    (3, 0),  # the first token of a document
    (64, 1),  # the first token of a chunk
    (66, 0), (67, 0),  # two in a row inside a chunk
    (130, 1),  # mid chunk
    (194, 0),  # the last token of a chunk
    (199, 1),  # the last token of the stream
]


def reset_inputs(dtype: torch.dtype, l2: bool) -> list[torch.Tensor]:
    inputs = make_inputs(T, H_qk, HV, K, V, dtype=torch.float64, seed=21, l2=l2)
    for t, h in RESETS:
        inputs[3][0, t, h] = float("-inf")
    return [x.to(dtype) for x in inputs]


def backend_context(backend: str):
    if backend == "triton":
        pytest.importorskip("triton")
    return use_programs("cpu", backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hard_resets_match_the_oracle_in_fp64(backend):
    with backend_context(backend):
        results = against_oracle(reset_inputs(torch.float64, l2=True), BOUNDS, l2=True, h0=True, seed=3)
    assert set(results) == set(NAMES)
    for name, (ours, ref) in results.items():
        assert torch.isfinite(ref).all(), name  # the oracle is finite across a reset
        assert torch.isfinite(ours).all(), name
        assert max_abs(ours, ref) < 1e-9, (name, max_abs(ours, ref))


def test_a_hard_reset_forgets_everything_before_it():
    """The output after a reset does not depend on any token before it."""
    inputs = reset_inputs(torch.float64, l2=False)
    cu = torch.tensor(BOUNDS)
    o, _ = chunk_gated_delta_rule(*inputs, cu_seqlens=cu)
    changed = [x.clone() for x in inputs]
    changed[2][0, 70:130] += 1.0  # v of the second document (tokens 3..149) after head 0's resets at 66, 67
    o_changed, _ = chunk_gated_delta_rule(*changed, cu_seqlens=cu)
    assert torch.equal(o_changed[0, :70], o[0, :70])
    assert max_abs(o_changed[0, 130:150, 0], o[0, 130:150, 0]) > 0.01  # head 0 still remembers
    assert torch.equal(o_changed[0, 130:, 1], o[0, 130:, 1])  # head 1 reset at 130
    assert torch.equal(o_changed[0, 150:], o[0, 150:])  # later documents


@pytest.mark.parametrize("backend", BACKENDS)
def test_hard_resets_and_strong_decays_in_fp32(backend):
    """fp32 within the fp32 tolerance of the oracle, with -inf gates and gates
    down to -1e4 among ordinary ones (a difference of gate cumsums would lose
    about 1e-3 here: the prefix sum reaches -1e4, whose fp32 spacing is 1e-3)."""
    inputs = reset_inputs(torch.float64, l2=True)
    gen = torch.Generator().manual_seed(5)
    strong = torch.rand(T, HV, generator=gen, dtype=torch.float64) < 0.2
    inputs[3][0] = torch.where(strong, -1e4 * torch.rand(T, HV, generator=gen, dtype=torch.float64), inputs[3][0])
    inputs[3][0, 100:110, :] = -1e4  # a run of them, then ordinary gates in the same chunk
    with backend_context(backend):
        results = against_oracle([x.float() for x in inputs], BOUNDS, l2=True, h0=True, seed=4)
    for name, (ours, ref) in results.items():
        assert torch.isfinite(ours).all(), name
        assert rel_rms(ours, ref) < 1e-4, (name, rel_rms(ours, ref))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["v", "k", "g", "beta"])
def test_a_non_finite_input_stays_at_and_after_its_token(backend, name):
    """A NaN at token t (mid chunk, in a document of several chunks) leaves
    every output before t bitwise as it was, and makes o non-finite from t on
    in its document and head."""
    inputs = make_inputs(T, H_qk, HV, K, V, dtype=torch.float32, seed=8)
    t, head = 100, 1
    poisoned = [x.clone() for x in inputs]
    target = poisoned[("q", "k", "v", "g", "beta").index(name)]
    if name == "k":
        target[0, t, 0] = float("nan")  # key head 0 feeds both value heads
    else:
        target[0, t, head] = float("nan")
    cu = torch.tensor(BOUNDS)
    with backend_context(backend):
        clean, _ = chunk_gated_delta_rule(*inputs, cu_seqlens=cu)
        o, _ = chunk_gated_delta_rule(*poisoned, cu_seqlens=cu)
    bad = ~torch.isfinite(o[0]).all(-1)  # [T, HV]
    assert torch.equal(o[0, :t], clean[0, :t])
    assert not bad[:t].any()
    heads = [0, 1] if name == "k" else [head]
    assert bad[t:150, heads].all()  # the rest of its document
    assert torch.equal(o[0, 150:], clean[0, 150:])  # the next document is untouched

"""``return_intermediate_states=True`` of ``chunk_gated_delta_rule`` and
``chunk_kda`` (FLA's inference form): the state each 64-token chunk starts
from, against the fp64 oracle's states at the same points on packed
documents, its layouts, its byte query and fake under ``torch.compile``, and
FLA's other chunk sizes (16, 32), which compute on 64-token chunks."""

from __future__ import annotations

import pytest
import torch

from gdn_kcp import (
    chunk_gated_delta_rule,
    chunk_kda,
    gdn_intermediate_states_layout_kcp,
    kda_intermediate_states_layout_kcp,
    naive_kda_recurrence,
    naive_recurrence,
)
from torch._subclasses.fake_tensor import FakeTensorMode

from gdn_kcp.context import capped_context

LENGTHS = [1, 65, 130, 0, 64, 7]
"""A one-token document, one a token past a chunk, two chunks and a bit, an
empty one, one exactly a chunk, a short one: 8 real chunks."""

H_QK, HV, K, V = 1, 2, 16, 8


def _inputs(kda: bool, B: int = 1, T: int | None = None, dtype=torch.float64, seed: int = 0):
    torch.manual_seed(seed)
    T = sum(LENGTHS) if T is None else T
    q = torch.randn(B, T, H_QK, K, dtype=dtype)
    k = torch.randn(B, T, H_QK, K, dtype=dtype)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = -0.2 * torch.rand(B, T, HV, *((K,) if kda else ()), dtype=dtype)
    beta = torch.rand(B, T, HV, dtype=dtype)
    return q, k, v, g, beta


def _bounds(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _oracle_chunk_states(kda, q, k, v, g, beta, h0, cu):
    """The oracle's state at every chunk start of every document: the initial
    state at its first, the final state of its first 64 c tokens at chunk c."""
    oracle = naive_kda_recurrence if kda else naive_recurrence
    rows = []
    for i in range(len(cu) - 1):
        start, end = int(cu[i]), int(cu[i + 1])
        for c in range(0, end - start, 64):
            if c == 0:
                rows.append(h0[i])
                continue
            span = slice(start, start + c)
            _, state = oracle(q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span], initial_state=h0[i:i + 1],
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
            rows.append(state[0])
    return torch.stack(rows)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_packed_states_equal_the_oracle(kda):
    q, k, v, g, beta = _inputs(kda)
    cu = _bounds(LENGTHS)
    h0 = torch.randn(len(LENGTHS), HV, K, V, dtype=torch.float64)
    call = chunk_kda if kda else chunk_gated_delta_rule
    with torch.inference_mode():
        o, final, h = call(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                           use_qk_l2norm_in_kernel=True, return_intermediate_states=True)
        o_plain, final_plain = call(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                    use_qk_l2norm_in_kernel=True)
    expected = _oracle_chunk_states(kda, q, k, v, g, beta, h0, cu)
    n_real = expected.shape[0]
    query = (kda_intermediate_states_layout_kcp if kda else gdn_intermediate_states_layout_kcp)(
        capped_context(cu, [(0, sum(LENGTHS))], 0), HV, K, V, dtype=torch.float64)
    assert (1, *query.shape) == tuple(h.shape) and query.dtype == h.dtype == torch.float64
    assert query.nbytes == h.nbytes
    assert n_real == 8 and h.shape[1] > n_real  # the cap holds sentinel chunks past the real ones
    torch.testing.assert_close(h[0, :n_real], expected, rtol=0, atol=1e-12)
    assert bool((h[0, n_real:] == 0).all())  # a sentinel chunk has no state: zeros, never stale bytes
    # the same call as without the states, to the bit
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)


@pytest.mark.parametrize("kda", [False, True], ids=["gdn", "kda"])
def test_batch_rows_are_flas_layout(kda):
    """Without cu_seqlens: FLA's ``[B, NT, HV, K, V]``, ``NT = ceil(T / 64)``;
    with ``state_v_first``, V and K swapped."""
    B, T = 2, 130
    q, k, v, g, beta = _inputs(kda, B=B, T=T)
    call = chunk_kda if kda else chunk_gated_delta_rule
    with torch.no_grad():
        _, _, h = call(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, return_intermediate_states=True)
        _, _, h_v_first = call(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, return_intermediate_states=True,
                               state_v_first=True)
    assert h.shape == (B, 3, HV, K, V)
    assert torch.equal(h_v_first, h.transpose(-1, -2))
    cu = torch.tensor([0, T, 2 * T])
    packed = tuple(x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    expected = _oracle_chunk_states(kda, *packed, torch.zeros(B, HV, K, V, dtype=torch.float64), cu)
    torch.testing.assert_close(h.reshape(-1, HV, K, V), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_states_come_in_the_input_dtype(dtype):
    q, k, v, g, beta = _inputs(True, B=2, T=100, dtype=dtype)
    with torch.inference_mode():
        o, final, h = chunk_kda(q, k, v, g, beta, output_final_state=True, return_intermediate_states=True)
    assert h.dtype == dtype and final.dtype == torch.float32 and h.shape == (2, 2, HV, K, V)


def test_compiled_states_have_the_query_size():
    """Under ``torch.compile(fullgraph=True)`` the states' fake is the query's
    size, and the compiled call equals the eager one."""
    q, k, v, g, beta = _inputs(False)
    cu = _bounds(LENGTHS)

    def states(q, k, v, g, beta, cu):
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                      return_intermediate_states=True)[2]

    query = gdn_intermediate_states_layout_kcp(capped_context(cu, [(0, sum(LENGTHS))], 0), HV, K, V,
                                               dtype=torch.float64)
    with torch.inference_mode():
        eager = states(q, k, v, g, beta, cu)
        compiled = torch.compile(states, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, cu)
        with FakeTensorMode() as mode:
            fake = states(*(mode.from_tensor(x) for x in (q, k, v, g, beta, cu)))
    assert tuple(fake.shape) == (1, *query.shape) and fake.dtype == query.dtype
    assert torch.equal(compiled, eager)


def test_refusals_name_the_argument():
    q, k, v, g, beta = _inputs(False, B=1, T=70)
    with pytest.raises(ValueError, match=r"return_intermediate_states=True is an inference form"):
        chunk_gated_delta_rule(q.requires_grad_(), k, v, g, beta, return_intermediate_states=True)
    q = q.detach()
    with pytest.raises(ValueError, match=r"64-token chunk starts: it takes chunk_size = 64 only, got chunk_size = 32"):
        chunk_gated_delta_rule(q, k, v, g, beta, return_intermediate_states=True, chunk_size=32)
    with pytest.raises(TypeError, match=r"return_intermediate_states must be a bool"):
        chunk_gated_delta_rule(q, k, v, g, beta, return_intermediate_states=1)


CHUNK_SIZE_CASES = [(False, 16), (False, 32), (False, 64), (True, 32), (True, 64)]


@pytest.mark.parametrize("kda,chunk_size", CHUNK_SIZE_CASES, ids=[f"{'kda' if a else 'gdn'}-{b}"
                                                                   for a, b in CHUNK_SIZE_CASES])
def test_flas_chunk_sizes_are_taken(kda, chunk_size):
    """Every chunk size FLA accepts: the same 64-token computation, so the
    same result to the bit, forward and backward."""
    q, k, v, g, beta = (x.requires_grad_() for x in _inputs(kda, B=1, T=130))
    call = chunk_kda if kda else chunk_gated_delta_rule

    def run(**kw):
        o, s = call(q, k, v, g, beta, output_final_state=True, **kw)
        grads = torch.autograd.grad((o.sum() + s.sum()), (q, k, v, g, beta))
        return (o, s, *grads)

    for got, want in zip(run(chunk_size=chunk_size), run()):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kda,chunk_size,words", [
    (False, 8, "16, 32, or 64 for Gated Delta Rule"), (False, 64.0, "16, 32, or 64 for Gated Delta Rule"),
    (True, 16, "either 32 or 64 for KDA"), (True, 128, "either 32 or 64 for KDA"),
])
def test_other_chunk_sizes_get_flas_error(kda, chunk_size, words):
    q, k, v, g, beta = _inputs(kda, B=1, T=10)
    call = chunk_kda if kda else chunk_gated_delta_rule
    with pytest.raises(ValueError, match=rf"`chunk_size` must be {words}, got chunk_size = {chunk_size!r}"):
        call(q, k, v, g, beta, chunk_size=chunk_size)

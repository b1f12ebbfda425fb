"""``return_intermediate_states=True`` of ``chunk_gated_delta_rule`` and
``chunk_kda`` (FLA's inference form): the state each chunk starts from (at
FLA's chunk sizes 64, 32, 16), against the fp64 oracle's states at the same
points on packed documents, its layouts, its byte query and fake under
``torch.compile``; and FLA's other chunk sizes, which compute on 64-token
chunks."""

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

from gdn_kcp.context import capped_context, context_from_split

LENGTHS = [1, 65, 130, 0, 64, 7, 33]
"""A one-token document, one a token past a chunk, two chunks and a bit, an
empty one, one exactly a chunk, a short one, one a token past half a chunk:
9 real 64-token chunks, 14 of 32, 23 of 16."""

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


def _oracle_chunk_states(kda, q, k, v, g, beta, h0, cu, chunk_size=64):
    """The oracle's state at every chunk start of every document: the initial
    state at its first, the final state of its first ``chunk_size * c`` tokens at chunk c."""
    oracle = naive_kda_recurrence if kda else naive_recurrence
    rows = []
    for i in range(len(cu) - 1):
        start, end = int(cu[i]), int(cu[i + 1])
        for c in range(0, end - start, chunk_size):
            if c == 0:
                rows.append(h0[i])
                continue
            span = slice(start, start + c)
            _, state = oracle(q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span], initial_state=h0[i:i + 1],
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
            rows.append(state[0])
    return torch.stack(rows)


STATE_CASES = [(False, 64, None), (False, 32, None), (False, 16, None), (True, 64, None), (True, 32, None),
               (False, 16, "gate"), (True, 32, "gate")]


@pytest.mark.parametrize("kda,chunk_size,gate", STATE_CASES,
                         ids=[f"{'kda' if a else 'gdn'}-{b}{'-gate' if c else ''}" for a, b, c in STATE_CASES])
def test_packed_states_equal_the_oracle(kda, chunk_size, gate):
    """At 64 tokens the forward's tape, at 32 and 16 the chunk form cut inside
    each 64-token chunk; a hard reset (g = -inf) inside a chunk; with
    ``gate``, FLA's gate in kernel (the raw g through A_log and dt_bias)."""
    q, k, v, g, beta = _inputs(kda)
    g[0, 70] = float("-inf")  # a hard reset in the second document's second chunk
    cu = _bounds(LENGTHS)
    h0 = torch.randn(len(LENGTHS), HV, K, V, dtype=torch.float64)
    call = chunk_kda if kda else chunk_gated_delta_rule
    keywords = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    oracle_g = g
    if gate:
        raw = torch.randn_like(g)
        A_log, dt_bias = torch.randn(HV, dtype=torch.float64), torch.randn(HV * K if kda else HV, dtype=torch.float64)
        keywords.update(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
        g = raw
        rate = -A_log.exp()[:, None].expand(HV, K).reshape(-1) if kda else -A_log.exp()  # per [HV * K] or [HV]
        oracle_g = (rate * torch.nn.functional.softplus(raw.flatten(2) + dt_bias)).view_as(raw)
    with torch.inference_mode():
        o, final, h = call(q, k, v, g, beta, chunk_size=chunk_size, return_intermediate_states=True, **keywords)
        o_plain, final_plain = call(q, k, v, g, beta, **keywords)
    expected = _oracle_chunk_states(kda, q, k, v, oracle_g, beta, h0, cu, chunk_size)
    n_real = expected.shape[0]
    query = (kda_intermediate_states_layout_kcp if kda else gdn_intermediate_states_layout_kcp)(
        capped_context(cu, [(0, sum(LENGTHS))], 0), HV, K, V, dtype=torch.float64, chunk_size=chunk_size)
    assert (1, *query.shape) == tuple(h.shape) and query.dtype == h.dtype == torch.float64
    assert query.nbytes == h.nbytes
    assert n_real == {64: 9, 32: 14, 16: 23}[chunk_size] and h.shape[1] > n_real  # the cap holds spare rows
    torch.testing.assert_close(h[0, :n_real], expected, rtol=0, atol=1e-12)
    assert bool((h[0, n_real:] == 0).all())  # a spare row has no state: zeros, never stale bytes
    # the same call as without the states, to the bit
    assert torch.equal(o, o_plain) and torch.equal(final, final_plain)


@pytest.mark.parametrize("kda,chunk_size", [(False, 64), (True, 64), (False, 16), (True, 32)],
                         ids=["gdn-64", "kda-64", "gdn-16", "kda-32"])
def test_batch_rows_are_flas_layout(kda, chunk_size):
    """Without cu_seqlens: FLA's ``[B, NT, HV, K, V]``, ``NT = ceil(T / chunk_size)``
    (the query's rows); with ``state_v_first``, V and K swapped."""
    B, T = 2, 130
    q, k, v, g, beta = _inputs(kda, B=B, T=T)
    call = chunk_kda if kda else chunk_gated_delta_rule
    keywords = dict(use_qk_l2norm_in_kernel=True, return_intermediate_states=True, chunk_size=chunk_size)
    with torch.no_grad():
        _, _, h = call(q, k, v, g, beta, **keywords)
        _, _, h_v_first = call(q, k, v, g, beta, state_v_first=True, **keywords)
    n_chunks = -(-T // chunk_size)
    assert h.shape == (B, n_chunks, HV, K, V)
    query = gdn_intermediate_states_layout_kcp(context_from_split([0, T, 2 * T], [(0, 2 * T)], 0), HV, K, V,
                                               dtype=torch.float64, chunk_size=chunk_size)
    assert query.shape == (B * n_chunks, HV, K, V)
    assert torch.equal(h_v_first, h.transpose(-1, -2))
    cu = torch.tensor([0, T, 2 * T])
    packed = tuple(x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    expected = _oracle_chunk_states(kda, *packed, torch.zeros(B, HV, K, V, dtype=torch.float64), cu, chunk_size)
    torch.testing.assert_close(h.reshape(-1, HV, K, V), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk_size", [64, 32])
def test_states_come_in_the_input_dtype(dtype, chunk_size):
    q, k, v, g, beta = _inputs(True, B=2, T=100, dtype=dtype)
    with torch.inference_mode():
        o, final, h = chunk_kda(q, k, v, g, beta, output_final_state=True, return_intermediate_states=True,
                                chunk_size=chunk_size)
    assert h.dtype == dtype and final.dtype == torch.float32 and h.shape == (2, -(-100 // chunk_size), HV, K, V)


@pytest.mark.parametrize("chunk_size", [64, 32])
def test_compiled_states_have_the_query_size(chunk_size):
    """Under ``torch.compile(fullgraph=True)`` the states' fake is the query's
    size, and the compiled call equals the eager one."""
    q, k, v, g, beta = _inputs(False)
    cu = _bounds(LENGTHS)

    def states(q, k, v, g, beta, cu):
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                      return_intermediate_states=True, chunk_size=chunk_size)[2]

    query = gdn_intermediate_states_layout_kcp(capped_context(cu, [(0, sum(LENGTHS))], 0), HV, K, V,
                                               dtype=torch.float64, chunk_size=chunk_size)
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

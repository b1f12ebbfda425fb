"""Program-level checks: the chunk index, and the tapes of the forward programs
against the fp64 oracle (h[c] is the state at each chunk start)."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs, max_abs, random_bounds

from gdn_kcp import naive_recurrence
from gdn_kcp.kernels import CHUNK_SIZE, ChunkIndex
from gdn_kcp.kernels import torch as programs


def test_chunk_index_layout():
    index = ChunkIndex.from_fragments([0, 100, 100, 130])
    assert index.chunk_start.tolist() == [0, 64, 100]
    assert index.chunk_len.tolist() == [64, 36, 30]
    assert index.chunk_frag.tolist() == [0, 0, 2]
    assert index.frag_first_chunk.tolist() == [0, 2, 2]
    assert index.frag_n_chunks.tolist() == [2, 0, 1]
    assert (index.n_tokens, index.n_chunks, index.n_frag, index.max_frag_chunks) == (130, 3, 3, 2)
    assert all(t.dtype == torch.int32 for t in (index.chunk_start, index.frag_doc, index.frag_flags))


T, H_qk, HV, K, V = 200, 1, 2, 16, 8


def empty(*shape):
    return torch.empty(shape, dtype=torch.float64)


def prepared(l2: bool, seed: int):
    """fp64 inputs over random documents, initial states and prep's tapes:
    ``(inputs, bounds, index, state0, flat inputs, w, u, q_rstd, k_rstd)``."""
    inputs = make_inputs(T, H_qk, HV, K, V, seed=seed, l2=l2)
    bounds = random_bounds(T, seed=seed - 7, max_len=150)
    state0 = torch.randn(len(bounds) - 1, HV, K, V, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(seed - 9))
    index = ChunkIndex.from_fragments(bounds)
    flat = [x[0] for x in inputs]
    A, w, u = empty(T, HV, CHUNK_SIZE), empty(T, HV, K), empty(T, HV, V)
    q_rstd, k_rstd = (empty(T, H_qk), empty(T, H_qk)) if l2 else (None, None)
    programs.prep(*flat, index, A_out=A, w_out=w, u_out=u, q_rstd_out=q_rstd, k_rstd_out=k_rstd)
    assert index.max_frag_chunks >= 2  # some document holds several chunks
    return inputs, bounds, index, state0, flat, w, u, q_rstd, k_rstd


@pytest.mark.parametrize("l2", [False, True])
def test_tape_walk_states_are_prefix_states(l2):
    (q, k, v, g, beta), bounds, index, state0, flat, w, u, q_rstd, k_rstd = prepared(l2, seed=11)
    N = len(bounds) - 1
    h, v_new, final_state = empty(index.n_chunks, HV, K, V), empty(T, HV, V), torch.zeros(N, HV, K, V).double()
    programs.tape_walk(
        flat[1], w, u, flat[3], index, k_rstd=k_rstd, initial_state=state0, s_in=None,
        h_out=h, v_new_out=v_new, final_state_out=final_state,
    )
    for c in range(index.n_chunks):
        f = int(index.chunk_frag[c])
        start, end = bounds[f], int(index.chunk_start[c])
        prefix = [x[:, start:end] for x in (q, k, v, g, beta)]
        _, expected = naive_recurrence(
            *prefix, initial_state=state0[f : f + 1], output_final_state=True, use_qk_l2norm=l2,
            cu_seqlens=torch.tensor([0, end - start]),
        )
        assert max_abs(h[c], expected[0]) < 1e-10, c
    _, expected_final = naive_recurrence(
        q, k, v, g, beta, initial_state=state0, output_final_state=True, use_qk_l2norm=l2,
        cu_seqlens=torch.tensor(bounds),
    )
    assert max_abs(final_state, expected_final) < 1e-10


@pytest.mark.parametrize("l2", [False, True])
def test_walk_with_output_is_the_oracle(l2):
    """scores then walk_output (the forward that keeps no tape) give the fp64
    oracle's o and final states, from initial states, over random documents."""
    (q, k, v, g, beta), bounds, index, state0, flat, w, u, q_rstd, k_rstd = prepared(l2, seed=12)
    N, p = len(bounds) - 1, empty(T, HV, CHUNK_SIZE)
    programs.scores(flat[0], flat[1], flat[3], index, q_rstd=q_rstd, k_rstd=k_rstd, scores_out=p)
    o, final_state = empty(T, HV, V), torch.zeros(N, HV, K, V).double()
    programs.walk_output(flat[0], flat[1], w, u, flat[3], p, index, scale=K**-0.5, q_rstd=q_rstd, k_rstd=k_rstd,
                         initial_state=state0, s_in=None, o_out=o, final_state_out=final_state)
    expected_o, expected_final = naive_recurrence(
        q, k, v, g, beta, scale=K**-0.5, initial_state=state0, output_final_state=True, use_qk_l2norm=l2,
        cu_seqlens=torch.tensor(bounds),
    )
    assert max_abs(o, expected_o[0]) < 1e-10
    assert max_abs(final_state, expected_final) < 1e-10

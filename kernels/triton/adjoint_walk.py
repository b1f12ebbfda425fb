"""Backward walk of the state adjoint (Triton), last chunk first; one program per
(fragment, value head, value tile). Same signature as ``kernels.torch.adjoint_walk``.

    dh[c] = dS;  dVn = dVn_local + diag(gamma_C / gamma) K dS
    dS_prev = gamma_C dS + scale (diag(gamma) Q)^T dO - W^T dVn
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (BT, WALK_STAGES, acc_dtype, boundary_halves, chunk_tokens, dot, head_block, launch,
                      load_operand_cols, load_qk_cols, load_rows_cols, load_scalars, load_tile, mm_mode, operand, pointer,
                      pull_dot, pull_operand,
                      store_rows_cols, store_state_halves, walk_block, walk_operands)


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report
and ``_common.walk_block``)."""
NUM_STAGES = WALK_STAGES


@triton.jit
def adjoint_chunk(q, k, w, q_rstd, k_rstd, do, dv_local, dS1, dS2, tok, m_t, G, k_scale, gamma_last, scale, H_qk,
                  hk, HV, h, K, V, col, BH: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
                  ACC: tl.constexpr, MM: tl.constexpr):
    """One chunk of the adjoint walk on ``dS = [dS1; dS2]`` (rows ``[0, BH)``
    and ``[BH, 2 BH)`` of K, as ``_common.state_chunk`` holds a state):
    ``(dVn, dS1_prev, dS2_prev)``. The decays (at most 1: ``k_scale``, and
    ``scale gamma_i`` of Q) go on the ``[BT, BV]`` side of the products, so no
    decayed copy of K or Q is made (:func:`walk_operands`). W, K and Q are read
    in ``[BT, BH]`` slices, W's first: on sm_90 at 8 warps, value tiles of 32
    and 2 stages (triton 3.6) the adjoint walk then spilled 4 B per thread, 24
    with W's slices read just before their products, 48 with K's products
    split (compiled without the head dims' divisibility; with it, as a launch
    compiles it, 226 registers and no spill)."""
    b_w1 = load_operand_cols(w, tok, m_t, HV, h, K, 0, BH, MM, ACC)
    b_w2 = load_operand_cols(w, tok, m_t, HV, h, K, BH, BH, MM, ACC)
    b_k1 = operand(load_qk_cols(k, k_rstd, tok, m_t, H_qk, hk, K, 0, BH, HAS_NORM, ACC), MM)
    b_k2 = operand(load_qk_cols(k, k_rstd, tok, m_t, H_qk, hk, K, BH, BH, HAS_NORM, ACC), MM)
    b_dvn = load_rows_cols(dv_local, tok, m_t, HV, h, V, col, BV, ACC) + k_scale[:, None] * (
        dot(b_k1, dS1, MM) + dot(b_k2, dS2, MM))
    # the pull Q^T (c dO): the decay, the scale and q's norm on dO, which is read as two terms
    # (kernels.precision.pull_mode); the raw q is exact in its dtype
    b_c = scale * tl.exp(G)
    if HAS_NORM:
        b_c = b_c * load_scalars(q_rstd, tok, m_t, H_qk, hk, ACC)
    dos_hi, dos_lo = pull_operand(b_c[:, None] * load_rows_cols(do, tok, m_t, HV, h, V, col, BV, ACC), MM)
    b_dvo = operand(b_dvn, MM)
    b_q = load_tile(q, tok, m_t, H_qk, hk, K, 0, BH)
    dS1 = gamma_last * dS1 + pull_dot(tl.trans(b_q), dos_hi, dos_lo, MM) - dot(tl.trans(b_w1), b_dvo, MM)
    b_q = load_tile(q, tok, m_t, H_qk, hk, K, BH, BH)
    dS2 = gamma_last * dS2 + pull_dot(tl.trans(b_q), dos_hi, dos_lo, MM) - dot(tl.trans(b_w2), b_dvo, MM)
    return b_dvn, dS1, dS2


@triton.jit
def adjoint_walk_kernel(
    q, k, w, g, gate_params, do, dv_local, q_rstd, k_rstd, chunk_table, frag_table, d_final, lam, carry_in, dh, dv,
    d_initial, scale,
    n_chunks, n_frag, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_FINAL: tl.constexpr, HAS_LAM: tl.constexpr, HAS_INITIAL: tl.constexpr, HAS_CARRY: tl.constexpr,
    GATE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
):
    i_f, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H_qk)
    col = i_v * BV
    # dh's and d_initial's rows come from the fragment's first chunk, count and initial row: read
    # here, not through frag_info (_common.chunk_tokens' note)
    first, count = tl.load(frag_table + 2 * n_frag + i_f), tl.load(frag_table + 3 * n_frag + i_f)
    initial_row = i_f - (tl.load(frag_table + 5 * n_frag) & 1)  # fragment 0 alone can cross in
    flags = tl.load(frag_table + 5 * n_frag + i_f)
    BH: tl.constexpr = BK // 2 if BK > 16 else BK  # the state's halves (_common.state_chunk)
    # a SEGMENT row ends at its carry-plane row
    dS1, dS2 = boundary_halves(d_final, i_f, lam, carry_in, frag_table, n_frag, i_f, flags, HV, i_h, K, V, col, BH, BV,
                               2, HAS_FINAL, HAS_LAM, HAS_CARRY, ACC)
    for jj in range(0, count):
        c = first + count - 1 - jj
        store_state_halves(dh, dS1, dS2, c, HV, i_h, K, V, col, BH, BV)
        start, length = tl.load(chunk_table + c), tl.load(chunk_table + n_chunks + c)
        tok, o_t, m_t = chunk_tokens(start, length, BT)
        G, k_scale, gamma_last = walk_operands(g, gate_params, tok, length, HV, i_h, BT, GATE, ACC)
        b_dvn, dS1, dS2 = adjoint_chunk(q, k, w, q_rstd, k_rstd, do, dv_local, dS1, dS2, tok, m_t, G, k_scale,
                                        gamma_last, scale, H_qk, i_hk, HV, i_h, K, V, col, BH, BV, HAS_NORM, ACC, MM)
        store_rows_cols(dv, b_dvn, tok, m_t, HV, i_h, V, col, BV)
    if HAS_INITIAL:
        if (flags & 1) == 0:
            store_state_halves(d_initial, dS1, dS2, initial_row, HV, i_h, K, V, col, BH, BV)


def adjoint_walk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    do: torch.Tensor,
    dv_local: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    d_final_state: torch.Tensor | None,
    lam_end: torch.Tensor | None,
    dh_out: torch.Tensor,
    dv_out: torch.Tensor,
    d_initial_state_out: torch.Tensor | None,
    carry_in: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.adjoint_walk`` (``dv_local`` and ``dv_out`` may be one tensor; with
    ``carry_in`` ``[n_sum, HV, K, V]``, ``index`` is a phase-3 index with its ``frag_carry`` row)."""
    has_carry = carry_in is not None and carry_in.shape[0] > 0
    H_qk, K = q.shape[1], q.shape[2]
    HV, V = do.shape[1], do.shape[2]
    if index.n_frag == 0:
        return
    BV = walk_block(V)
    spare = dh_out
    launch(adjoint_walk_kernel)[(index.n_frag, HV, triton.cdiv(V, BV))](
        q, k, w, g, pointer(gate_params, g), do, dv_local, pointer(q_rstd, g), pointer(k_rstd, g),
        index.chunk_table, index.frag_table,
        pointer(d_final_state, spare), pointer(lam_end, spare), carry_in if has_carry else spare,
        dh_out, dv_out, pointer(d_initial_state_out, spare), scale,
        index.n_chunks, index.n_frag, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=BV, HAS_NORM=q_rstd is not None, HAS_FINAL=d_final_state is not None,
        HAS_LAM=lam_end is not None, HAS_INITIAL=d_initial_state_out is not None, HAS_CARRY=has_carry,
        GATE=gate_params is not None,
        ACC=acc_dtype(k), MM=mm_mode(k), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )

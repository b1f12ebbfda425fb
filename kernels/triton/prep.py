"""Program #1, prep (Triton): per chunk and value head the WY factors ``A = (I + L)^-1``,
``W = A diag(beta gamma) K``, ``U = A diag(beta) V``,
and the q/k reciprocal norms. Same signature as ``kernels.torch.prep``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..torch._chunks import L2NORM_EPS
from ._common import (cast_to, BT, acc_dtype, causal_scores, chunk_rows, head_block, load_beta, load_gates, load_qk,
                      load_rows_cols, lower_dot, mm_mode, pointer, store_rows_cols, value_block)


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report)."""


@triton.jit
def l2_rstd_kernel(x, rstd, T, H, D, EPS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    """``rstd[t, h] = 1 / sqrt(sum_d x[t, h, d]^2 + eps)``; grid (T / BT, H)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    tok = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    m_t = tok < T
    x_t = load_rows_cols(x, tok, m_t, H, i_h, D, 0, BD, ACC)
    r = 1.0 / tl.sqrt(tl.sum(x_t * x_t, 1) + EPS)
    tl.store(rstd + tok * H + i_h, cast_to(r, rstd), mask=m_t)


@triton.jit
def unit_lower_inverse(L, BT: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower ``[BT, BT]`` L, row by row:
    ``A[i] = e_i - L[i, :i] A[:i]`` (rows above i are final). The sum selects
    rows ``j < i``, so a non-finite row of L reaches only the rows after it."""
    o_i = tl.arange(0, BT)
    A = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0).to(L.dtype)
    for i in range(1, BT):
        l_row = tl.sum(tl.where(o_i[:, None] == i, L, 0.0), 0)
        row = tl.where(o_i == i, 1.0, -tl.sum(tl.where(o_i[:, None] < i, l_row[:, None] * A, 0.0), 0))
        A = tl.where(o_i[:, None] == i, row[None, :], A)
    return A


@triton.jit
def prep_kernel(
    q, k, v, g, gate_params, beta, chunk_table, A_out, w, u, k_rstd,
    n_chunks, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, STORE_A: tl.constexpr,
    GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
):
    """One chunk of one value head; grid (NC, HV)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length, o_t, m_t = chunk_rows(chunk_table, n_chunks, i_c, BT)
    tok = start + o_t
    b_g, G, _ = load_gates(g, gate_params, tok, m_t, HV, i_h, GATE, ACC)
    b_beta, _ = load_beta(beta, tok, m_t, HV, i_h, BETA_SIGMOID, BETA_SCALE, ACC)
    b_k = load_qk(k, k_rstd, tok, m_t, H_qk, i_hk, K, BK, HAS_NORM, ACC)
    b_L = causal_scores(b_beta[:, None] * b_k, b_k, b_g, True, MM)
    b_A = unit_lower_inverse(b_L, BT)
    if STORE_A:
        store_rows_cols(A_out, b_A, tok, m_t, HV, i_h, BT, 0, BT)
    b_w = lower_dot(b_A, (b_beta * tl.exp(G))[:, None] * b_k, MM)
    store_rows_cols(w, b_w, tok, m_t, HV, i_h, K, 0, BK)
    for col in range(0, V, BV):
        b_v = load_rows_cols(v, tok, m_t, HV, i_h, V, col, BV, ACC)
        store_rows_cols(u, lower_dot(b_A, b_beta[:, None] * b_v, MM), tok, m_t, HV, i_h, V, col, BV)


def prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    beta_scale: float = 1.0,
    A_out: torch.Tensor | None,
    w_out: torch.Tensor,
    u_out: torch.Tensor,
    q_rstd_out: torch.Tensor | None = None,
    k_rstd_out: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.prep``."""
    T, H_qk, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    ACC = acc_dtype(w_out)
    if k_rstd_out is not None:
        grid = (triton.cdiv(T, BT), H_qk)
        for x, out in ((q, q_rstd_out), (k, k_rstd_out)):
            if T:
                l2_rstd_kernel[grid](x, out, T, H_qk, K, EPS=L2NORM_EPS, BT=BT, BD=head_block(K), ACC=ACC)
    if index.n_chunks == 0:
        return
    prep_kernel[(index.n_chunks, HV)](
        q, k, v, g, pointer(gate_params, g), beta, index.chunk_table,
        pointer(A_out, w_out), w_out, u_out, pointer(k_rstd_out, w_out),
        index.n_chunks, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=value_block(V), HAS_NORM=k_rstd_out is not None, STORE_A=A_out is not None,
        GATE=gate_params is not None, BETA_SIGMOID=beta_sigmoid, BETA_SCALE=float(beta_scale), ACC=ACC, MM=mm_mode(k), num_warps=NUM_WARPS,
    )

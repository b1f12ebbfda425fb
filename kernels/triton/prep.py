"""Program #1, prep (Triton): per chunk and value head the WY factors ``A = (I + L)^-1``,
``W = A diag(beta gamma) K``, ``U = A diag(beta) V``,
and the q/k reciprocal norms. Same signature as ``kernels.torch.prep``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..torch._chunks import L2NORM_EPS
from ..torch.prep import INVERSE_BLOCK
from ._common import (BT, acc_dtype, causal_scores, chunk_rows, dot, head_block, load_beta, load_gates, load_qk,
                      load_rows_cols, lower_dot, mm_mode, operand, pointer, rows_reached, store_rows_cols,
                      store_scalars, value_block)


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report)."""

BC = tl.constexpr(INVERSE_BLOCK)
"""Diagonal blocks of :func:`unit_lower_inverse` (``kernels.torch.prep.INVERSE_BLOCK``)."""


@triton.jit
def l2_rstd_kernel(x, rstd, T, H, D, EPS: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    """``rstd[t, h] = 1 / sqrt(sum_d x[t, h, d]^2 + eps)``; grid (T / BT, H)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    tok = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    m_t = tok < T
    x_t = load_rows_cols(x, tok, m_t, H, i_h, D, 0, BD, ACC)
    r = 1.0 / tl.sqrt(tl.sum(x_t * x_t, 1) + EPS)
    store_scalars(rstd, r, tok, m_t, H, i_h)


@triton.jit
def diagonal_block_inverse(b_L, BC: tl.constexpr):
    """``(I + L)^-1`` on the ``[BC, BC]`` diagonal blocks of a strictly lower
    ``[BT, BT]`` L (zero off them), by forward substitution in the compute dtype:
    step r solves row r of every block, ``Ai[i] = e_i - L[i, block] Ai[block]``.
    The blocks share no column, so row r of all ``BT / BC`` blocks packs into
    one ``[BT]`` vector (column j holds block ``j // BC``): a step costs the two
    ``[BT, BT]`` reductions of one row of a whole-chunk substitution, and there
    are ``BC - 1`` steps instead of ``BT - 1``. Unrolled, and built as its
    transpose ``b_AiT`` so that each reduction yields its vector in the layout
    the next broadcast reads: prep's spill stores on sm_90 (bf16, K = V = 128)
    384 B per thread as a loop on ``b_Ai``, 156 unrolled, 52 unrolled on
    ``b_AiT`` (the whole-chunk substitution: 148)."""
    o_i = tl.arange(0, b_L.shape[0])
    b_AiT = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0).to(b_L.dtype)
    for r in tl.static_range(1, BC):
        # row r of column j's block at [i, j] (the mask keeps L's diagonal blocks only)
        m_r = (o_i[:, None] == (o_i[None, :] // BC) * BC + r) & (o_i[:, None] != o_i[None, :])
        b_l = tl.sum(tl.where(m_r, b_L, 0.0), 0)  # row r of column j's block, at j
        b_a = -tl.sum(b_AiT * b_l[None, :], 1)  # rows above r of each block are final, the rest read 0
        b_AiT = tl.where(tl.trans(m_r), b_a[:, None], b_AiT)
    return tl.trans(b_AiT)


@triton.jit
def merge_operand(b_L, BC: tl.constexpr, MM: tl.constexpr):
    """The ``M21`` blocks that :func:`merge_lower_inverse` reads at ``BC``: L on
    its ``[2 BC, 2 BC]`` diagonal blocks but off the ``[BC, BC]`` ones (zero
    elsewhere), already as the products read it (:func:`operand`)."""
    o_i = tl.arange(0, b_L.shape[0])
    m_pair = o_i[:, None] // (2 * BC) == o_i[None, :] // (2 * BC)
    m_21 = m_pair & (o_i[:, None] // BC != o_i[None, :] // BC)
    return operand(tl.where(m_21, b_L, 0.0), MM)


@triton.jit
def merge_lower_inverse(b_Ai, b_M, MM: tl.constexpr):
    """The inverses of ``I + L`` on its ``[2 BC, 2 BC]`` diagonal blocks from
    those on its ``[BC, BC]`` ones (``b_Ai``, zero off them) and the ``M21``
    blocks ``b_M`` (:func:`merge_operand`): for ``[[M11, 0], [M21, M22]]`` the
    inverse is ``[[Ai11, 0], [-Ai22 M21 Ai11, Ai22]]``. Every block pair at once
    as two ``[BT, BT]`` tensor-core products, ``(Ai M21) Ai``, the zeros of both
    operands adding exact zeros; the diagonal blocks of ``b_Ai`` pass through
    unrounded."""
    return b_Ai - dot(dot(b_Ai, b_M, MM), b_Ai, MM)


@triton.jit
def unit_lower_inverse(b_L, BC: tl.constexpr, MM: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower ``[BT, BT]`` L (``BT = 4 BC``): the
    ``BC`` diagonal blocks by substitution (:func:`diagonal_block_inverse`),
    then merged to ``2 BC`` and ``4 BC`` (:func:`merge_lower_inverse`) with
    products under the rule ``MM``, as ``kernels.torch.prep.unit_lower_inverse``.
    A non-finite entry of L is zeroed and its row and every row after it made
    NaN (:func:`rows_reached`): the products would spread ``0 * inf`` to rows
    before it, and row i of the inverse depends on rows ``<= i`` of L only."""
    tl.static_assert(b_L.shape[0] == 4 * BC)
    finite = (b_L - b_L) == 0.0
    m_reached = rows_reached(finite)  # [BT] rather than the [BT, BT] mask live through the products
    b_L = tl.where(finite, b_L, 0.0)
    # The merges' operands first, in their operand dtype (bf16 for bf16 inputs), so the
    # fp32 L is not live through the substitution and the products: prep's spill stores
    # on sm_90 152 -> 52 B per thread.
    b_M1 = merge_operand(b_L, BC, MM)
    b_M2 = merge_operand(b_L, 2 * BC, MM)
    b_Ai = diagonal_block_inverse(b_L, BC)
    b_Ai = merge_lower_inverse(b_Ai, b_M1, MM)
    b_Ai = merge_lower_inverse(b_Ai, b_M2, MM)
    return tl.where(m_reached[:, None], float("nan"), b_Ai)


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
    b_A = unit_lower_inverse(b_L, BC, MM)
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
    ACC = acc_dtype(k)
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
        GATE=gate_params is not None, BETA_SIGMOID=beta_sigmoid, BETA_SCALE=float(beta_scale), ACC=ACC,
        MM=mm_mode(k), num_warps=NUM_WARPS,
    )

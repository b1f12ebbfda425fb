"""Program #1, prep (Triton): per chunk and value head the WY factors ``A = (I + L)^-1``,
``W = A diag(beta gamma) K``, ``U = A diag(beta) V``,
and the q/k reciprocal norms. Same signatures as ``kernels.torch.prep``. Three
launches: the norms, A (``wy_inverse_kernel``, into ``A_out``), then W and U
from A (``w_u``, which the backward of ``save_mode="inverse"`` runs alone)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..torch._chunks import L2NORM_EPS
from ..precision import channel_mode, matmul_mode
from ._common import (BT, acc_dtype, channel_gates, chunk_tokens, dot, head_block, launch, load_beta, load_gates,
                      load_operand, load_qk_cols, load_rows_cols, mm_mode, pointer, register_cap, store_rows_cols,
                      store_scalars)
from .wy_inverse import BKS_CHANNEL_INVERSE, BKS_INVERSE, MAX_REGISTERS as INVERSE_MAX_REGISTERS
from .wy_inverse import channel_wy_inverse_kernel, wy_inverse_kernel
from .wy_inverse import NUM_WARPS as INVERSE_WARPS

NUM_WARPS = 4
"""Warps per program of the W, U kernel."""
BK_WU = 16
"""Key columns per slice of W."""
BV_WU = 16
"""Value columns per slice of U. On sm_90 (bf16, K = V = 128, triton 3.6) at
4 warps capped at 128 registers (``MAX_REGISTERS``) slices of 16 / 16 spill
nothing and four programs share an SM: the calibrated model prices a launch
at T = 32K, HV = 32 at 314 us, against 334 at three per SM (156 registers
uncapped) and 374 at slices of 64 / 32 (255 registers, two per SM; 32 / 16
capped at 128 spill 396 B per thread); at 8 warps nothing spills but one
program holds an SM (180 to 193 registers): 495 us."""
MAX_REGISTERS = 128
"""ptxas's cap per thread for ``prep_kernel`` (see BV_WU)."""


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
def nan_rows_reached(ptr, b_bad, tok, m_t, H, h, D, BD: tl.constexpr):
    """Rows at and after the first row flagged in ``b_bad`` (``[BT]`` int) set to
    NaN in every column of head ``h`` of ``[T, H, D]``: what one
    :func:`lower_dot` over all D columns makes of a non-finite operand row,
    for a product computed in column slices. Stores only when a row is flagged."""
    if tl.max(b_bad, 0) > 0:
        tl.debug_barrier()  # every thread's slice stores land before the NaN stores over them
        m_nan = m_t & (tl.cumsum(b_bad, 0) > 0)
        for col in range(0, D, BD):
            store_rows_cols(ptr, tl.full([b_bad.shape[0], BD], float("nan"), tl.float32), tok, m_nan, H, h, D, col,
                            BD)


@triton.jit
def lower_dot_rows(lower, x, ptr, b_bad, tok, m_t, H, h, D, col, BD: tl.constexpr, MM: tl.constexpr):
    """Columns ``[col, col + BD)`` of ``lower @ x`` stored into head ``h`` of
    ``ptr``, without the ``0 * inf`` of ``lower``'s zeros (its non-finite rows
    zeroed); returns ``b_bad`` with x's non-finite rows flagged, for
    :func:`nan_rows_reached` once every slice is stored."""
    finite = (x - x) == 0.0
    store_rows_cols(ptr, dot(lower, tl.where(finite, x, 0.0), MM), tok, m_t, H, h, D, col, BD)
    return tl.maximum(b_bad, tl.max(tl.where(finite, 0, 1), 1))


@triton.jit
def prep_kernel(
    k, v, g, gate_params, beta, chunk_table, A, w, u, k_rstd,
    n_chunks, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
    GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
    CHANNEL: tl.constexpr,
):
    """W and U of one chunk of one value head from its A (``wy_inverse_kernel``),
    in key slices of ``BK`` and value slices of ``BV``; grid (NC, HV). With
    ``CHANNEL`` (KDA) g holds a gate per key channel ``[T, HV, K]`` and W's
    rows decay by their channels' cumsums ``exp(G_jd)`` (at most 1)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    b_beta, _ = load_beta(beta, tok, m_t, HV, i_h, BETA_SIGMOID, BETA_SCALE, ACC)
    if not CHANNEL:
        b_g, G, _ = load_gates(g, gate_params, tok, m_t, HV, i_h, GATE, ACC)
        b_bg = (b_beta * tl.exp(G))[:, None]
    b_A = load_operand(A, tok, m_t, HV, i_h, BT, BT, MM, ACC)
    b_bad = tl.zeros([BT], dtype=tl.int32)
    for col in range(0, K, BK):
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, col, BK, HAS_NORM, ACC)
        if CHANNEL:
            b_gc = channel_gates(g, gate_params, tok, m_t, HV, i_h, K, col, BK, GATE, ACC)
            b_bg = b_beta[:, None] * tl.exp(tl.cumsum(b_gc, 0))
        b_bad = lower_dot_rows(b_A, b_bg * b_k, w, b_bad, tok, m_t, HV, i_h, K, col, BK, MM)
    nan_rows_reached(w, b_bad, tok, m_t, HV, i_h, K, BK)
    b_bad = tl.zeros([BT], dtype=tl.int32)
    for col in range(0, V, BV):
        b_v = load_rows_cols(v, tok, m_t, HV, i_h, V, col, BV, ACC)
        b_bad = lower_dot_rows(b_A, b_beta[:, None] * b_v, u, b_bad, tok, m_t, HV, i_h, V, col, BV, MM)
    nan_rows_reached(u, b_bad, tok, m_t, HV, i_h, V, BV)


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
    A_out: torch.Tensor,
    w_out: torch.Tensor,
    u_out: torch.Tensor,
    q_rstd_out: torch.Tensor | None = None,
    k_rstd_out: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.prep``."""
    T, H_qk, K = k.shape
    HV = v.shape[1]
    ACC = acc_dtype(k)
    if k_rstd_out is not None:
        grid = (triton.cdiv(T, BT), H_qk)
        for x, out in ((q, q_rstd_out), (k, k_rstd_out)):
            if T:
                launch(l2_rstd_kernel)[grid](x, out, T, H_qk, K, EPS=L2NORM_EPS, BT=BT, BD=head_block(K), ACC=ACC)
    if index.n_chunks == 0:
        return
    grid = (index.n_chunks, HV)
    gate, k_rstd = pointer(gate_params, g), pointer(k_rstd_out, w_out)
    flags = dict(BT=BT, HAS_NORM=k_rstd_out is not None, GATE=gate_params is not None, BETA_SIGMOID=beta_sigmoid,
                 BETA_SCALE=float(beta_scale), ACC=ACC, MM=mm_mode(k))
    if g.dim() == 3:  # KDA: a gate per key channel
        launch(channel_wy_inverse_kernel)[grid](
            k, g, gate, beta, index.chunk_table, k_rstd, A_out, index.n_chunks, H_qk, HV, K,
            BKS=min(BKS_CHANNEL_INVERSE, head_block(K)), **flags, CMM=channel_mode(matmul_mode(k.dtype)),
            num_warps=INVERSE_WARPS,
        )
    else:
        launch(wy_inverse_kernel)[grid](
            k, g, gate, beta, index.chunk_table, k_rstd, A_out, index.n_chunks, H_qk, HV, K,
            BKS=min(BKS_INVERSE, head_block(K)), **flags, num_warps=INVERSE_WARPS,
            **register_cap(INVERSE_MAX_REGISTERS),
        )
    w_u(k, v, g, beta, A_out, index, gate_params=gate_params, beta_sigmoid=beta_sigmoid, beta_scale=beta_scale,
        k_rstd=k_rstd_out, w_out=w_out, u_out=u_out)


def w_u(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    beta_scale: float = 1.0,
    k_rstd: torch.Tensor | None = None,
    w_out: torch.Tensor,
    u_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.prep.w_u``: ``prep_kernel`` alone."""
    if index.n_chunks == 0:
        return
    H_qk, K = k.shape[1], k.shape[2]
    HV, V = v.shape[1], v.shape[2]
    launch(prep_kernel)[(index.n_chunks, HV)](
        k, v, g, pointer(gate_params, g), beta, index.chunk_table, A, w_out, u_out, pointer(k_rstd, w_out),
        index.n_chunks, H_qk, HV, K, V,
        BT=BT, BK=min(BK_WU, head_block(K)), BV=min(BV_WU, head_block(V)), HAS_NORM=k_rstd is not None,
        GATE=gate_params is not None, BETA_SIGMOID=beta_sigmoid, BETA_SCALE=float(beta_scale), ACC=acc_dtype(k),
        MM=mm_mode(k), CHANNEL=g.dim() == 3, num_warps=NUM_WARPS, **register_cap(MAX_REGISTERS),
    )

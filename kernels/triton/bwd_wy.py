"""Backward of the WY factors (Triton) through A to k, v, beta and the gate
cumsum; one program per (chunk, value head). Same signature as
``kernels.torch.bwd_wy``.

    dA = dW (beta gamma K)^T + dU (beta V)^T,   dL = -strict_lower(A^T dA A^T)

The loops over K are dynamic (``range``): unrolled, the second loop's tiles
stayed live across slices and spilled at 4 warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..precision import channel_mode, matmul_mode
from ._common import (BT, acc_dtype, causal_decay, channel_gates, chunk_tokens, dot, head_block, launch, load_beta, load_gates,
                      load_operand, load_qk_cols, load_rows_cols, load_scalars, mm_mode, pointer, register_cap,
                      store_rows_cols, store_scalars, value_block)
from .channel import channel_pulls, pair_levels
from .scores import SUB_ROWS


BKS_WY = 16
BV_WY = 16
"""K and V blocks: at 32 / 64 the kernel spilled 136 B per thread under triton
3.6 (the GPU machine's) and 240 under 3.9; at 16 / 32, 0 and 56
(compile_specs --report, 8 warps). At 4 warps (two programs per SM) and
16 / 16 it spilled 8 B under 3.6 and none under 3.9 (64 B under 3.6 while the
first K loop also formed A^T dW; 16 / 32: 320 B; 32 / 16: 1,416 B); as a
launch at K = V = 128 compiles it, 193 registers and no spill (3.6)."""
MAX_REGISTERS = 168
"""ptxas's registers per thread (``maxnreg``): three 4-warp programs per SM;
16 B per thread of spills under triton 3.6, none under 3.9 (sm_90, bf16,
K = V = 128). The calibrated model: 990 us a launch at T = 32K, HV = 32,
against 1,056 uncapped (193 registers, two per SM)."""
NUM_WARPS = 4
"""Warps per program: at 8 (247 registers, one program per SM) the calibrated
model priced the launch 184 us above 4 warps' two programs per SM at T = 32K,
HV = 32 (benchmarks/roofline.py)."""
CHANNEL_WARPS = 8
"""Warps per program with a gate per key channel (KDA; see :func:`warps`)."""


def warps(constexprs) -> int:
    """Warps per program: ``NUM_WARPS``, ``CHANNEL_WARPS`` for a gate per key channel."""
    return CHANNEL_WARPS if constexprs["CHANNEL"] else NUM_WARPS


def max_registers(constexprs) -> int | None:
    """``MAX_REGISTERS``, or no cap (None) for a gate per key channel (one program per SM at 8 warps)."""
    return None if constexprs["CHANNEL"] else MAX_REGISTERS


@triton.jit
def values_pass(v, du, dv, b_A, b_beta, tok, m_t, HV, i_h, V, BT: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr,
                MM: tl.constexpr):
    """The value tiles' part of the WY backward: stores ``dv = diag(beta)
    A^T dU`` and returns ``dU (beta V)^T`` (dA's value term) and ``<(A^T
    dU)_i, v_i>`` (beta's)."""
    dA = tl.zeros([BT, BT], dtype=ACC)
    u_dot_v = tl.zeros([BT], dtype=ACC)
    for col in range(0, V, BV):
        b_v = load_rows_cols(v, tok, m_t, HV, i_h, V, col, BV, ACC)
        b_du = load_rows_cols(du, tok, m_t, HV, i_h, V, col, BV, ACC)
        At_du = dot(tl.trans(b_A), b_du, MM)
        store_rows_cols(dv, b_beta[:, None] * At_du, tok, m_t, HV, i_h, V, col, BV)
        u_dot_v += tl.sum(At_du * b_v, 1)
        dA += dot(b_du, tl.trans(b_beta[:, None] * b_v), MM)
    return dA, u_dot_v


@triton.jit
def channel_wy(k, v, beta, g, gate_params, A, dw, du, k_rstd, dk_acc, dv, dbeta, dg_acc, start, length, H_qk, i_hk,
               HV, i_h, K, V, BT: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
               HAS_NORM: tl.constexpr, GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr,
               ACC: tl.constexpr, MM: tl.constexpr, SUB: tl.constexpr, CMM: tl.constexpr):
    """:func:`bwd_wy_kernel` for a gate per key channel (KDA;
    ``kernels.torch.bwd_wy.channel_wy``): W's decay per channel in dA, and
    ``L_ij = sum_d (beta_i k_id) k_jd exp(G_id - G_jd)``'s gradient dL
    pulled to its two operands by ``channel.channel_pulls`` (dyadic anchors,
    products under ``CMM``), one slice of ``BKS`` key channels at a
    time; dg per channel ``[T, HV, K]``."""
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    b_beta, dbeta_dinput = load_beta(beta, tok, m_t, HV, i_h, BETA_SIGMOID, BETA_SCALE, ACC)
    b_A = load_operand(A, tok, m_t, HV, i_h, BT, BT, MM, ACC)  # read only by products
    dA, b_dbeta = values_pass(v, du, dv, b_A, b_beta, tok, m_t, HV, i_h, V, BT, BV, ACC, MM)
    for c0 in range(0, BK, BKS):
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)
        e_G = tl.exp(tl.cumsum(channel_gates(g, gate_params, tok, m_t, HV, i_h, K, c0, BKS, GATE, ACC), 0))
        b_dw = load_rows_cols(dw, tok, m_t, HV, i_h, K, c0, BKS, ACC)
        dA += dot(b_dw, tl.trans(b_beta[:, None] * e_G * b_k), MM)
    dL = tl.where(o_t[:, None] > o_t[None, :], -dot(dot(tl.trans(b_A), dA, MM), tl.trans(b_A), MM), 0.0)
    l32, l16, l8, l4, l2, l1, l0 = pair_levels(dL, BT)  # once for every key slice
    for c0 in range(0, BK, BKS):
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)
        e_G = tl.exp(tl.cumsum(channel_gates(g, gate_params, tok, m_t, HV, i_h, K, c0, BKS, GATE, ACC), 0))
        At_dw = dot(tl.trans(b_A), load_rows_cols(dw, tok, m_t, HV, i_h, K, c0, BKS, ACC), MM)
        # the left operand's pull dL . K and the right one's dL^T . (beta K)
        d_left, d_right = channel_pulls(l32, l16, l8, l4, l2, l1, l0, k, k, k_rstd, k_rstd, g, gate_params, b_beta,
                                        start, length, H_qk, i_hk, HV, i_h, K, c0, BT, BKS, HAS_NORM, GATE, ACC, CMM)
        through_w = e_G * b_k * At_dw
        b_dk = b_beta[:, None] * (e_G * At_dw + d_left) + d_right
        b_dk += load_rows_cols(dk_acc, tok, m_t, HV, i_h, K, c0, BKS, ACC)
        store_rows_cols(dk_acc, b_dk, tok, m_t, HV, i_h, K, c0, BKS)
        b_dbeta += tl.sum(through_w, 1) + tl.sum(b_k * d_left, 1)
        dG = b_beta[:, None] * (through_w + b_k * d_left) - b_k * d_right
        dG += load_rows_cols(dg_acc, tok, m_t, HV, i_h, K, c0, BKS, ACC)
        store_rows_cols(dg_acc, dG, tok, m_t, HV, i_h, K, c0, BKS)
    store_scalars(dbeta, b_dbeta * dbeta_dinput, tok, m_t, HV, i_h)


@triton.jit
def bwd_wy_kernel(
    k, v, beta, g, gate_params, A, dw, du, k_rstd, chunk_table, dk_acc, dv, dbeta, dg_acc,
    n_chunks, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
    GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr,
    BETA_SCALE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, CHANNEL: tl.constexpr, SUB: tl.constexpr,
    CMM: tl.constexpr,
):
    """One chunk and value head; grid (NC, HV). With ``CHANNEL`` (KDA) g and
    dg_acc hold a gate per key channel ``[T, HV, K]``: :func:`channel_wy`."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    if CHANNEL:
        channel_wy(k, v, beta, g, gate_params, A, dw, du, k_rstd, dk_acc, dv, dbeta, dg_acc, start, length, H_qk,
                   i_hk, HV, i_h, K, V, BT, BK, BKS, BV, HAS_NORM, GATE, BETA_SIGMOID, BETA_SCALE, ACC, MM, SUB, CMM)
        return
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    b_g, G, _ = load_gates(g, gate_params, tok, m_t, HV, i_h, GATE, ACC)
    b_beta, dbeta_dinput = load_beta(beta, tok, m_t, HV, i_h, BETA_SIGMOID, BETA_SCALE, ACC)
    b_A = load_operand(A, tok, m_t, HV, i_h, BT, BT, MM, ACC)  # read only by products
    beta_gamma = b_beta * tl.exp(G)
    # K in blocks of BKS columns, in two passes: with whole [BT, 128] tiles of
    # k, dw and A^T dw it spilled 2,020 B per thread on sm_90, 1,456 with 64-column
    # blocks, 760 with 32 (compile_specs --report; see BKS_WY)
    dA = tl.zeros([BT, BT], dtype=ACC)
    for c0 in range(0, BK, BKS):
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)
        b_dw = load_rows_cols(dw, tok, m_t, HV, i_h, K, c0, BKS, ACC)
        dA += dot(b_dw, tl.trans(beta_gamma[:, None] * b_k), MM)
    u_dot_v = tl.zeros([BT], dtype=ACC)
    for col in range(0, V, BV):  # values_pass's loop inline: called, GDN's program spilled 108 B, not 60
        b_v = load_rows_cols(v, tok, m_t, HV, i_h, V, col, BV, ACC)
        b_du = load_rows_cols(du, tok, m_t, HV, i_h, V, col, BV, ACC)
        At_du = dot(tl.trans(b_A), b_du, MM)
        store_rows_cols(dv, b_beta[:, None] * At_du, tok, m_t, HV, i_h, V, col, BV)
        u_dot_v += tl.sum(At_du * b_v, 1)
        dA += dot(b_du, tl.trans(b_beta[:, None] * b_v), MM)
    o_i = tl.arange(0, BT)
    dL = tl.where(o_i[:, None] > o_i[None, :], -dot(dot(tl.trans(b_A), dA, MM), tl.trans(b_A), MM), 0.0)
    dL_decayed = dL * causal_decay(b_g, True)
    # dL * L (L = diag(beta) K K^T * decay) as one fp32 matrix, reduced to its
    # row and column sums before the dk loop (module docstring: sums taken from
    # dk's products instead round each side differently); K K^T in its own pass
    # over K, so no [BT, BT] accumulator beyond dL is live through a loop
    kkt = tl.zeros([BT, BT], dtype=ACC)
    for c0 in range(0, BK, BKS):
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)
        kkt += dot(b_k, tl.trans(b_k), MM)
    dL_kkt = dL_decayed * kkt
    through_L = b_beta[:, None] * dL_kkt  # dL * L
    dG = tl.sum(through_L, 1) - tl.sum(through_L, 0)
    b_dbeta = u_dot_v + tl.sum(dL_kkt, 1)
    dKk = b_beta[:, None] * dL_decayed
    dKk_sym = dKk + tl.trans(dKk)
    w_dot_k = tl.zeros([BT], dtype=ACC)  # <(A^T dW)_i, k_i>, from the product dk needs (A^T dW once)
    for c0 in range(0, BK, BKS):
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)
        At_dw = dot(tl.trans(b_A), load_rows_cols(dw, tok, m_t, HV, i_h, K, c0, BKS, ACC), MM)
        b_dk = beta_gamma[:, None] * At_dw + dot(dKk_sym, b_k, MM)
        b_dk += load_rows_cols(dk_acc, tok, m_t, HV, i_h, K, c0, BKS, ACC)
        store_rows_cols(dk_acc, b_dk, tok, m_t, HV, i_h, K, c0, BKS)
        w_dot_k += tl.sum(At_dw * b_k, 1)
    b_dbeta += tl.exp(G) * w_dot_k
    dG += beta_gamma * w_dot_k
    dG += load_scalars(dg_acc, tok, m_t, HV, i_h, ACC)
    store_scalars(dg_acc, dG, tok, m_t, HV, i_h)
    store_scalars(dbeta, b_dbeta * dbeta_dinput, tok, m_t, HV, i_h)


def bwd_wy(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    A: torch.Tensor,
    dw: torch.Tensor,
    du: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    beta_scale: float = 1.0,
    k_rstd: torch.Tensor | None,
    dk_acc: torch.Tensor,
    dv_out: torch.Tensor,
    dbeta_out: torch.Tensor,
    dg_acc: torch.Tensor,
) -> None:
    """See ``kernels.torch.bwd_wy``."""
    H_qk, K = k.shape[1], k.shape[2]
    HV, V = v.shape[1], v.shape[2]
    if index.n_chunks == 0:
        return
    channel = g.dim() == 3
    launch(bwd_wy_kernel)[(index.n_chunks, HV)](
        k, v, beta, g, pointer(gate_params, g), A, dw, du, pointer(k_rstd, g), index.chunk_table,
        dk_acc, dv_out, dbeta_out, dg_acc, index.n_chunks, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BKS=min(BKS_WY, head_block(K)), BV=min(BV_WY, value_block(V)),
        HAS_NORM=k_rstd is not None,
        GATE=gate_params is not None,
        BETA_SIGMOID=beta_sigmoid, BETA_SCALE=float(beta_scale), ACC=acc_dtype(k), MM=mm_mode(k),
        CHANNEL=channel, SUB=SUB_ROWS, CMM=channel_mode(matmul_mode(k.dtype)), num_warps=warps(dict(CHANNEL=channel)),
        **({} if channel else register_cap(MAX_REGISTERS)),
    )

"""Backward (Triton): dq, dk, dw and the gate-cumsum gradient of the output and
walk terms; one program per (chunk, value head), looping over value tiles. Same
signature as ``kernels.torch.bwd_dqkwg``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..precision import channel_mode, matmul_mode
from ._common import (BT, acc_dtype, causal_decay, channel_gates, chunk_tokens, dot, head_block, launch, load_gates,
                      load_qk_cols,
                      load_rows_cols, load_state_rows, mm_mode, pointer, register_cap, store_rows_cols,
                      store_scalars)
from .channel import channel_pulls, pair_levels
from .scores import SUB_ROWS


BKS_DQKWG = 16
BV_DQKWG = 16
"""K and V blocks: spill stores / loads per thread on sm_90 (compile_specs
--report, 8 warps) were 4,084 B with whole K and 64-wide V blocks, 3,548 with
32-wide K blocks, 1,520 with 32 / 32; at 32 / 16, 748 / 1,292 under triton 3.9
and 688 / 1,176 under 3.6 (the GPU machine's), which the loop reloads; at
16 / 16, 152 / 216 and 112 / 140, and none under 3.6 once ``Q K^T`` is
reduced before the loop. At 4 warps with the K loop dynamic: 256 B under 3.6
and 204 under 3.9 (16 / 32: 580 B; 32 / 16: 1,092 B, under 3.6)."""
NUM_WARPS = 4
"""Warps per program: at 8 (251 registers, one program per SM) the calibrated
model priced the launch 229 us above 4 warps' two programs per SM at T = 32K,
HV = 32, though 4 warps then spilled 256 B per thread (charged at HBM rate).
As a launch at K = V = 128 compiles it (K and V divisible by 16): 178
registers uncapped, no spill (triton 3.6)."""
MAX_REGISTERS = 168
"""ptxas's registers per thread (``maxnreg``): three 4-warp programs per SM,
no spill under triton 3.6 or 3.9 (sm_90, bf16, K = V = 128); the calibrated
model: 1,311 us a launch at T = 32K, HV = 32, against 1,423 uncapped (178
registers, two per SM)."""
CHANNEL_WARPS = 8
"""Warps per program with a gate per key channel (KDA): 235-237 registers
and no spill uncapped at 8 warps (sm_90, bf16, K = V = 128, triton 3.9),
392 B per thread at 4 and 1,936 B capped at 168. Its sub-chunks' pairs
(``channel.channel_pulls``) are walked by a loop, not unrolled: unrolled,
8 warps spilled 224 B."""


def warps(constexprs) -> int:
    """Warps per program: ``NUM_WARPS``, ``CHANNEL_WARPS`` for a gate per key channel."""
    return CHANNEL_WARPS if constexprs["CHANNEL"] else NUM_WARPS


def max_registers(constexprs) -> int | None:
    """``MAX_REGISTERS``, or no cap (None) for a gate per key channel (one program per SM at 8 warps)."""
    return None if constexprs["CHANNEL"] else MAX_REGISTERS


@triton.jit
def state_terms(h, dh, do, v_new, dv_new, tok, m_t, i_c, HV, i_h, K, V, c0, BKS: tl.constexpr, BV: tl.constexpr,
                ACC: tl.constexpr, MM: tl.constexpr):
    """Key columns ``[c0, c0 + BKS)`` of the chunk's state and end products:
    ``dO S0^T``, ``Vn dS^T``, ``-dVn S0^T`` (``[BT, BKS]``) and ``<dS, S0>``
    summed over the values (``[BKS]``, one per key row)."""
    do_S0 = tl.zeros([tok.shape[0], BKS], dtype=ACC)
    vn_dS = tl.zeros([tok.shape[0], BKS], dtype=ACC)
    b_dw = tl.zeros([tok.shape[0], BKS], dtype=ACC)
    dS_S0 = tl.zeros([BKS], dtype=ACC)
    for col in range(0, V, BV):
        S0 = load_state_rows(h, i_c, HV, i_h, K, V, c0, col, BKS, BV, ACC)
        dS = load_state_rows(dh, i_c, HV, i_h, K, V, c0, col, BKS, BV, ACC)
        do_S0 += dot(load_rows_cols(do, tok, m_t, HV, i_h, V, col, BV, ACC), tl.trans(S0), MM)
        vn_dS += dot(load_rows_cols(v_new, tok, m_t, HV, i_h, V, col, BV, ACC), tl.trans(dS), MM)
        b_dw -= dot(load_rows_cols(dv_new, tok, m_t, HV, i_h, V, col, BV, ACC), tl.trans(S0), MM)
        dS_S0 += tl.sum(dS * S0, 1)
    return do_S0, vn_dS, b_dw, dS_S0


@triton.jit
def channel_dqkwg(q, k, g, gate_params, h, v_new, do, dh, dv_new, q_rstd, k_rstd, dq, dk, dw, dg, do_vn, scale, i_c,
                  start, length, H_qk, i_hk, HV, i_h, K, V, BT: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr,
                  BV: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr, ACC: tl.constexpr,
                  MM: tl.constexpr, SUB: tl.constexpr, CMM: tl.constexpr):
    """:func:`bwd_dqkwg_kernel` for a gate per key channel (KDA;
    ``kernels.torch.bwd_dqkwg.channel_dqkwg``), one slice of ``BKS`` key
    channels at a time: the score terms by ``channel.channel_pulls`` of
    ``dP = scale dO Vn^T`` (causal) by dyadic anchors under ``CMM``,
    the state and end terms decayed per channel, and dg per channel
    ``[T, HV, K]``: ``Q * dQ - K * dK`` of each term, the chunk's last row
    also ``<dK_end, K>`` summed over the rows and ``exp(G_C) <dS, S0>``."""
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    dP = tl.where(o_t[:, None] >= o_t[None, :], scale * do_vn, 0.0)
    ones = tl.full([BT], 1.0, ACC)
    l32, l16, l8, l4, l2, l1, l0 = pair_levels(dP, BT)  # once for every key slice
    for c0 in range(0, BK, BKS):
        b_g = channel_gates(g, gate_params, tok, m_t, HV, i_h, K, c0, BKS, GATE, ACC)
        # exp(sum_{l > i} g_l): the gates one row on, summed backwards (each exponent a sum of exactly its gates)
        b_tail = tl.cumsum(channel_gates(g, gate_params, tok + 1, o_t + 1 < length, HV, i_h, K, c0, BKS, GATE, ACC),
                           0, reverse=True)
        do_S0, vn_dS, b_dw, dS_S0 = state_terms(h, dh, do, v_new, dv_new, tok, m_t, i_c, HV, i_h, K, V, c0, BKS, BV,
                                                ACC, MM)
        dq_state = scale * tl.exp(tl.cumsum(b_g, 0)) * do_S0
        dk_end = tl.exp(b_tail) * vn_dS
        dq_p, dk_p = channel_pulls(l32, l16, l8, l4, l2, l1, l0, q, k, q_rstd, k_rstd, g, gate_params, ones, start,
                                   length, H_qk, i_hk, HV, i_h, K, c0, BT, BKS, HAS_NORM, GATE, ACC, CMM)
        b_q = load_qk_cols(q, q_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)
        store_rows_cols(dq, dq_state + dq_p, tok, m_t, HV, i_h, K, c0, BKS)
        store_rows_cols(dk, dk_p + dk_end, tok, m_t, HV, i_h, K, c0, BKS)
        store_rows_cols(dw, b_dw, tok, m_t, HV, i_h, K, c0, BKS)
        through_end = dk_end * b_k
        dG = (dq_state + dq_p) * b_q - dk_p * b_k - through_end
        d_last = tl.sum(through_end, 0) + tl.exp(tl.sum(b_g, 0)) * dS_S0
        dG += tl.where((o_t == length - 1)[:, None], d_last[None, :], 0.0)
        store_rows_cols(dg, dG, tok, m_t, HV, i_h, K, c0, BKS)


@triton.jit
def bwd_dqkwg_kernel(
    q, k, g, gate_params, h, v_new, do, dh, dv_new, q_rstd, k_rstd, chunk_table, dq, dk, dw, dg, scale,
    n_chunks, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
    GATE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, CHANNEL: tl.constexpr, SUB: tl.constexpr,
    CMM: tl.constexpr,
):
    """One chunk and value head; grid (NC, HV). With ``CHANNEL`` (KDA) g and
    dg hold a gate per key channel ``[T, HV, K]``: :func:`channel_dqkwg`."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    if length == 0:  # a capped context's empty chunk: its state rows were never written
        return
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    do_vn = tl.zeros([BT, BT], dtype=ACC)  # dO Vn^T
    for col in range(0, V, BV):
        b_do = load_rows_cols(do, tok, m_t, HV, i_h, V, col, BV, ACC)
        do_vn += dot(b_do, tl.trans(load_rows_cols(v_new, tok, m_t, HV, i_h, V, col, BV, ACC)), MM)
    if CHANNEL:
        channel_dqkwg(q, k, g, gate_params, h, v_new, do, dh, dv_new, q_rstd, k_rstd, dq, dk, dw, dg, do_vn, scale,
                      i_c, start, length, H_qk, i_hk, HV, i_h, K, V, BT, BK, BKS, BV, HAS_NORM, GATE, ACC, MM, SUB,
                      CMM)
        return
    b_g, G, tail = load_gates(g, gate_params, tok, m_t, HV, i_h, GATE, ACC)
    gamma = tl.exp(G)
    gamma_ratio = tl.exp(tail)  # gamma_C / gamma
    dscores = scale * do_vn * causal_decay(b_g, False)  # dP * D
    # K in blocks of BKS columns: whole [BT, 128] fp32 tiles of q, k, dO S0^T,
    # Vn dS^T and dw spilled 4,084 B per thread on sm_90 (compile_specs --report).
    # dP * P is one fp32 matrix whose row and column sums are the score terms of
    # dG (kernels.torch.bwd_dqkwg: sums taken from dq's and dk's products round
    # each side differently and do not cancel), reduced before the loop below:
    # a [BT, BT] Q K^T live through it spilled 112 / 140 B per thread (sm_90,
    # 8 warps, triton 3.6)
    qk = tl.zeros([BT, BT], dtype=ACC)
    for c0 in range(0, BK, BKS):
        qk += dot(load_qk_cols(q, q_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC),
                  tl.trans(load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)), MM)
    through_scores = dscores * qk  # dP * P
    dG = tl.sum(through_scores, 1) - tl.sum(through_scores, 0)
    through_end = tl.zeros([BT], dtype=ACC)
    dS_S0 = tl.zeros([BV], dtype=ACC)  # <dS, S0>, summed at the end
    for c0 in range(0, BK, BKS):
        b_q = load_qk_cols(q, q_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, c0, BKS, HAS_NORM, ACC)
        do_S0 = tl.zeros([BT, BKS], dtype=ACC)  # dO S0^T
        vn_dS = tl.zeros([BT, BKS], dtype=ACC)  # Vn dS^T
        b_dw = tl.zeros([BT, BKS], dtype=ACC)  # -dVn S0^T
        for col in range(0, V, BV):
            S0 = load_state_rows(h, i_c, HV, i_h, K, V, c0, col, BKS, BV, ACC)
            dS = load_state_rows(dh, i_c, HV, i_h, K, V, c0, col, BKS, BV, ACC)
            b_do = load_rows_cols(do, tok, m_t, HV, i_h, V, col, BV, ACC)
            b_vn = load_rows_cols(v_new, tok, m_t, HV, i_h, V, col, BV, ACC)
            b_dvn = load_rows_cols(dv_new, tok, m_t, HV, i_h, V, col, BV, ACC)
            do_S0 += dot(b_do, tl.trans(S0), MM)
            vn_dS += dot(b_vn, tl.trans(dS), MM)
            b_dw -= dot(b_dvn, tl.trans(S0), MM)
            dS_S0 += tl.sum(dS * S0, 0)
        dq_state = scale * gamma[:, None] * do_S0
        dk_end = gamma_ratio[:, None] * vn_dS
        store_rows_cols(dq, dq_state + dot(dscores, b_k, MM), tok, m_t, HV, i_h, K, c0, BKS)
        store_rows_cols(dk, dot(tl.trans(dscores), b_q, MM) + dk_end, tok, m_t, HV, i_h, K, c0, BKS)
        store_rows_cols(dw, b_dw, tok, m_t, HV, i_h, K, c0, BKS)
        dG += tl.sum(dq_state * b_q, 1)
        through_end += tl.sum(dk_end * b_k, 1)
    dG -= through_end
    d_last = tl.sum(through_end, 0) + tl.exp(tl.sum(b_g, 0)) * tl.sum(dS_S0, 0)
    dG += tl.where(o_t == length - 1, d_last, 0.0)
    store_scalars(dg, dG, tok, m_t, HV, i_h)


def bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    v_new: torch.Tensor,
    do: torch.Tensor,
    dh: torch.Tensor,
    dv_new: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    dw_out: torch.Tensor,
    dg_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.bwd_dqkwg``."""
    H_qk, K = q.shape[1], q.shape[2]
    HV, V = v_new.shape[1], v_new.shape[2]
    if index.n_chunks == 0:
        return
    channel = g.dim() == 3
    launch(bwd_dqkwg_kernel)[(index.n_chunks, HV)](
        q, k, g, pointer(gate_params, g), h, v_new, do, dh, dv_new, pointer(q_rstd, g),
        pointer(k_rstd, g), index.chunk_table, dq_out, dk_out, dw_out, dg_out, scale,
        index.n_chunks, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BKS=BKS_DQKWG, BV=BV_DQKWG, HAS_NORM=q_rstd is not None,
        GATE=gate_params is not None, CHANNEL=channel, SUB=SUB_ROWS, CMM=channel_mode(matmul_mode(k.dtype)),
        ACC=acc_dtype(k), MM=mm_mode(k), num_warps=warps(dict(CHANNEL=channel)),
        **({} if channel else register_cap(MAX_REGISTERS)),
    )

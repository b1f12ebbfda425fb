"""Program #5, output (Triton): ``O = scale [diag(gamma) Q S0 + (Q K^T * D) Vn]``;
one program per (chunk, value head), looping over value tiles. Same signature as
``kernels.torch.output``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..precision import channel_mode, matmul_mode
from ._common import (BT, acc_dtype, causal_segments, chunk_tokens, dot, head_block, launch, load_gates, load_qk_cols,
                      load_rows_cols, load_state_rows, lower_dot, mm_mode, operand, pointer, store_rows_cols)
from .channel import BKS_CHANNEL, channel_decayed_rows, channel_products, pair_matrix
from .scores import SUB_ROWS


NUM_WARPS = 4
"""Warps per program (compile_specs --report)."""
BKS_OUTPUT = 32
"""Key columns per slice of Q and K."""
BV_OUTPUT = 32
"""Value columns per tile of the loop over V. On sm_90 (bf16, K = V = 128,
triton 3.6) at 4 warps: no spill, two programs per SM; the calibrated model
prices a launch at T = 32K, HV = 32 at 651 us against 827 for the former
layout (one program per value tile of 128 with ``Q K^T`` and ``Q S0``
accumulated together: 8 warps, 255 registers, one program per SM; at 4 warps
it spilled 1.3 KB per thread). Tiles of 64 spill 312 B at 4 warps; capped at
168 registers (three per SM) tiles of 32 with slices of 16 spill 40 B for
44 us less."""


@triton.jit
def output_kernel(
    q, k, g, gate_params, h, v_new, o, q_rstd, k_rstd, chunk_table, scale,
    n_chunks, H_qk, HV, K, V,
    BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
    ACC: tl.constexpr, MM: tl.constexpr, CHANNEL: tl.constexpr, SUB: tl.constexpr, CMM: tl.constexpr,
):
    """One chunk and value head; grid (NC, HV). ``Q K^T`` once, summed over
    key slices of ``BKS`` (each slice's operands rounded as the whole tile's
    would be) and kept as the products read it; then per value tile of ``BV``
    ``diag(gamma) Q S0`` over the same key slices (q reloaded per tile) plus
    the scores' product, so only one ``[BT, BV]`` accumulator is live. With
    ``CHANNEL`` (KDA) g holds a gate per key channel ``[T, HV, K]``: the
    scores are ``channel.channel_products`` (dyadic anchors) under
    ``CMM`` (as ``channel_scores_kernel`` stores them) and q decays per channel."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    if length == 0:  # a capped context's empty chunk: its state rows were never written
        return
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    if CHANNEL:
        p32, p16, b_D = channel_products(q, k, q_rstd, k_rstd, g, gate_params, tl.full([BT], 1.0, ACC), start,
                                         length, H_qk, i_hk, HV, i_h, K, BT, SUB, BKS, HAS_NORM, GATE, False, ACC, CMM)
        scores = operand(pair_matrix(p32, p16, b_D), MM)
    else:
        b_g, G, _ = load_gates(g, gate_params, tok, m_t, HV, i_h, GATE, ACC)
        b_qk = tl.zeros([BT, BT], dtype=ACC)
        for k0 in range(0, K, BKS):
            b_q = load_qk_cols(q, q_rstd, tok, m_t, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC)
            b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC)
            b_qk += dot(b_q, tl.trans(b_k), MM)
        segment, keep = causal_segments(b_g, False)
        scores = operand(tl.where(keep, b_qk * tl.exp(segment), 0.0), MM)
        gamma = tl.exp(G)
    for col in range(0, V, BV):
        b_qs = tl.zeros([BT, BV], dtype=ACC)
        for k0 in range(0, K, BKS):
            S0 = load_state_rows(h, i_c, HV, i_h, K, V, k0, col, BKS, BV, ACC)
            if CHANNEL:
                b_qd = channel_decayed_rows(q, q_rstd, g, gate_params, tok, m_t, H_qk, i_hk, HV, i_h, K, k0, BKS,
                                            HAS_NORM, GATE, MM, ACC)
            else:
                b_qd = gamma[:, None] * load_qk_cols(q, q_rstd, tok, m_t, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC)
            b_qs += dot(b_qd, S0, MM)
        b_vn = load_rows_cols(v_new, tok, m_t, HV, i_h, V, col, BV, ACC)
        store_rows_cols(o, scale * (b_qs + lower_dot(scores, b_vn, MM)), tok, m_t, HV, i_h, V, col, BV)


def output(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    v_new: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    o_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.output``."""
    H_qk, K = q.shape[1], q.shape[2]
    HV, V = v_new.shape[1], v_new.shape[2]
    if index.n_chunks == 0:
        return
    BV = min(BV_OUTPUT, head_block(V))
    launch(output_kernel)[(index.n_chunks, HV)](
        q, k, g, pointer(gate_params, g), h, v_new, o_out, pointer(q_rstd, g), pointer(k_rstd, g),
        index.chunk_table, scale, index.n_chunks, H_qk, HV, K, V,
        BT=BT, BKS=min(BKS_CHANNEL if g.dim() == 3 else BKS_OUTPUT, head_block(K)), BV=BV,
        HAS_NORM=q_rstd is not None, GATE=gate_params is not None,
        ACC=acc_dtype(k), MM=mm_mode(k), CHANNEL=g.dim() == 3, SUB=SUB_ROWS, CMM=channel_mode(matmul_mode(k.dtype)),
        num_warps=NUM_WARPS,
    )

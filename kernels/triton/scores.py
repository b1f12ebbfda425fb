"""Forward (Triton): the chunk's decayed causal scores for the walk with the
output; one program per (chunk, key head), which forms ``Q K^T`` once and
stores it decayed by the gates of each of its value heads (GVA). Same
signature as ``kernels.torch.scores``.

KDA (a gate per key channel, g ``[T, HV, K]``): :func:`channel_scores_kernel`,
one program per (chunk, value head), the decay inside the product
(``S_ij = sum_d q_id k_jd exp(Γ_id - Γ_jd)``) taken with sub-chunk anchors
as ``kernels/torch/_channel.py`` takes it (every exponent a sum of exactly
the gates it spans, none positive): the pairs of rows after sub-chunk J with
rows of J are one product of ``q_i exp(Γ_i - Γ_r)`` and ``k_j exp(Γ_r - Γ_j)``
(``r`` the last row of J), the pairs inside a sub-chunk elementwise. Its sub-chunks have
:data:`SUB_ROWS` rows (``tl.dot``'s least tile) where the torch twin's have 8,
so the two agree to the rounding of the products' operands, not bitwise.
Not yet reached from the host path (KDA on CUDA is refused until every
program has a Triton form)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..precision import channel_mode, matmul_mode
from ._common import (BT, acc_dtype, cast_to, channel_gates, chunk_qk, chunk_tokens, decayed_scores, dot, head_block,
                      launch, load_qk_cols, mm_mode, pointer, store_rows_cols)

NUM_WARPS = 4
"""Warps per program. On sm_90 (bf16, K = V = 128, triton 3.6) with key slices
of 16: 168 registers and no spill, three programs per SM; the calibrated
model prices a launch at T = 32K, H_qk = 16, HV = 32 at 105 us (with a
program per value head, each forming its own ``Q K^T``: 182 us, and 193
capped at 128 registers, where it spilled 24 B per thread)."""
BKS_SCORES = 16
"""Key columns per slice of Q and K (as local dv, which forms the same scores)."""
SUB_ROWS = 16
"""Rows of a KDA sub-chunk in the channel kernel: ``tl.dot``'s least M and N."""
BKS_CHANNEL = 32
"""Key columns per slice of the channel kernel: its elementwise ``[16, 16, BKS]``
pairs inside a sub-chunk hold 64 fp32 values a thread at 4 warps."""


@triton.jit
def scores_kernel(
    q, k, g, gate_params, q_rstd, k_rstd, scores, chunk_table,
    n_chunks, H_qk, HV, K,
    BT: tl.constexpr, BKS: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
    ACC: tl.constexpr, MM: tl.constexpr,
):
    """One chunk of one key head and its value heads; grid (NC, H_qk)."""
    i_c, i_hk = tl.program_id(0), tl.program_id(1)
    group = HV // H_qk  # the value heads of a key head
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    b_qk = chunk_qk(q, k, q_rstd, k_rstd, tok, m_t, H_qk, i_hk, K, BT, BKS, HAS_NORM, ACC, MM)
    for i_g in range(0, group):
        i_h = i_hk * group + i_g
        b_p = decayed_scores(b_qk, g, gate_params, tok, m_t, HV, i_h, GATE, ACC)
        store_rows_cols(scores, b_p, tok, m_t, HV, i_h, BT, 0, BT)


@triton.jit
def channel_scores_kernel(
    q, k, g, gate_params, q_rstd, k_rstd, scores, chunk_table,
    n_chunks, H_qk, HV, K,
    BT: tl.constexpr, SUB: tl.constexpr, BKS: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
    ACC: tl.constexpr, MM: tl.constexpr,
):
    """One chunk of one value head with a gate per key channel; grid (NC, HV).
    The pairs across sub-chunks are one ``[BT, BT]`` accumulator of products
    at M = N = BT (warpgroup MMAs), one per anchor: rows of the later
    sub-chunks decayed to the anchor (the last row of sub-chunk J) against
    the rows of J decayed from it. The pairs inside a sub-chunk are taken
    elementwise and stored over the accumulator's zero blocks."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    tok_n, _, m_n = chunk_tokens(start + 1, length - 1, BT)  # each row's next row
    m_n = m_n & ((o_t + 1) % SUB != 0)  # ... inside its sub-chunk
    block = o_t // SUB
    b_s = tl.zeros([BT, BT], dtype=ACC)
    for k0 in range(0, K, BKS):
        b_g = channel_gates(g, gate_params, tok, m_t, HV, i_h, K, k0, BKS, GATE, ACC)
        # sum_{j < l <= r_J} g_l: the next rows' gates summed backwards within each sub-chunk
        b_gn = tl.reshape(channel_gates(g, gate_params, tok_n, m_n, HV, i_h, K, k0, BKS, GATE, ACC),
                          [BT // SUB, SUB, BKS])
        b_behind = tl.reshape(tl.cumsum(b_gn, 1, reverse=True), [BT, BKS])
        b_q = load_qk_cols(q, q_rstd, tok, m_t, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC)
        b_kb = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC) * tl.exp(b_behind)
        for J in tl.static_range(BT // SUB - 1):
            # sum_{r_J < l <= i} g_l for the rows after J's anchor r_J (a sum of exactly those gates)
            b_ahead = tl.cumsum(tl.where(o_t[:, None] > J * SUB + SUB - 1, b_g, 0.0), 0)
            b_a = tl.where((block > J)[:, None], b_q * tl.exp(b_ahead), 0.0)
            b_b = tl.where((block == J)[:, None], b_kb, 0.0)
            b_s += dot(b_a, tl.trans(b_b), MM)
    # every block but the diagonal ones (zero above them)
    p_s = scores + (tok[:, None] * HV + i_h) * BT + o_t[None, :]
    tl.store(p_s, cast_to(b_s, scores), mask=m_t[:, None] & (block[:, None] != block[None, :]))
    o_s = tl.arange(0, SUB)
    below = o_s[:, None] > o_s[None, :]
    for I in tl.static_range(BT // SUB):
        tok_i, _, m_i = chunk_tokens(start + I * SUB, length - I * SUB, SUB)
        b_d = tl.zeros([SUB, SUB], dtype=ACC)
        for k0 in range(0, K, BKS):
            b_gi = channel_gates(g, gate_params, tok_i, m_i, HV, i_h, K, k0, BKS, GATE, ACC)
            # segment[a, b] = sum_{b < l <= a} g_l: column b sums the gates of the rows below it
            segment = tl.cumsum(tl.where(below[:, :, None], b_gi[:, None, :], 0.0), 0)
            decay = tl.where((o_s[:, None] >= o_s[None, :])[:, :, None], tl.exp(segment), 0.0)
            b_qi = load_qk_cols(q, q_rstd, tok_i, m_i, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC)
            b_ki = load_qk_cols(k, k_rstd, tok_i, m_i, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC)
            b_d += tl.sum(b_qi[:, None, :] * b_ki[None, :, :] * decay, 2)
        store_rows_cols(scores, b_d, tok_i, m_i, HV, i_h, BT, I * SUB, SUB)


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    scores_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.scores``."""
    H_qk, K = q.shape[1], q.shape[2]
    HV = scores_out.shape[1]
    if index.n_chunks == 0:
        return
    if g.dim() == 3:  # KDA: a gate per key channel
        launch(channel_scores_kernel)[(index.n_chunks, HV)](
            q, k, g, pointer(gate_params, g), pointer(q_rstd, g), pointer(k_rstd, g), scores_out, index.chunk_table,
            index.n_chunks, H_qk, HV, K,
            BT=BT, SUB=SUB_ROWS, BKS=min(BKS_CHANNEL, head_block(K)), HAS_NORM=q_rstd is not None,
            GATE=gate_params is not None, ACC=acc_dtype(k), MM=channel_mode(matmul_mode(k.dtype)),
            num_warps=NUM_WARPS,
        )
        return
    launch(scores_kernel)[(index.n_chunks, H_qk)](
        q, k, g, pointer(gate_params, g), pointer(q_rstd, g), pointer(k_rstd, g), scores_out, index.chunk_table,
        index.n_chunks, H_qk, HV, K,
        BT=BT, BKS=min(BKS_SCORES, head_block(K)), HAS_NORM=q_rstd is not None, GATE=gate_params is not None,
        ACC=acc_dtype(k), MM=mm_mode(k), num_warps=NUM_WARPS,
    )

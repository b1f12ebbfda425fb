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
(``r`` the last row of J), the pairs inside a sub-chunk elementwise
(``channel.channel_products``, which the WY inverse shares). Its sub-chunks
have :data:`SUB_ROWS` rows (``tl.dot``'s least tile) where the torch twin's
have 8, so the two agree to the rounding of the products' operands, not bitwise.
Not yet reached from the host path (KDA on CUDA is refused until every
program has a Triton form)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..precision import channel_mode, matmul_mode
from ._common import (BT, acc_dtype, cast_to, chunk_qk, chunk_tokens, decayed_scores, head_block, launch, mm_mode,
                      pointer, store_rows_cols)
from .channel import BKS_CHANNEL, channel_products, diagonal_block_pointers

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
    The pairs across sub-chunks and inside them from :func:`channel_products`,
    stored each over the other's zeros."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    b_s, b_D = channel_products(q, k, q_rstd, k_rstd, g, gate_params, tl.full([BT], 1.0, ACC), start, length,
                                H_qk, i_hk, HV, i_h, K, BT, SUB, BKS, HAS_NORM, GATE, False, ACC, MM)
    block = o_t // SUB
    p_s = scores + (tok[:, None] * HV + i_h) * BT + o_t[None, :]
    tl.store(p_s, cast_to(b_s, scores), mask=m_t[:, None] & (block[:, None] != block[None, :]))
    p_d, m_d = diagonal_block_pointers(scores, start, length, HV, i_h, BT, SUB)
    tl.store(p_d, cast_to(b_D, scores), mask=m_d)


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

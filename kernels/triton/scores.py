"""Forward (Triton): the chunk's decayed causal scores for the walk with the
output; one program per (chunk, key head), which forms ``Q K^T`` once and
stores it decayed by the gates of each of its value heads (GVA). Same
signature as ``kernels.torch.scores``.

KDA (a gate per key channel, g ``[T, HV, K]``): :func:`channel_scores_kernel`,
one program per (chunk, value head), the decay inside the product
(``S_ij = sum_d q_id k_jd exp(Γ_id - Γ_jd)``) taken by dyadic anchors
(``channel.channel_products``, which the WY inverse, the output and the
local dv share: every factor a running product of ``exp(g)`` over exactly the
rows it spans, at most 1). The torch twin anchors at its 16-row sub-chunks'
ends, so the two agree to the rounding of the products' operands, not
bitwise."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..precision import channel_mode, matmul_mode
from ._common import (BT, acc_dtype, chunk_qk, chunk_tokens, decayed_scores, head_block, launch, mm_mode,
                      pointer, store_rows_cols)
from .channel import BKS_CHANNEL, channel_products, pair_matrix

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
    The pairs of :func:`channel_products`, stored as one tile."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    p32, p16, b_D = channel_products(q, k, q_rstd, k_rstd, g, gate_params, tl.full([BT], 1.0, ACC), start, length,
                                     H_qk, i_hk, HV, i_h, K, BT, SUB, BKS, HAS_NORM, GATE, False, ACC, MM)
    store_rows_cols(scores, pair_matrix(p32, p16, b_D), tok, m_t, HV, i_h, BT, 0, BT)


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

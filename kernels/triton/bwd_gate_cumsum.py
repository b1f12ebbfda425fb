"""Backward of the in-chunk gate cumsum (Triton): ``dg_i = sum_{j >= i} dG_j``;
one program per (chunk, value head), over every key channel of a KDA gate
(``[T, HV, K]``: :func:`bwd_gate_cumsum_channel_kernel`). Same signature as
``kernels.torch.bwd_gate_cumsum``."""

from __future__ import annotations

import torch
import triton.language as tl
import triton

from ..chunk_index import ChunkIndex
from ._common import BT, acc_dtype, cast_to, chunk_tokens, head_block, launch, load_scalars, store_scalars

BK_CHANNEL = 64
"""Key channels per tile of the KDA variant (a [64, 64] fp32 tile: 32 values a thread at 4 warps)."""


@triton.jit
def bwd_gate_cumsum_kernel(dgcum, dg, chunk_table, n_chunks, HV, BT: tl.constexpr, ACC: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    dG = load_scalars(dgcum, tok, m_t, HV, i_h, ACC)
    store_scalars(dg, tl.cumsum(dG, 0, reverse=True), tok, m_t, HV, i_h)


@triton.jit
def bwd_gate_cumsum_channel_kernel(dgcum, dg, chunk_table, n_chunks, HV, K, BT: tl.constexpr, BK: tl.constexpr,
                                   ACC: tl.constexpr):
    """A gate per key channel (``[T, HV, K]``): each channel's suffix sums, a tile of BK channels at a time."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    for k0 in range(0, K, BK):
        o_d = k0 + tl.arange(0, BK)
        offset = (tok[:, None] * HV + i_h) * K + o_d[None, :]
        m = m_t[:, None] & (o_d[None, :] < K)
        dG = tl.load(dgcum + offset, mask=m, other=0.0).to(ACC)
        tl.store(dg + offset, cast_to(tl.cumsum(dG, 0, reverse=True), dg), mask=m)


def bwd_gate_cumsum(dgcum: torch.Tensor, index: ChunkIndex, *, dg_out: torch.Tensor) -> None:
    """See ``kernels.torch.bwd_gate_cumsum``."""
    if index.n_chunks == 0:
        return
    if dgcum.dim() == 3:
        K = dgcum.shape[2]
        launch(bwd_gate_cumsum_channel_kernel)[(index.n_chunks, dgcum.shape[1])](
            dgcum, dg_out, index.chunk_table, index.n_chunks, dgcum.shape[1], K, BT=BT,
            BK=min(BK_CHANNEL, head_block(K)), ACC=acc_dtype(dgcum))
        return
    launch(bwd_gate_cumsum_kernel)[(index.n_chunks, dgcum.shape[1])](
        dgcum, dg_out, index.chunk_table, index.n_chunks, dgcum.shape[1], BT=BT, ACC=acc_dtype(dgcum)
    )

"""Backward of the in-chunk gate cumsum (Triton): ``dg_i = sum_{j >= i} dG_j``;
one program per (chunk, value head). Same signature as ``kernels.torch.bwd_gate_cumsum``."""

from __future__ import annotations

import torch
import triton.language as tl
import triton

from ..chunk_index import ChunkIndex
from ._common import BT, acc_dtype, chunk_tokens, launch, load_scalars, store_scalars


@triton.jit
def bwd_gate_cumsum_kernel(dgcum, dg, chunk_table, n_chunks, HV, BT: tl.constexpr, ACC: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    dG = load_scalars(dgcum, tok, m_t, HV, i_h, ACC)
    store_scalars(dg, tl.cumsum(dG, 0, reverse=True), tok, m_t, HV, i_h)


def bwd_gate_cumsum(dgcum: torch.Tensor, index: ChunkIndex, *, dg_out: torch.Tensor) -> None:
    """See ``kernels.torch.bwd_gate_cumsum``."""
    if index.n_chunks == 0:
        return
    launch(bwd_gate_cumsum_kernel)[(index.n_chunks, dgcum.shape[1])](
        dgcum, dg_out, index.chunk_table, index.n_chunks, dgcum.shape[1], BT=BT, ACC=acc_dtype(dgcum)
    )

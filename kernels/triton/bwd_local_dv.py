"""Backward (Triton): the local dv_new, ``scale (Q K^T * D)^T dO``; one program
per (chunk, value head) that walks the value tiles, so q, k and the scores are
loaded and computed once per chunk (with a program per value tile they were
once per tile: 1.63 against 1.08 GB moved at the roofline's shape). Same
signature as ``kernels.torch.bwd_local_dv``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (BT, acc_dtype, chunk_scores, dot, head_block, load_rows_cols, mm_mode, pointer,
                      store_rows_cols, value_block)


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report)."""


@triton.jit
def bwd_local_dv_kernel(
    q, k, g, gate_params, do, dv, q_rstd, k_rstd, chunk_table, scale,
    n_chunks, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
    ACC: tl.constexpr, MM: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    tok, m_t, _, _, scores = chunk_scores(q, k, g, gate_params, q_rstd, k_rstd, chunk_table, n_chunks, i_c, H_qk, i_hk,
                                          HV, i_h, K, BT, BK, HAS_NORM, GATE, ACC, MM)
    b_scores_t = tl.trans(scores)
    for col in range(0, V, BV):
        b_do = load_rows_cols(do, tok, m_t, HV, i_h, V, col, BV, ACC)
        store_rows_cols(dv, scale * dot(b_scores_t, b_do, MM), tok, m_t, HV, i_h, V, col, BV)


def bwd_local_dv(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    do: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    dv_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.bwd_local_dv``."""
    H_qk, K = q.shape[1], q.shape[2]
    HV, V = do.shape[1], do.shape[2]
    if index.n_chunks == 0:
        return
    BV = value_block(V)
    bwd_local_dv_kernel[(index.n_chunks, HV)](
        q, k, g, pointer(gate_params, g), do, dv_out, pointer(q_rstd, g), pointer(k_rstd, g),
        index.chunk_table, scale, index.n_chunks, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=BV, HAS_NORM=q_rstd is not None, GATE=gate_params is not None,
        ACC=acc_dtype(k), MM=mm_mode(k), num_warps=NUM_WARPS,
    )

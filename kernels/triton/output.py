"""Program #5, output (Triton): ``O = scale [diag(gamma) Q S0 + (Q K^T * D) Vn]``;
one program per (chunk, value head, value tile). Same signature as
``kernels.torch.output``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (BT, acc_dtype, chunk_scores, dot, head_block, load_rows_cols, load_state, lower_dot, mm_mode,
                      pointer, store_rows_cols, value_block)


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report)."""


@triton.jit
def output_kernel(
    q, k, g, gate_params, h, v_new, o, q_rstd, k_rstd, chunk_table, scale,
    n_chunks, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
    ACC: tl.constexpr, MM: tl.constexpr,
):
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H_qk)
    col = i_v * BV
    tok, m_t, G, b_q, scores = chunk_scores(q, k, g, gate_params, q_rstd, k_rstd, chunk_table, n_chunks, i_c,
                                            H_qk, i_hk, HV, i_h, K, BT, BK, HAS_NORM, GATE, ACC, MM)
    S0 = load_state(h, i_c, HV, i_h, K, V, col, BK, BV, ACC)
    b_vn = load_rows_cols(v_new, tok, m_t, HV, i_h, V, col, BV, ACC)
    b_o = scale * (dot(tl.exp(G)[:, None] * b_q, S0, MM) + lower_dot(scores, b_vn, MM))
    store_rows_cols(o, b_o, tok, m_t, HV, i_h, V, col, BV)


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
    BV = value_block(V)
    output_kernel[(index.n_chunks, HV, triton.cdiv(V, BV))](
        q, k, g, pointer(gate_params, g), h, v_new, o_out, pointer(q_rstd, g), pointer(k_rstd, g),
        index.chunk_table, scale, index.n_chunks, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=BV, HAS_NORM=q_rstd is not None, GATE=gate_params is not None,
        ACC=acc_dtype(k), MM=mm_mode(k), num_warps=NUM_WARPS,
    )

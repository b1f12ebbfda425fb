"""Segments, phase 1 (forward, Triton): every summary row folded into ``[S | M]``
from ``[0 | I]``; one program per (summary row, value head, column tile of the
``V + K`` wide plane). Same signature as ``kernels.torch.segment_summary``.

Each column of the augmented state walks on its own (``S_C = T_c S0 + B_c``
column by column), so a tile may hold S and M columns: ``u = [U | 0]`` drives
the S columns, the M columns start at the identity.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (BT, WALK_STAGES, acc_dtype, chunk_tokens, frag_info, head_block, launch, mm_mode, pointer,
                      store_state_halves, walk_block)
from .channel import decayed_state_chunk, gated_state_chunk


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report
and ``_common.walk_block``: 112 B of spills under triton 3.6 at 32 columns, 8
warps and 2 stages, against 1,316 B at 64 columns and 4 warps)."""
NUM_STAGES = WALK_STAGES


@triton.jit
def segment_summary_kernel(
    k, w, u, g, gate_params, k_rstd, chunk_table, frag_table, summary, k_decayed, chunk_decay,
    n_chunks, n_frag, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, HAS_U: tl.constexpr,
    GATE: tl.constexpr, CHANNEL: tl.constexpr, DECAYED: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
):
    """Grid (n_sum, HV, (V + K) / BV): columns ``[col, col + BV)`` of summary row
    i_r's ``[S | M]``. Without ``HAS_U`` (M alone) the S columns stay 0 and their
    tiles skip the walk; an empty row (a sentinel) writes ``[0 | I]``. With
    ``CHANNEL`` (KDA) g holds a gate per key channel ``[T, HV, K]`` (with
    ``DECAYED``, the decays ``channel_decays`` stored are read instead)."""
    i_r, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H_qk)
    col = i_v * BV
    first, count, _initial_row, _flags = frag_info(frag_table, n_frag, i_r)
    BH: tl.constexpr = BK // 2 if BK > 16 else BK  # the state's halves (_common.state_chunk)
    o_k = tl.arange(0, BH)
    o_c = col + tl.arange(0, BV)
    X1 = tl.where(o_k[:, None] == o_c[None, :] - V, 1.0, 0.0).to(ACC)
    X2 = tl.where(BH + o_k[:, None] == o_c[None, :] - V, 1.0, 0.0).to(ACC)
    if not HAS_U:
        count = tl.where(col + BV <= V, 0, count)
    for j in range(0, count):
        c = first + j
        start, length = tl.load(chunk_table + c), tl.load(chunk_table + n_chunks + c)
        tok, o_t, m_t = chunk_tokens(start, length, BT)
        # HAS_U: columns past V read nothing (u = [U | 0])
        if CHANNEL and DECAYED:
            X1, X2 = decayed_state_chunk(w, u, u, k_decayed, chunk_decay, c, X1, X2, tok, m_t, HV, i_h, K, V, col, BH,
                                         BV, HAS_U, False, MM, ACC)
        else:
            X1, X2 = gated_state_chunk(k, k_rstd, w, u, u, g, gate_params, X1, X2, tok, m_t, length, H_qk, i_hk, HV,
                                       i_h, K, V, col, BT, BH, BV, HAS_NORM, HAS_U, False, GATE, CHANNEL, MM, ACC)
    store_state_halves(summary, X1, X2, i_r, HV, i_h, K, V + K, col, BH, BV)


def segment_summary(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor | None,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    k_rstd: torch.Tensor | None,
    summary_out: torch.Tensor,
    k_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.segment_summary`` (``summary_out`` contiguous ``[n_sum, HV, K, V + K]``)."""
    if index.n_frag == 0:
        return
    H_qk, K = k.shape[1], k.shape[2]
    HV = w.shape[1]
    V = summary_out.shape[-1] - K
    BV = walk_block(V + K)
    launch(segment_summary_kernel)[(index.n_frag, HV, triton.cdiv(V + K, BV))](
        k, w, pointer(u, w), g, pointer(gate_params, g), pointer(k_rstd, g), index.chunk_table, index.frag_table,
        summary_out, pointer(k_decayed, g), pointer(chunk_decay, g), index.n_chunks, index.n_frag, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=BV, HAS_NORM=k_rstd is not None, HAS_U=u is not None,
        GATE=gate_params is not None, CHANNEL=g.dim() == 3, DECAYED=k_decayed is not None,
        ACC=acc_dtype(summary_out), MM=mm_mode(k), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )

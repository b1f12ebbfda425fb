"""Segments, phase 1 (backward, Triton): every summary row's ``nu``, its start
adjoint walked back from a zero end adjoint; one program per (summary row,
value head, value tile). Same signature as ``kernels.torch.adjoint_segment_summary``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import BT, acc_dtype, chunk_tokens, frag_info, head_block, launch, mm_mode, pointer, store_state_halves
from .adjoint_summary import adjoint_value_block, stages
from .adjoint_walk import gated_adjoint_chunk


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report)."""
NUM_STAGES = 3
"""Pipeline stages (Triton's default); with a gate per key channel the
adjoint summary's rule (``adjoint_summary.stages``), as its value tiles."""


@triton.jit
def adjoint_segment_summary_kernel(
    q, k, w, g, gate_params, do, dv_local, q_rstd, k_rstd, chunk_table, frag_table, nu, k_decayed, q_decayed,
    chunk_decay, scale,
    n_chunks, n_frag, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
    CHANNEL: tl.constexpr, DECAYED: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
):
    """Grid (n_sum, HV, V / BV); an empty row (a sentinel) writes 0. With
    ``CHANNEL`` (KDA) g holds a gate per key channel ``[T, HV, K]`` (with
    ``DECAYED``, the decays ``channel_decays`` stored are read instead)."""
    i_r, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H_qk)
    col = i_v * BV
    first, count, _initial_row, _flags = frag_info(frag_table, n_frag, i_r)
    BH: tl.constexpr = BK // 2 if BK > 16 else BK  # the state's halves (_common.state_chunk)
    dS1 = tl.zeros([BH, BV], dtype=ACC)
    dS2 = tl.zeros([BH, BV], dtype=ACC)
    for jj in range(0, count):
        c = first + count - 1 - jj
        start, length = tl.load(chunk_table + c), tl.load(chunk_table + n_chunks + c)
        tok, o_t, m_t = chunk_tokens(start, length, BT)
        _, dS1, dS2 = gated_adjoint_chunk(q, k, w, g, gate_params, q_rstd, k_rstd, do, dv_local, k_decayed, q_decayed,
                                          chunk_decay, c, dS1, dS2, tok, m_t, length, scale, H_qk, i_hk, HV, i_h, K, V,
                                          col, BT, BH, BV, HAS_NORM, GATE, CHANNEL, DECAYED, ACC, MM)
    store_state_halves(nu, dS1, dS2, i_r, HV, i_h, K, V, col, BH, BV)


def adjoint_segment_summary(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    do: torch.Tensor,
    dv_local: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    nu_out: torch.Tensor,
    k_decayed: torch.Tensor | None = None,
    q_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.adjoint_segment_summary``."""
    if index.n_frag == 0:
        return
    H_qk, K = q.shape[1], q.shape[2]
    HV, V = do.shape[1], do.shape[2]
    channel = g.dim() == 3
    BV = adjoint_value_block(K, V, channel)
    launch(adjoint_segment_summary_kernel)[(index.n_frag, HV, triton.cdiv(V, BV))](
        q, k, w, g, pointer(gate_params, g), do, dv_local, pointer(q_rstd, g), pointer(k_rstd, g),
        index.chunk_table, index.frag_table, nu_out, pointer(k_decayed, g), pointer(q_decayed, g),
        pointer(chunk_decay, g), scale, index.n_chunks, index.n_frag, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=BV, HAS_NORM=q_rstd is not None, GATE=gate_params is not None, CHANNEL=channel,
        DECAYED=k_decayed is not None, ACC=acc_dtype(nu_out), MM=mm_mode(k), num_warps=NUM_WARPS,
        num_stages=stages(dict(CHANNEL=channel, BK=head_block(K), DECAYED=k_decayed is not None)),
    )

"""KCP adjoint summary (Triton): ``nu``, the start adjoint of the crossing-in
fragment (fragment 0) walked back from a zero end adjoint; one program per
(value head, value tile). Same signature as ``kernels.torch.adjoint_summary``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from . import adjoint_walk
from ._common import (BT, acc_dtype, chunk_tokens, frag_info, head_block, launch, load_state_halves, mm_mode, pointer,
                      store_state_halves, value_block, walk_block)
from .adjoint_walk import gated_adjoint_chunk


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report)."""
NUM_STAGES = 3
"""Pipeline stages (Triton's default)."""


def stages(constexprs) -> int:
    """Pipeline stages of the program of ``constexprs``: ``NUM_STAGES``, or
    with a gate per key channel the adjoint walk's (``adjoint_walk.stages``:
    one at key tiles past 128 unless on ``channel_decays``' decays), whose
    chunk step it runs."""
    return adjoint_walk.stages(constexprs) if constexprs["CHANNEL"] else NUM_STAGES


def adjoint_value_block(K: int, V: int, channel: bool) -> int:
    """Value tiles of the adjoint summaries: ``value_block``, or with a gate
    per key channel and key tiles up to 128 the adjoint walk's
    (``walk_block``). At K = V = 128, 64 columns and three stages they
    spilled 84 B per thread (44 before the gate parameters' loads were
    volatile), at 32 and two none, 208 registers; at 256 (one stage) 32
    columns spill 592 B and 64 412 (sm_90, bf16, triton 3.9)."""
    return walk_block(V) if channel and head_block(K) <= 128 else value_block(V)


@triton.jit
def adjoint_summary_kernel(
    q, k, w, g, gate_params, do, dv_local, q_rstd, k_rstd, chunk_table, frag_table, d_final, nu, k_decayed,
    q_decayed, chunk_decay, scale, n_chunks, n_frag, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, HAS_FINAL: tl.constexpr,
    GATE: tl.constexpr, CHANNEL: tl.constexpr, DECAYED: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
):
    """One value head and value tile; grid (HV, V / BV). With ``CHANNEL``
    (KDA) g holds a gate per key channel ``[T, HV, K]`` (with ``DECAYED``,
    the decays ``channel_decays`` stored are read instead of formed in each
    of a head's ``V / BV`` programs)."""
    i_h, i_v = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    col = i_v * BV
    first, count, _initial_row, flags = frag_info(frag_table, n_frag, 0)
    crosses_in = (flags & 5) == 1  # not on a capped index whose fragment 0 starts here: nu = 0
    count = tl.where(crosses_in, count, 0)
    BH: tl.constexpr = BK // 2 if BK > 16 else BK  # the state's halves (_common.state_chunk)
    dS1 = tl.zeros([BH, BV], dtype=ACC)
    dS2 = tl.zeros([BH, BV], dtype=ACC)
    if HAS_FINAL:
        if crosses_in & ((flags & 2) == 0):  # the document ends here: its final-state gradient is row 0
            dS1, dS2 = load_state_halves(d_final, 0, HV, i_h, K, V, col, BH, BV, ACC)
    for jj in range(0, count):
        c = first + count - 1 - jj
        start, length = tl.load(chunk_table + c), tl.load(chunk_table + n_chunks + c)
        tok, o_t, m_t = chunk_tokens(start, length, BT)
        _, dS1, dS2 = gated_adjoint_chunk(q, k, w, g, gate_params, q_rstd, k_rstd, do, dv_local, k_decayed, q_decayed,
                                          chunk_decay, c, dS1, dS2, tok, m_t, length, scale, H_qk, i_hk, HV, i_h, K, V,
                                          col, BT, BH, BV, HAS_NORM, GATE, CHANNEL, DECAYED, ACC, MM)
    store_state_halves(nu, dS1, dS2, 0, HV, i_h, K, V, col, BH, BV)


def adjoint_summary(
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
    d_final_state: torch.Tensor | None,
    nu_out: torch.Tensor,
    k_decayed: torch.Tensor | None = None,
    q_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.adjoint_summary``."""
    has_final = d_final_state is not None and d_final_state.shape[0] > 0
    H_qk, K = q.shape[1], q.shape[2]
    HV, V = do.shape[1], do.shape[2]
    channel = g.dim() == 3
    BV = adjoint_value_block(K, V, channel)
    launch(adjoint_summary_kernel)[(HV, triton.cdiv(V, BV))](
        q, k, w, g, pointer(gate_params, g), do, dv_local, pointer(q_rstd, g), pointer(k_rstd, g),
        index.chunk_table, index.frag_table, d_final_state if has_final else g, nu_out, pointer(k_decayed, g),
        pointer(q_decayed, g), pointer(chunk_decay, g), scale, index.n_chunks, index.n_frag, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=BV, HAS_NORM=q_rstd is not None, HAS_FINAL=has_final,
        GATE=gate_params is not None, CHANNEL=channel, DECAYED=k_decayed is not None, ACC=acc_dtype(nu_out),
        MM=mm_mode(k), num_warps=NUM_WARPS,
        num_stages=stages(dict(CHANNEL=channel, BK=head_block(K), DECAYED=k_decayed is not None)),
    )

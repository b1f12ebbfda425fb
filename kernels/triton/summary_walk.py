"""KCP summary walk (Triton): the crossing-out (last) fragment folded from a zero
state into ``S_loc``, and from the identity into ``M`` on a middle rank. Same
signature as ``kernels.torch.summary_walk``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (BT, WALK_STAGES, acc_dtype, chunk_tokens, frag_info, head_block, last_real_fragment, launch,
                      load_state_halves, mm_mode, pointer, store_state_strided, walk_block)
from .channel import decayed_state_chunk, gated_state_chunk

BF = tl.constexpr(64)
"""Fragment flags read per step of the search for the last real fragment."""


NUM_WARPS = 8
"""Warps per program: with the state in halves (``_common.state_chunk``) and value
tiles of 32 (``_common.walk_block``) it spills nothing on sm_90 at 8 warps and 2
stages (bf16, K = V = 128, triton 3.6), against 64 to 600 B per thread at 4 warps."""
NUM_STAGES = WALK_STAGES


@triton.jit
def summary_walk_kernel(
    k, w, u, g, gate_params, k_rstd, chunk_table, frag_table, initial_state, out, k_decayed, chunk_decay, stride_h,
    stride_k, out_col, n_chunks, n_frag, H_qk, HV, K, V, WIDTH,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, IS_M: tl.constexpr,
    HAS_INITIAL: tl.constexpr, GATE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, CHANNEL: tl.constexpr,
    DECAYED: tl.constexpr,
):
    """Grid (HV, WIDTH / BV); WIDTH = V for S_loc (u drives it; the walk starts
    at the fragment's initial state when it starts its document and has one),
    K for M (u = 0, the walk starts at the identity), stored from column
    ``out_col`` of ``out``. Without a crossing-out
    fragment (a capped index) both stay 0, and so does M when the fragment
    starts its document here: the identity of the composition. With
    ``CHANNEL`` (KDA) g holds a gate per key channel ``[T, HV, K]`` and the
    state's rows decay each by its channel (``channel.gated_state_chunk``;
    with ``DECAYED`` on the decays ``channel_decays`` stored, as the walks:
    each of the ``(V + K) / BV`` programs of a head formed them before)."""
    i_h, i_v = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    col = i_v * BV
    first, count, initial_row, flags = frag_info(frag_table, n_frag, last_real_fragment(frag_table, n_frag, BF))
    crosses_out = (flags & 6) == 2
    count = tl.where(crosses_out, count, 0)
    BH: tl.constexpr = BK // 2 if BK > 16 else BK  # the state's halves (_common.state_chunk)
    o_k = tl.arange(0, BH)
    o_c = col + tl.arange(0, BV)
    if IS_M:
        middle = crosses_out & ((flags & 1) != 0)
        S1 = tl.where((o_k[:, None] == o_c[None, :]) & middle, 1.0, 0.0).to(ACC)
        S2 = tl.where((BH + o_k[:, None] == o_c[None, :]) & middle, 1.0, 0.0).to(ACC)
    else:
        S1 = tl.zeros([BH, BV], dtype=ACC)
        S2 = tl.zeros([BH, BV], dtype=ACC)
        if HAS_INITIAL:
            if crosses_out & ((flags & 1) == 0):
                S1, S2 = load_state_halves(initial_state, initial_row, HV, i_h, K, V, col, BH, BV, ACC)
    for j in range(0, count):
        c = first + j
        start, length = tl.load(chunk_table + c), tl.load(chunk_table + n_chunks + c)
        tok, o_t, m_t = chunk_tokens(start, length, BT)
        if CHANNEL and DECAYED:
            S1, S2 = decayed_state_chunk(w, u, u, k_decayed, chunk_decay, c, S1, S2, tok, m_t, HV, i_h, K, V, col, BH,
                                         BV, not IS_M, False, MM, ACC)
        else:
            S1, S2 = gated_state_chunk(k, k_rstd, w, u, u, g, gate_params, S1, S2, tok, m_t, length, H_qk, i_hk, HV,
                                       i_h, K, V, col, BT, BH, BV, HAS_NORM, not IS_M, False, GATE, CHANNEL, MM, ACC)
    store_state_strided(out + out_col, S1, i_h, stride_h, stride_k, K, WIDTH, 0, col, BH, BV)
    store_state_strided(out + out_col, S2, i_h, stride_h, stride_k, K, WIDTH, BH, col, BH, BV)


def summary_walk(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    k_rstd: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    summary_out: torch.Tensor,
    k_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.summary_walk``: S_loc and M are two launches into
    columns of the one ``summary_out`` (no views of it: traced, a launch that
    writes a view of a buffer costs a copy of the buffer)."""
    has_initial = initial_state is not None and initial_state.shape[0] > 0
    H_qk, K = k.shape[1], k.shape[2]
    HV, V = u.shape[1], u.shape[2]
    for out_col, width, is_m in ((0, V, False), (V, K, True))[: 1 + (summary_out.shape[-1] > V)]:
        BV = walk_block(width)
        launch(summary_walk_kernel)[(HV, triton.cdiv(width, BV))](
            k, w, u, g, pointer(gate_params, g), pointer(k_rstd, g), index.chunk_table, index.frag_table,
            initial_state if has_initial else g, summary_out, pointer(k_decayed, g), pointer(chunk_decay, g),
            summary_out.stride(1), summary_out.stride(2), out_col, index.n_chunks, index.n_frag, H_qk, HV, K, V, width,
            BT=BT, BK=head_block(K), BV=BV, HAS_NORM=k_rstd is not None, IS_M=is_m,
            HAS_INITIAL=has_initial, GATE=gate_params is not None, ACC=acc_dtype(summary_out), MM=mm_mode(k),
            CHANNEL=g.dim() == 3, DECAYED=k_decayed is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )

"""Program #2, tape walk (Triton): every fragment from its start state, chunk by
chunk; one program per (fragment, value head, value tile). Same signature as
``kernels.torch.tape_walk``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (BT, WALK_STAGES, acc_dtype, boundary_halves, chunk_tokens, frag_info, head_block, launch,
                      mm_mode, pointer, store_state_halves, walk_block)
from .channel import decayed_state_chunk, gated_state_chunk


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report
and ``_common.walk_block``: at 32 value columns, 8 warps spill least)."""
NUM_STAGES = WALK_STAGES


@triton.jit
def tape_walk_kernel(
    k, w, u, g, gate_params, k_rstd, chunk_table, frag_table, initial_state, s_in, carry_in, h_out, v_new,
    final_state, k_decayed, chunk_decay,
    n_chunks, n_frag, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_INITIAL: tl.constexpr, HAS_S_IN: tl.constexpr, HAS_FINAL: tl.constexpr, HAS_CARRY: tl.constexpr,
    GATE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, CHANNEL: tl.constexpr, DECAYED: tl.constexpr,
):
    """One fragment of one value head, value columns ``[i_v BV, (i_v + 1) BV)``;
    grid (n_frag, HV, V / BV). With ``CHANNEL`` (KDA) g holds a gate per key
    channel ``[T, HV, K]`` and the state's rows decay each by its channel
    (``channel.gated_state_chunk``; with ``DECAYED`` from ``channel_decays``'
    buffers, ``channel.decayed_advance_state``)."""
    i_f, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H_qk)
    col = i_v * BV
    _first, count, initial_row, flags = frag_info(frag_table, n_frag, i_f)
    first = tl.load(frag_table + 2 * n_frag + i_f)  # h_out's rows: read here (_common.chunk_tokens' note)
    BH: tl.constexpr = BK // 2 if BK > 16 else BK  # the state's halves (_common.state_chunk)
    S1, S2 = boundary_halves(initial_state, initial_row, s_in, carry_in, frag_table, n_frag, i_f, flags, HV, i_h, K, V,
                             col, BH, BV, 1, HAS_INITIAL, HAS_S_IN, HAS_CARRY, ACC)
    for j in range(0, count):
        c = first + j
        store_state_halves(h_out, S1, S2, c, HV, i_h, K, V, col, BH, BV)
        start, length = tl.load(chunk_table + c), tl.load(chunk_table + n_chunks + c)
        tok, o_t, m_t = chunk_tokens(start, length, BT)
        if CHANNEL and DECAYED:
            S1, S2 = decayed_state_chunk(w, u, v_new, k_decayed, chunk_decay, c, S1, S2, tok, m_t, HV, i_h, K, V, col,
                                         BH, BV, True, True, MM, ACC)
        else:
            S1, S2 = gated_state_chunk(k, k_rstd, w, u, v_new, g, gate_params, S1, S2, tok, m_t, length, H_qk, i_hk,
                                       HV, i_h, K, V, col, BT, BH, BV, HAS_NORM, True, True, GATE, CHANNEL, MM, ACC)
    if HAS_FINAL:
        if (flags & 2) == 0:
            store_state_halves(final_state, S1, S2, i_f, HV, i_h, K, V, col, BH, BV)


def tape_walk(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    k_rstd: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    s_in: torch.Tensor | None,
    h_out: torch.Tensor,
    v_new_out: torch.Tensor,
    final_state_out: torch.Tensor | None,
    carry_in: torch.Tensor | None = None,
    k_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.tape_walk`` (``u`` and ``v_new_out`` may be one tensor; with
    ``carry_in`` ``[n_sum, HV, K, V]``, ``index`` is a phase-3 index with its ``frag_carry`` row)."""
    has_carry = carry_in is not None and carry_in.shape[0] > 0
    H_qk, K = k.shape[1], k.shape[2]
    HV, V = u.shape[1], u.shape[2]
    if index.n_frag == 0:
        return
    BV = walk_block(V)
    launch(tape_walk_kernel)[(index.n_frag, HV, triton.cdiv(V, BV))](
        k, w, u, g, pointer(gate_params, g), pointer(k_rstd, g), index.chunk_table, index.frag_table,
        pointer(initial_state, h_out), pointer(s_in, h_out), carry_in if has_carry else h_out,
        h_out, v_new_out, pointer(final_state_out, h_out), pointer(k_decayed, g), pointer(chunk_decay, g),
        index.n_chunks, index.n_frag, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=BV, HAS_NORM=k_rstd is not None, HAS_INITIAL=initial_state is not None,
        HAS_S_IN=s_in is not None, HAS_FINAL=final_state_out is not None, HAS_CARRY=has_carry,
        GATE=gate_params is not None, ACC=acc_dtype(k), MM=mm_mode(k), CHANNEL=g.dim() == 3,
        DECAYED=k_decayed is not None, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )

"""The tape walk and the output in one walk (Triton), for a forward that keeps
no tape; one program per (fragment, value head, value tile), as the tape walk.
Same signature as ``kernels.torch.walk_output``.

Per chunk, from the state halves ``S = [S1; S2]`` at its start: ``diag(gamma)
Q S`` against the two matching column slices of Q, ``V_new = U - W S``
(``_common.chunk_values``), then ``O = scale (diag(gamma) Q S + P V_new)``
with the scores ``P`` that ``kernels.triton.scores`` stored, then the state
update (``_common.advance_state``; the two make ``_common.state_chunk``).
Neither the states at the chunk starts nor v_new leaves the registers: at
T = 32K, HV = 32, K = V = 128 (bf16) 537 MB of h and 268 MB of v_new are
neither written nor read back, for 1.07 GB of q and 537 MB of scores read
(each value-tile program reads its chunk's): 4.34 GB moved against 4.87 for
the tape walk and the output. The calibrated model prices it at 1,009 us
against 1,328, its steps bound by their latency and products."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (BT, WALK_STAGES, acc_dtype, advance_state, boundary_halves, chunk_tokens, chunk_values, dot,
                      frag_info, head_block, launch, load_operand_cols, load_qk_cols, load_tile, lower_dot, mm_mode,
                      operand, pointer, store_rows_cols, store_state_halves, walk_block, walk_operands)
from .channel import channel_advance_state, channel_decayed_rows, decayed_advance_state

NUM_WARPS = 8
"""Warps per program, as the tape walk (``_common.walk_block``)."""
NUM_STAGES = WALK_STAGES


def stages(constexprs) -> int:
    """Pipeline stages of the program of ``constexprs``: ``NUM_STAGES``, but
    one for a gate per key channel at key tiles past 128: at K = V = 256 two
    stages want 262,656 B of shared memory forming the decays (sm_90's limit:
    232,448), 237,568 B on ``channel_decays``' decays; one 49,152 B and no
    spill (forming them: 736 B; GDN's walk spills 212 at two; bf16, triton
    3.9)."""
    return 1 if constexprs["CHANNEL"] and constexprs["BK"] > 128 else NUM_STAGES


@triton.jit
def walk_output_kernel(
    q, k, w, u, g, gate_params, q_rstd, k_rstd, scores, chunk_table, frag_table, initial_state, s_in, carry_in,
    o, final_state, k_decayed, q_decayed, chunk_decay, scale,
    n_chunks, n_frag, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_INITIAL: tl.constexpr, HAS_S_IN: tl.constexpr, HAS_FINAL: tl.constexpr, HAS_CARRY: tl.constexpr,
    GATE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, CHANNEL: tl.constexpr, DECAYED: tl.constexpr,
):
    """One fragment of one value head, value columns ``[i_v BV, (i_v + 1) BV)``;
    grid (n_frag, HV, V / BV). With ``CHANNEL`` (KDA) g holds a gate per key
    channel ``[T, HV, K]``: q decays per channel (``channel.channel_decayed_rows``)
    and so do the state's rows (``channel.channel_advance_state``); with
    ``DECAYED`` both are read from ``channel_decays``' buffers instead."""
    i_f, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H_qk)
    col = i_v * BV
    first, count, initial_row, flags = frag_info(frag_table, n_frag, i_f)
    BH: tl.constexpr = BK // 2 if BK > 16 else BK  # the state's halves (_common.state_chunk)
    S1, S2 = boundary_halves(initial_state, initial_row, s_in, carry_in, frag_table, n_frag, i_f, flags, HV, i_h, K, V,
                             col, BH, BV, 1, HAS_INITIAL, HAS_S_IN, HAS_CARRY, ACC)
    for j in range(0, count):
        c = first + j
        start, length = tl.load(chunk_table + c), tl.load(chunk_table + n_chunks + c)
        tok, o_t, m_t = chunk_tokens(start, length, BT)
        if CHANNEL and DECAYED:
            b_q1 = load_operand_cols(q_decayed, tok, m_t, HV, i_h, K, 0, BH, MM, ACC)
            b_q2 = load_operand_cols(q_decayed, tok, m_t, HV, i_h, K, BH, BH, MM, ACC)
        elif CHANNEL:
            b_q1 = channel_decayed_rows(q, q_rstd, g, gate_params, tok, m_t, H_qk, i_hk, HV, i_h, K, 0, BH,
                                        HAS_NORM, GATE, MM, ACC)
            b_q2 = channel_decayed_rows(q, q_rstd, g, gate_params, tok, m_t, H_qk, i_hk, HV, i_h, K, BH, BH,
                                        HAS_NORM, GATE, MM, ACC)
        else:
            G, k_scale, gamma_last = walk_operands(g, gate_params, tok, length, HV, i_h, BT, GATE, ACC)
            gamma = tl.exp(G)
            b_q1 = operand(gamma[:, None] * load_qk_cols(q, q_rstd, tok, m_t, H_qk, i_hk, K, 0, BH, HAS_NORM, ACC),
                           MM)
            b_q2 = operand(gamma[:, None] * load_qk_cols(q, q_rstd, tok, m_t, H_qk, i_hk, K, BH, BH, HAS_NORM, ACC),
                           MM)
        b_o = dot(b_q1, S1, MM) + dot(b_q2, S2, MM)
        b_vn = chunk_values(w, u, S1, S2, tok, m_t, HV, i_h, K, V, col, BH, BV, True, MM, ACC)
        b_p = operand(load_tile(scores, tok, m_t, HV, i_h, BT, 0, BT).to(ACC), MM)
        b_o += lower_dot(b_p, b_vn, MM)
        store_rows_cols(o, scale * b_o, tok, m_t, HV, i_h, V, col, BV)
        if CHANNEL and DECAYED:
            S1, S2 = decayed_advance_state(k_decayed, chunk_decay, c, S1, S2, b_vn, tok, m_t, HV, i_h, K, BH, MM, ACC)
        elif CHANNEL:
            S1, S2 = channel_advance_state(k, k_rstd, g, gate_params, S1, S2, b_vn, tok, m_t, length, H_qk, i_hk,
                                           HV, i_h, K, BH, HAS_NORM, GATE, MM, ACC)
        else:
            S1, S2 = advance_state(k, k_rstd, S1, S2, b_vn, tok, m_t, k_scale, gamma_last, H_qk, i_hk, K, BH,
                                   HAS_NORM, MM, ACC)
    if HAS_FINAL:
        if (flags & 2) == 0:
            store_state_halves(final_state, S1, S2, i_f, HV, i_h, K, V, col, BH, BV)


def walk_output(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    scores: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    s_in: torch.Tensor | None,
    o_out: torch.Tensor,
    final_state_out: torch.Tensor | None,
    carry_in: torch.Tensor | None = None,
    k_decayed: torch.Tensor | None = None,
    q_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.walk_output``."""
    has_carry = carry_in is not None and carry_in.shape[0] > 0
    H_qk, K = k.shape[1], k.shape[2]
    HV, V = u.shape[1], u.shape[2]
    if index.n_frag == 0:
        return
    BV = walk_block(V)
    launch(walk_output_kernel)[(index.n_frag, HV, triton.cdiv(V, BV))](
        q, k, w, u, g, pointer(gate_params, g), pointer(q_rstd, g), pointer(k_rstd, g), scores,
        index.chunk_table, index.frag_table, pointer(initial_state, o_out), pointer(s_in, o_out),
        carry_in if has_carry else o_out, o_out, pointer(final_state_out, o_out), pointer(k_decayed, g),
        pointer(q_decayed, g), pointer(chunk_decay, g), scale,
        index.n_chunks, index.n_frag, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=BV, HAS_NORM=q_rstd is not None, HAS_INITIAL=initial_state is not None,
        HAS_S_IN=s_in is not None, HAS_FINAL=final_state_out is not None, HAS_CARRY=has_carry,
        GATE=gate_params is not None, ACC=acc_dtype(k), MM=mm_mode(k), CHANNEL=g.dim() == 3,
        DECAYED=k_decayed is not None, num_warps=NUM_WARPS,
        num_stages=stages(dict(CHANNEL=g.dim() == 3, BK=head_block(K))),
    )

"""Backward walk of the state adjoint (Triton), last chunk first; one program per
(fragment, value head, value tile). Same signature as ``kernels.torch.adjoint_walk``.

    dh[c] = dS;  dVn = dVn_local + diag(gamma_C / gamma) K dS
    dS_prev = gamma_C dS + scale (diag(gamma) Q)^T dO - W^T dVn
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (BT, WALK_STAGES, acc_dtype, boundary_halves, chunk_tokens, dot, head_block, launch,
                      load_operand_cols, load_qk_cols, load_rows_cols, load_scalars, load_tile, mm_mode, operand, pointer,
                      pull_dot, pull_operand,
                      store_rows_cols, store_state_halves, walk_block, walk_operands)
from .channel import channel_decayed_rows, channel_key_half, decayed_key_half


NUM_WARPS = 8
"""Warps per program of the kernel with matrix products (see compile_specs --report
and ``_common.walk_block``)."""
NUM_STAGES = WALK_STAGES


def stages(constexprs) -> int:
    """Pipeline stages of the program of ``constexprs``: ``NUM_STAGES``, but
    one for a gate per key channel at key tiles past 128 that forms its own
    decays, whose fp32 gate tiles (read for K's and for Q's decays) fill
    shared memory: at K = V = 256 two stages want 244,224 B (sm_90's limit:
    232,448), one 45,056 B, and spills 116 B per thread, as GDN's adjoint
    walk does at two (bf16, triton 3.9). On ``channel_decays``' decays
    (``DECAYED``) two fit: 213,248 B and no spill, against 40 B at one."""
    if constexprs["CHANNEL"] and constexprs["BK"] > 128 and not constexprs.get("DECAYED", False):
        return 1
    return NUM_STAGES


@triton.jit
def adjoint_chunk(q, k, w, q_rstd, k_rstd, do, dv_local, dS1, dS2, tok, m_t, G, k_scale, gamma_last, scale, H_qk,
                  hk, HV, h, K, V, col, BH: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
                  ACC: tl.constexpr, MM: tl.constexpr):
    """One chunk of the adjoint walk on ``dS = [dS1; dS2]`` (rows ``[0, BH)``
    and ``[BH, 2 BH)`` of K, as ``_common.state_chunk`` holds a state):
    ``(dVn, dS1_prev, dS2_prev)``. The decays (at most 1: ``k_scale``, and
    ``scale gamma_i`` of Q) go on the ``[BT, BV]`` side of the products, so no
    decayed copy of K or Q is made (:func:`walk_operands`). W, K and Q are read
    in ``[BT, BH]`` slices, W's first: on sm_90 at 8 warps, value tiles of 32
    and 2 stages (triton 3.6) the adjoint walk then spilled 4 B per thread, 24
    with W's slices read just before their products, 48 with K's products
    split (compiled without the head dims' divisibility; with it, as a launch
    compiles it, 226 registers and no spill)."""
    b_w1 = load_operand_cols(w, tok, m_t, HV, h, K, 0, BH, MM, ACC)
    b_w2 = load_operand_cols(w, tok, m_t, HV, h, K, BH, BH, MM, ACC)
    b_k1 = operand(load_qk_cols(k, k_rstd, tok, m_t, H_qk, hk, K, 0, BH, HAS_NORM, ACC), MM)
    b_k2 = operand(load_qk_cols(k, k_rstd, tok, m_t, H_qk, hk, K, BH, BH, HAS_NORM, ACC), MM)
    b_dvn = load_rows_cols(dv_local, tok, m_t, HV, h, V, col, BV, ACC) + k_scale[:, None] * (
        dot(b_k1, dS1, MM) + dot(b_k2, dS2, MM))
    # the pull Q^T (c dO): the decay, the scale and q's norm on dO, which is read as two terms
    # (kernels.precision.pull_mode); the raw q is exact in its dtype
    b_c = scale * tl.exp(G)
    if HAS_NORM:
        b_c = b_c * load_scalars(q_rstd, tok, m_t, H_qk, hk, ACC)
    dos_hi, dos_lo = pull_operand(b_c[:, None] * load_rows_cols(do, tok, m_t, HV, h, V, col, BV, ACC), MM)
    b_dvo = operand(b_dvn, MM)
    b_q = load_tile(q, tok, m_t, H_qk, hk, K, 0, BH)
    dS1 = gamma_last * dS1 + pull_dot(tl.trans(b_q), dos_hi, dos_lo, MM) - dot(tl.trans(b_w1), b_dvo, MM)
    b_q = load_tile(q, tok, m_t, H_qk, hk, K, BH, BH)
    dS2 = gamma_last * dS2 + pull_dot(tl.trans(b_q), dos_hi, dos_lo, MM) - dot(tl.trans(b_w2), b_dvo, MM)
    return b_dvn, dS1, dS2


@triton.jit
def channel_adjoint_half(q, q_rstd, w, g, gate_params, q_decayed, dos_hi, dos_lo, b_dvo, tok, m_t, H_qk, hk, HV, h,
                         K, col0, BH: tl.constexpr, GATE: tl.constexpr, DECAYED: tl.constexpr, MM: tl.constexpr,
                         ACC: tl.constexpr):
    """Key rows ``[col0, col0 + BH)`` of the start adjoint with a gate per key
    channel: ``exp(G_C) dS + (Q exp(G))^T (c dO) - W^T dVn`` (``gamma`` per
    row). Q decays per channel, so the decay goes on Q's side, read as the
    products read an operand (``kernels.torch._walk.q_decayed_do``; with
    ``DECAYED`` from ``channel_decays``' buffer); the scale and q's norm stay
    on dO's side (``dos_hi``, ``dos_lo``)."""
    if DECAYED:
        b_qd = load_operand_cols(q_decayed, tok, m_t, HV, h, K, col0, BH, MM, ACC)
    else:
        b_qd = channel_decayed_rows(q, q_rstd, g, gate_params, tok, m_t, H_qk, hk, HV, h, K, col0, BH, False, GATE,
                                    MM, ACC)
    b_w = load_operand_cols(w, tok, m_t, HV, h, K, col0, BH, MM, ACC)
    return pull_dot(tl.trans(b_qd), dos_hi, dos_lo, MM) - dot(tl.trans(b_w), b_dvo, MM)


@triton.jit
def channel_adjoint_chunk(q, k, w, g, gate_params, q_rstd, k_rstd, do, dv_local, k_decayed, q_decayed, chunk_decay, c,
                          dS1, dS2, tok, m_t, length, scale, H_qk, hk, HV, h, K, V, col, BH: tl.constexpr,
                          BV: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr, DECAYED: tl.constexpr,
                          ACC: tl.constexpr, MM: tl.constexpr):
    """:func:`adjoint_chunk` with a gate per key channel (KDA): ``dVn =
    dVn_local + (K exp(G_C - G)) dS`` and each row of dS decaying by its own
    channel, the mirror of ``channel.channel_advance_state``. Returns
    ``(dVn, dS1_prev, dS2_prev)``; with ``DECAYED`` the decays are
    ``channel_decays``' (chunk ``c``)."""
    if DECAYED:
        b_k1, gamma1 = decayed_key_half(k_decayed, chunk_decay, c, tok, m_t, HV, h, K, 0, BH, MM, ACC)
        b_k2, gamma2 = decayed_key_half(k_decayed, chunk_decay, c, tok, m_t, HV, h, K, BH, BH, MM, ACC)
    else:
        b_k1, gamma1 = channel_key_half(k, k_rstd, g, gate_params, tok, m_t, length, H_qk, hk, HV, h, K, 0, BH,
                                        HAS_NORM, GATE, MM, ACC)
        b_k2, gamma2 = channel_key_half(k, k_rstd, g, gate_params, tok, m_t, length, H_qk, hk, HV, h, K, BH, BH,
                                        HAS_NORM, GATE, MM, ACC)
    b_dvn = load_rows_cols(dv_local, tok, m_t, HV, h, V, col, BV, ACC) + dot(b_k1, dS1, MM) + dot(b_k2, dS2, MM)
    b_c = tl.full([tok.shape[0]], scale, ACC)
    if HAS_NORM:
        b_c = b_c * load_scalars(q_rstd, tok, m_t, H_qk, hk, ACC)
    dos_hi, dos_lo = pull_operand(b_c[:, None] * load_rows_cols(do, tok, m_t, HV, h, V, col, BV, ACC), MM)
    b_dvo = operand(b_dvn, MM)
    dS1 = gamma1[:, None] * dS1 + channel_adjoint_half(q, q_rstd, w, g, gate_params, q_decayed, dos_hi, dos_lo, b_dvo,
                                                       tok, m_t, H_qk, hk, HV, h, K, 0, BH, GATE, DECAYED, MM, ACC)
    dS2 = gamma2[:, None] * dS2 + channel_adjoint_half(q, q_rstd, w, g, gate_params, q_decayed, dos_hi, dos_lo, b_dvo,
                                                       tok, m_t, H_qk, hk, HV, h, K, BH, BH, GATE, DECAYED, MM, ACC)
    return b_dvn, dS1, dS2


@triton.jit
def gated_adjoint_chunk(q, k, w, g, gate_params, q_rstd, k_rstd, do, dv_local, k_decayed, q_decayed, chunk_decay, c,
                        dS1, dS2, tok, m_t, length, scale, H_qk, hk, HV, h, K, V, col, BT: tl.constexpr,
                        BH: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
                        CHANNEL: tl.constexpr, DECAYED: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr):
    """One chunk of an adjoint walk for either gate: a scalar per row
    (:func:`adjoint_chunk` on ``walk_operands``' decays) or, with
    ``CHANNEL``, a gate per key channel (:func:`channel_adjoint_chunk`).
    Returns ``(dVn, dS1_prev, dS2_prev)``."""
    if CHANNEL:
        return channel_adjoint_chunk(q, k, w, g, gate_params, q_rstd, k_rstd, do, dv_local, k_decayed, q_decayed,
                                     chunk_decay, c, dS1, dS2, tok, m_t, length, scale, H_qk, hk, HV, h, K, V, col, BH,
                                     BV, HAS_NORM, GATE, DECAYED, ACC, MM)
    else:
        G, k_scale, gamma_last = walk_operands(g, gate_params, tok, length, HV, h, BT, GATE, ACC)
        return adjoint_chunk(q, k, w, q_rstd, k_rstd, do, dv_local, dS1, dS2, tok, m_t, G, k_scale, gamma_last, scale,
                             H_qk, hk, HV, h, K, V, col, BH, BV, HAS_NORM, ACC, MM)


@triton.jit
def adjoint_walk_kernel(
    q, k, w, g, gate_params, do, dv_local, q_rstd, k_rstd, chunk_table, frag_table, d_final, lam, carry_in, dh, dv,
    d_initial, k_decayed, q_decayed, chunk_decay, scale,
    n_chunks, n_frag, H_qk, HV, K, V,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_FINAL: tl.constexpr, HAS_LAM: tl.constexpr, HAS_INITIAL: tl.constexpr, HAS_CARRY: tl.constexpr,
    GATE: tl.constexpr, CHANNEL: tl.constexpr, DECAYED: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
):
    """One fragment, value head and value tile; grid (F, HV, V / BV). With
    ``CHANNEL`` (KDA) g holds a gate per key channel ``[T, HV, K]``."""
    i_f, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (HV // H_qk)
    col = i_v * BV
    # dh's and d_initial's rows come from the fragment's first chunk, count and initial row: read
    # here, not through frag_info (_common.chunk_tokens' note)
    first, count = tl.load(frag_table + 2 * n_frag + i_f), tl.load(frag_table + 3 * n_frag + i_f)
    initial_row = i_f - (tl.load(frag_table + 5 * n_frag) & 1)  # fragment 0 alone can cross in
    flags = tl.load(frag_table + 5 * n_frag + i_f)
    BH: tl.constexpr = BK // 2 if BK > 16 else BK  # the state's halves (_common.state_chunk)
    # a SEGMENT row ends at its carry-plane row
    dS1, dS2 = boundary_halves(d_final, i_f, lam, carry_in, frag_table, n_frag, i_f, flags, HV, i_h, K, V, col, BH, BV,
                               2, HAS_FINAL, HAS_LAM, HAS_CARRY, ACC)
    for jj in range(0, count):
        c = first + count - 1 - jj
        store_state_halves(dh, dS1, dS2, c, HV, i_h, K, V, col, BH, BV)
        start, length = tl.load(chunk_table + c), tl.load(chunk_table + n_chunks + c)
        tok, o_t, m_t = chunk_tokens(start, length, BT)
        b_dvn, dS1, dS2 = gated_adjoint_chunk(q, k, w, g, gate_params, q_rstd, k_rstd, do, dv_local, k_decayed,
                                              q_decayed, chunk_decay, c, dS1, dS2, tok, m_t, length, scale, H_qk, i_hk,
                                              HV, i_h, K, V, col, BT, BH, BV, HAS_NORM, GATE, CHANNEL, DECAYED, ACC, MM)
        store_rows_cols(dv, b_dvn, tok, m_t, HV, i_h, V, col, BV)
    if HAS_INITIAL:
        if (flags & 1) == 0:
            store_state_halves(d_initial, dS1, dS2, initial_row, HV, i_h, K, V, col, BH, BV)


def adjoint_walk(
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
    lam_end: torch.Tensor | None,
    dh_out: torch.Tensor,
    dv_out: torch.Tensor,
    d_initial_state_out: torch.Tensor | None,
    carry_in: torch.Tensor | None = None,
    k_decayed: torch.Tensor | None = None,
    q_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """See ``kernels.torch.adjoint_walk`` (``dv_local`` and ``dv_out`` may be one tensor; with
    ``carry_in`` ``[n_sum, HV, K, V]``, ``index`` is a phase-3 index with its ``frag_carry`` row)."""
    has_carry = carry_in is not None and carry_in.shape[0] > 0
    H_qk, K = q.shape[1], q.shape[2]
    HV, V = do.shape[1], do.shape[2]
    if index.n_frag == 0:
        return
    BV = walk_block(V)
    spare = dh_out
    channel = g.dim() == 3
    launch(adjoint_walk_kernel)[(index.n_frag, HV, triton.cdiv(V, BV))](
        q, k, w, g, pointer(gate_params, g), do, dv_local, pointer(q_rstd, g), pointer(k_rstd, g),
        index.chunk_table, index.frag_table,
        pointer(d_final_state, spare), pointer(lam_end, spare), carry_in if has_carry else spare,
        dh_out, dv_out, pointer(d_initial_state_out, spare), pointer(k_decayed, g), pointer(q_decayed, g),
        pointer(chunk_decay, g), scale,
        index.n_chunks, index.n_frag, H_qk, HV, K, V,
        BT=BT, BK=head_block(K), BV=BV, HAS_NORM=q_rstd is not None, HAS_FINAL=d_final_state is not None,
        HAS_LAM=lam_end is not None, HAS_INITIAL=d_initial_state_out is not None, HAS_CARRY=has_carry,
        GATE=gate_params is not None, CHANNEL=channel, DECAYED=k_decayed is not None,
        ACC=acc_dtype(k), MM=mm_mode(k), num_warps=NUM_WARPS,
        num_stages=stages(dict(CHANNEL=channel, BK=head_block(K), DECAYED=k_decayed is not None)),
    )

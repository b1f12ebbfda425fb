"""KDA in Triton (a gate per key channel): the intra-chunk products, the
device form of ``kernels/torch/_channel.py`` shared by the scores and the WY
inverse, and the walks' state update (:func:`channel_advance_state`).

``S_ij = s_i sum_d a_id b_jd exp(Γ_id - Γ_jd)`` for the rows ``j <= i`` of a
chunk comes in two parts. The pairs across sub-chunks are ``[BT, BT]``
products at M = N = BT (warpgroup MMAs), one per anchor ``r_J`` (the last row
of sub-chunk J): the rows after J decayed to it, ``a_i exp(Γ_i - Γ_r)``,
against the rows of J decayed from it, ``b_j exp(Γ_r - Γ_j)``. The pairs
inside a sub-chunk are taken elementwise. Every exponent is a sum of exactly
the gates it spans, none positive, so no factor overflows for any gate and a
``-inf`` gate (a hard reset of one channel) gives an exact zero.

Sub-chunks here have ``SUB`` = 16 rows (``tl.dot``'s least M and N), as the
torch twin's; the two agree to the rounding of their sums and products, not
bitwise. At 16 they are also the WY inverse's diagonal blocks
(``kernels.torch.prep.INVERSE_BLOCK``), which its substitution takes straight
from the elementwise part."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (channel_gates, chunk_tokens, chunk_values, dot, load_qk_cols, operand, state_chunk,
                      store_rows_cols, walk_operands)

BKS_CHANNEL = 32
"""Key columns per slice of :func:`channel_products`: its elementwise
``[16, 16, BKS]`` pairs inside a sub-chunk hold 64 fp32 values a thread at 4
warps."""


@triton.jit
def channel_products(a, b, a_rstd, b_rstd, g, gate_params, b_scale, start, length, H_qk, i_hk, HV, i_h, K,
                     BT: tl.constexpr, SUB: tl.constexpr, BKS: tl.constexpr, HAS_NORM: tl.constexpr,
                     GATE: tl.constexpr, STRICT: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr):
    """One chunk (``start``, ``length``) of value head ``i_h``: a and b are the
    rows of key head ``i_hk`` (normalised by ``a_rstd`` / ``b_rstd`` when
    ``HAS_NORM``), ``b_scale`` ``[BT]`` scales row i (before the products
    round their operands), the products run under rule ``MM``. Returns the
    pairs across sub-chunks ``[BT, BT]`` (zero on and above the ``[SUB, SUB]``
    diagonal blocks) and those inside them ``[BT / SUB, SUB, SUB]``, on
    ``i >= j`` (``i > j`` when ``STRICT``), zero elsewhere."""
    NB: tl.constexpr = BT // SUB
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    tok_n, _, m_n = chunk_tokens(start + 1, length - 1, BT)  # each row's next row
    m_n = m_n & ((o_t + 1) % SUB != 0)  # ... inside its sub-chunk
    block = o_t // SUB
    b_s = tl.zeros([BT, BT], dtype=ACC)
    for k0 in range(0, K, BKS):
        b_g = channel_gates(g, gate_params, tok, m_t, HV, i_h, K, k0, BKS, GATE, ACC)
        # sum_{j < l <= r_J} g_l: the next rows' gates summed backwards within each sub-chunk
        b_gn = tl.reshape(channel_gates(g, gate_params, tok_n, m_n, HV, i_h, K, k0, BKS, GATE, ACC), [NB, SUB, BKS])
        b_behind = tl.reshape(tl.cumsum(b_gn, 1, reverse=True), [BT, BKS])
        b_a = load_qk_cols(a, a_rstd, tok, m_t, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC) * b_scale[:, None]
        b_b = load_qk_cols(b, b_rstd, tok, m_t, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC) * tl.exp(b_behind)
        for J in tl.static_range(NB - 1):
            # sum_{r_J < l <= i} g_l for the rows after J's anchor r_J (a sum of exactly those gates)
            b_ahead = tl.cumsum(tl.where(o_t[:, None] > J * SUB + SUB - 1, b_g, 0.0), 0)
            b_left = tl.where((block > J)[:, None], b_a * tl.exp(b_ahead), 0.0)
            b_right = tl.where((block == J)[:, None], b_b, 0.0)
            b_s += dot(b_left, tl.trans(b_right), MM)
    # a select, not the products' zeros: a non-finite row j of b reaches only the pairs (i > j, j)
    b_s = tl.where(block[:, None] > block[None, :], b_s, 0.0)
    o_s, o_b = tl.arange(0, SUB), tl.arange(0, NB)
    below = o_s[:, None] > o_s[None, :]
    if STRICT:
        m_pair = below
    else:
        m_pair = o_s[:, None] >= o_s[None, :]
    b_D = tl.zeros([NB, SUB, SUB], dtype=ACC)
    for I in tl.static_range(NB):
        tok_i, _, m_i = chunk_tokens(start + I * SUB, length - I * SUB, SUB)
        b_d = tl.zeros([SUB, SUB], dtype=ACC)
        for k0 in range(0, K, BKS):
            b_gi = channel_gates(g, gate_params, tok_i, m_i, HV, i_h, K, k0, BKS, GATE, ACC)
            # segment[x, y] = sum_{y < l <= x} g_l: column y sums the gates of the rows below it
            segment = tl.cumsum(tl.where(below[:, :, None], b_gi[:, None, :], 0.0), 0)
            b_ai = load_qk_cols(a, a_rstd, tok_i, m_i, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC)
            b_bi = load_qk_cols(b, b_rstd, tok_i, m_i, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC)
            b_pair = b_ai[:, None, :] * b_bi[None, :, :] * tl.exp(segment)
            b_d += tl.sum(tl.where(m_pair[:, :, None], b_pair, 0.0), 2)
        b_D = tl.where((o_b == I)[:, None, None], b_d[None, :, :], b_D)
    return b_s, b_D * tl.reshape(b_scale, [NB, SUB])[:, :, None]


@triton.jit
def diagonal_block_pointers(ptr, start, length, H, h, BT: tl.constexpr, SUB: tl.constexpr):
    """Addresses and mask of the ``[BT / SUB, SUB, SUB]`` diagonal blocks of a
    chunk's rows in ``[T, H, BT]`` (head ``h``): block I, row x, column y at
    row ``I SUB + x``, column ``I SUB + y``."""
    NB: tl.constexpr = BT // SUB
    o_b, o_s = tl.arange(0, NB), tl.arange(0, SUB)
    row = o_b[:, None, None] * SUB + o_s[None, :, None]
    col = o_b[:, None, None] * SUB + o_s[None, None, :]
    return ptr + ((start.to(tl.int64) + row) * H + h) * BT + col, row < length


@triton.jit
def channel_key_half(k, k_rstd, g, gate_params, tok, m_t, length, H_qk, hk, HV, h, K, col0, BH: tl.constexpr,
                     HAS_NORM: tl.constexpr, GATE: tl.constexpr, MM: tl.constexpr, ACC: tl.constexpr):
    """Key columns ``[col0, col0 + BH)`` of a walk's chunk with a gate per key
    channel: ``K exp(G_C - G)`` as the products read it, and the chunk's decay
    ``gamma_C = exp(G_C)`` ``[BH]``. The decay of row i, ``exp(sum_{l > i}
    g_l)``, is a reverse cumsum of the gates one row on (each exponent a sum of
    exactly the gates it spans, at most 0), on K's side: it differs per
    channel, so it cannot go on the values' side as the scalar gate's
    ``k_scale`` does."""
    o_t = tl.arange(0, tok.shape[0])
    b_after = channel_gates(g, gate_params, tok + 1, o_t + 1 < length, HV, h, K, col0, BH, GATE, ACC)
    b_tail = tl.cumsum(b_after, 0, reverse=True)
    # G_C = g_0 + sum_{l > 0} g_l: the first row's gates and the tail's first row, no second [BT, BH] tile
    b_first = tl.sum(channel_gates(g, gate_params, tok, o_t == 0, HV, h, K, col0, BH, GATE, ACC), 0)
    gamma = tl.exp(b_first + tl.sum(tl.where(o_t[:, None] == 0, b_tail, 0.0), 0))
    b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, hk, K, col0, BH, HAS_NORM, ACC)
    return operand(b_k * tl.exp(b_tail), MM), gamma


@triton.jit
def channel_state_half(k, k_rstd, g, gate_params, X, b_vs, tok, m_t, length, H_qk, hk, HV, h, K, col0,
                       BH: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr, MM: tl.constexpr,
                       ACC: tl.constexpr):
    """Key rows ``[col0, col0 + BH)`` of a walk's state update with a gate per
    key channel: ``exp(G_C) X + (K exp(G_C - G))^T V_new`` (``b_vs``: V_new as
    the products read it; the operands from :func:`channel_key_half`)."""
    b_k, gamma = channel_key_half(k, k_rstd, g, gate_params, tok, m_t, length, H_qk, hk, HV, h, K, col0, BH,
                                  HAS_NORM, GATE, MM, ACC)
    return gamma[:, None] * X + dot(tl.trans(b_k), b_vs, MM)


@triton.jit
def channel_advance_state(k, k_rstd, g, gate_params, X1, X2, b_vn, tok, m_t, length, H_qk, hk, HV, h, K,
                          BH: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr, MM: tl.constexpr,
                          ACC: tl.constexpr):
    """``_common.advance_state`` with a gate per key channel (KDA), each half
    of the state by :func:`channel_state_half`. Returns ``(X1, X2)``."""
    b_vs = operand(b_vn, MM)
    X1 = channel_state_half(k, k_rstd, g, gate_params, X1, b_vs, tok, m_t, length, H_qk, hk, HV, h, K, 0, BH,
                            HAS_NORM, GATE, MM, ACC)
    X2 = channel_state_half(k, k_rstd, g, gate_params, X2, b_vs, tok, m_t, length, H_qk, hk, HV, h, K, BH, BH,
                            HAS_NORM, GATE, MM, ACC)
    return X1, X2


@triton.jit
def gated_state_chunk(k, k_rstd, w, u, v_new, g, gate_params, X1, X2, tok, m_t, length, H_qk, hk, HV, h, K, V, col,
                      BT: tl.constexpr, BH: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr,
                      HAS_U: tl.constexpr, STORE: tl.constexpr, GATE: tl.constexpr, CHANNEL: tl.constexpr,
                      MM: tl.constexpr, ACC: tl.constexpr):
    """``_common.state_chunk`` for either gate: a scalar per row
    (``walk_operands``' decays) or, with ``CHANNEL``, a gate per key channel
    (:func:`channel_advance_state`). Returns ``(X1, X2)``."""
    if CHANNEL:
        b_vn = chunk_values(w, u, X1, X2, tok, m_t, HV, h, K, V, col, BH, BV, HAS_U, MM, ACC)
        if STORE:
            store_rows_cols(v_new, b_vn, tok, m_t, HV, h, V, col, BV)
        return channel_advance_state(k, k_rstd, g, gate_params, X1, X2, b_vn, tok, m_t, length, H_qk, hk, HV, h, K,
                                     BH, HAS_NORM, GATE, MM, ACC)
    else:
        G, k_scale, gamma_last = walk_operands(g, gate_params, tok, length, HV, h, BT, GATE, ACC)
        return state_chunk(k, k_rstd, w, u, v_new, X1, X2, tok, m_t, k_scale, gamma_last, H_qk, hk, HV, h, K, V,
                           col, BH, BV, HAS_NORM, HAS_U, STORE, MM, ACC)


@triton.jit
def channel_decayed_rows(x, x_rstd, g, gate_params, tok, m_t, H_qk, hk, HV, h, K, col0, BH: tl.constexpr,
                         HAS_NORM: tl.constexpr, GATE: tl.constexpr, MM: tl.constexpr, ACC: tl.constexpr):
    """Columns ``[col0, col0 + BH)`` of ``x exp(G)`` (G: the per-channel gate
    cumsum from the chunk's start, at most 0), as the products read it: the
    output's pull of the chunk's start state, ``(q exp(G)) S``."""
    b_g = channel_gates(g, gate_params, tok, m_t, HV, h, K, col0, BH, GATE, ACC)
    b_x = load_qk_cols(x, x_rstd, tok, m_t, H_qk, hk, K, col0, BH, HAS_NORM, ACC)
    return operand(b_x * tl.exp(tl.cumsum(b_g, 0)), MM)


@triton.jit
def with_diagonal_blocks(b_s, b_D):
    """The ``[BT, BT]`` matrix of :func:`channel_products`' two parts: the pairs
    across sub-chunks ``b_s`` with the diagonal blocks ``b_D`` in place of its
    zeros there."""
    NB: tl.constexpr = b_D.shape[0]
    SUB: tl.constexpr = b_D.shape[1]
    o_b = tl.arange(0, NB)
    same = o_b[:, None, None, None] == o_b[None, None, :, None]  # [block, row, block, column]
    full = tl.where(same, tl.reshape(b_D, [NB, SUB, 1, SUB]), tl.reshape(b_s, [NB, SUB, NB, SUB]))
    return tl.reshape(full, [b_s.shape[0], b_s.shape[1]])


@triton.jit
def diagonal_blocks(x, SUB: tl.constexpr):
    """The ``[BT / SUB, SUB, SUB]`` diagonal blocks of a ``[BT, BT]`` tile (a
    select, so a non-finite entry off them reaches none)."""
    NB: tl.constexpr = x.shape[0] // SUB
    o_b = tl.arange(0, NB)
    same = o_b[:, None, None, None] == o_b[None, None, :, None]  # [block, row, block, column]
    return tl.sum(tl.where(same, tl.reshape(x, [NB, SUB, NB, SUB]), 0.0), 2)


@triton.jit
def channel_pulls(dS, dS_D, dSs_D, a, b, a_rstd, b_rstd, g, gate_params, a_scale, start, length, H_qk, i_hk, HV, i_h,
                  K, col0, BT: tl.constexpr, SUB: tl.constexpr, BKS: tl.constexpr, HAS_NORM: tl.constexpr,
                  GATE: tl.constexpr, ACC: tl.constexpr, CMM: tl.constexpr):
    """The two gradients of :func:`channel_products` for the gradient ``dS``
    ``[BT, BT]`` (zero above the diagonal) of its pairs, at key columns
    ``[col0, col0 + BKS)``: ``sum_j dS_ij b_j exp(G_i - G_j)`` (a's side) and
    ``sum_i dS_ij s_i a_i exp(G_i - G_j)`` (b's side; ``a_scale`` ``[BT]``:
    s), each ``[BT, BKS]`` (``kernels.torch._channel.channel_pulls``).
    ``dS_D`` and ``dSs_D`` are the ``[BT / SUB, SUB, SUB]`` diagonal blocks
    (:func:`diagonal_blocks`) of dS and of ``diag(s) dS``, which a caller
    walking key slices forms once. The
    pairs across sub-chunks go through the anchors as the products do, one
    ``[BT, BT] x [BT, BKS]`` product under ``CMM`` per anchor and side; the
    pairs inside a sub-chunk are taken elementwise."""
    NB: tl.constexpr = BT // SUB
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    tok_n, _, m_n = chunk_tokens(start + 1, length - 1, BT)  # each row's next row
    m_n = m_n & ((o_t + 1) % SUB != 0)  # ... inside its sub-chunk
    block = o_t // SUB
    b_g = channel_gates(g, gate_params, tok, m_t, HV, i_h, K, col0, BKS, GATE, ACC)
    b_gn = tl.reshape(channel_gates(g, gate_params, tok_n, m_n, HV, i_h, K, col0, BKS, GATE, ACC), [NB, SUB, BKS])
    e_behind = tl.exp(tl.reshape(tl.cumsum(b_gn, 1, reverse=True), [BT, BKS]))  # row j to its anchor
    b_a = load_qk_cols(a, a_rstd, tok, m_t, H_qk, i_hk, K, col0, BKS, HAS_NORM, ACC) * a_scale[:, None]
    b_b = load_qk_cols(b, b_rstd, tok, m_t, H_qk, i_hk, K, col0, BKS, HAS_NORM, ACC)
    d_a = tl.zeros([BT, BKS], dtype=ACC)
    d_b = tl.zeros([BT, BKS], dtype=ACC)
    for J in tl.static_range(NB - 1):
        in_J, after_J = (block == J)[:, None], (block > J)[:, None]
        e_ahead = tl.exp(tl.cumsum(tl.where(o_t[:, None] > J * SUB + SUB - 1, b_g, 0.0), 0))  # anchor to row i
        dS_J = tl.where((block[None, :] == J) & after_J, dS, 0.0)
        d_a += tl.where(after_J, e_ahead * dot(dS_J, tl.where(in_J, b_b * e_behind, 0.0), CMM), 0.0)
        d_b += tl.where(in_J, dot(tl.trans(dS_J), tl.where(after_J, b_a * e_ahead, 0.0), CMM), 0.0)
    d_b = d_b * e_behind
    o_s, o_b = tl.arange(0, SUB), tl.arange(0, NB)
    below = o_s[:, None] > o_s[None, :]
    D_a = tl.zeros([NB, SUB, BKS], dtype=ACC)
    D_b = tl.zeros([NB, SUB, BKS], dtype=ACC)
    for I in range(NB):
        tok_i, o_i, m_i = chunk_tokens(start + I * SUB, length - I * SUB, SUB)
        b_gi = channel_gates(g, gate_params, tok_i, m_i, HV, i_h, K, col0, BKS, GATE, ACC)
        # segment[x, y] = sum_{y < l <= x} g_l, as channel_products takes it
        segment = tl.cumsum(tl.where(below[:, :, None], b_gi[:, None, :], 0.0), 0)
        e = tl.where((o_s[:, None] >= o_s[None, :])[:, :, None], tl.exp(segment), 0.0)
        at_I = (o_b == I)[:, None, None]
        dS_I = tl.sum(tl.where(at_I, dS_D, 0.0), 0)
        dSs_I = tl.sum(tl.where(at_I, dSs_D, 0.0), 0)
        b_ai = load_qk_cols(a, a_rstd, tok_i, m_i, H_qk, i_hk, K, col0, BKS, HAS_NORM, ACC)
        b_bi = load_qk_cols(b, b_rstd, tok_i, m_i, H_qk, i_hk, K, col0, BKS, HAS_NORM, ACC)
        D_a = tl.where(at_I, tl.sum(dS_I[:, :, None] * e * b_bi[None, :, :], 1)[None, :, :], D_a)
        D_b = tl.where(at_I, tl.sum(dSs_I[:, :, None] * e * b_ai[:, None, :], 0)[None, :, :], D_b)
    return d_a + tl.reshape(D_a, [BT, BKS]), d_b + tl.reshape(D_b, [BT, BKS])

"""KDA in Triton (a gate per key channel): the intra-chunk products, the
device form of ``kernels/torch/_channel.py`` shared by the scores and the WY
inverse, and the walks' state update (:func:`channel_advance_state`).

``S_ij = s_i sum_d a_id b_jd exp(Γ_id - Γ_jd)`` for the rows ``j <= i`` of a
chunk of 64 rows is taken by **dyadic anchors**: the chunk is halved, and
halved again, down to single rows, and each pair ``i > j`` at the level where
``i`` and ``j`` first fall in different halves, through that level's anchor
``r``, the last row of ``j``'s half (so ``j <= r < i``):

    exp(Γ_i - Γ_j) = exp(Γ_i - Γ_r) exp(Γ_r - Γ_j)

Both factors are at most 1 for any gate: ``exp(Γ_i - Γ_r)`` is the running
product of ``exp(g_l)`` over ``i``'s half up to ``i``, ``exp(Γ_r - Γ_j)`` that
over the rows after ``j`` in ``j``'s half (each factor a product of exactly
the gates it spans, never a difference of two cumulative sums), so a ``-inf``
gate (a hard reset of one channel) gives an exact zero and ``-1000`` no NaN.
A slice of key channels takes two exponentials a row and channel (``exp(g)``
of each row and of the next), whatever the level.

At half widths 32 and 16 a level is a product on tensor cores of exactly the
pairs it holds (``[32, BKS] x [BKS, 32]``, and a batch of two ``[16, BKS] x
[BKS, 16]``): the pairs across the 16-row sub-chunks. At 8, 4, 2 and 1 it is
taken elementwise, one FMA a pair and channel (480 pairs a chunk, and the
diagonal): the pairs inside a sub-chunk. Nothing is formed under a mask. The
sub-chunks of 16 rows (``tl.dot``'s least M and N) are also the WY inverse's
diagonal blocks (``kernels.torch.prep.INVERSE_BLOCK``), which its
substitution takes straight from the elementwise part. The torch twin
(anchors at the sub-chunks' ends, exponentials of running sums) agrees to
the rounding of the sums and products, not bitwise."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import (channel_gates, chunk_tokens, chunk_values, dot, load_operand_cols, load_qk_cols, operand,
                      state_chunk, store_rows_cols, walk_operands)

BKS_CHANNEL = 16
"""Key columns per slice of :func:`channel_products`: at 32 its programs
spilled 260 to 276 B a thread at K = 128 (ptxas, triton 3.9, sm_90: the
levels' tiles and their layout changes), at 16 none (246 to 253 registers)."""


@triton.jit
def halves(x, H: tl.constexpr):
    """The rows ``[R, D]`` in blocks of ``2 H``: the first and the second
    ``H`` rows of each, ``[R / 2H, H, D]`` both."""
    R: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, [R // (2 * H), 2, H, D]), (0, 2, 3, 1)))


@triton.jit
def unhalves(first, second):
    """:func:`halves` undone: ``[N, H, D]`` twice -> rows ``[2 N H, D]``."""
    N: tl.constexpr = first.shape[0]
    H: tl.constexpr = first.shape[1]
    D: tl.constexpr = first.shape[2]
    return tl.reshape(tl.permute(tl.join(first, second), (0, 3, 1, 2)), [2 * N * H, D])


@triton.jit
def assemble(diag, low):
    """``[N, 2H, 2H]`` lower blocks from their diagonal halves ``diag``
    ``[2N, H, H]`` and the pairs across them ``low`` ``[N, H, H]`` (rows of
    the second half, columns of the first); zero above."""
    N: tl.constexpr = low.shape[0]
    H: tl.constexpr = low.shape[1]
    top, bottom = tl.split(tl.permute(tl.reshape(diag, [N, 2, H, H]), (0, 2, 3, 1)))
    upper = tl.reshape(tl.permute(tl.join(top, tl.zeros_like(top)), (0, 1, 3, 2)), [N, H, 2 * H])
    lower = tl.reshape(tl.permute(tl.join(low, bottom), (0, 1, 3, 2)), [N, H, 2 * H])
    return tl.reshape(tl.permute(tl.join(upper, lower), (0, 3, 1, 2)), [N, 2 * H, 2 * H])


@triton.jit
def disassemble(x):
    """:func:`assemble` undone (what lies above the diagonal halves is
    dropped): ``[N, 2H, 2H]`` -> ``(diag [2N, H, H], low [N, H, H])``."""
    N: tl.constexpr = x.shape[0]
    H: tl.constexpr = x.shape[1] // 2
    # [N, row, column, row half, column half]
    parts = tl.permute(tl.reshape(x, [N, 2, H, 2, H]), (0, 2, 4, 1, 3))
    left, right = tl.split(parts)
    top, low = tl.split(left)
    _, bottom = tl.split(right)
    return tl.reshape(tl.permute(tl.join(top, bottom), (0, 3, 1, 2)), [2 * N, H, H]), low


@triton.jit
def pair_levels(x, BT: tl.constexpr):
    """A lower ``[BT, BT]`` tile (BT = 64) at the dyadic levels: the pairs
    across the halves of width 32, 16, 8, 4, 2 and 1 (``[64 / 2H, H, H]``
    each, rows of the second half, columns of the first) and the diagonal
    ``[BT]``; what lies above it is dropped (:func:`pair_matrix` undone).
    Formed once for every key slice of :func:`channel_pulls`."""
    d, l32 = disassemble(tl.reshape(x, [1, BT, BT]))
    d, l16 = disassemble(d)
    d, l8 = disassemble(d)
    d, l4 = disassemble(d)
    d, l2 = disassemble(d)
    d, l1 = disassemble(d)
    return l32, l16, l8, l4, l2, l1, tl.reshape(d, [BT])


@triton.jit
def level_operands(b_a, b_b, e, e_n, H: tl.constexpr):
    """Level ``H`` (pairs across the halves of ``2H``-row blocks) of a key
    slice: the second halves' factors ``exp(Γ_i - Γ_r)`` (the running product
    of ``e = exp(g)`` from the half's first row to row i) and ``b_a`` times
    them; the first halves' ``exp(Γ_r - Γ_j)`` (the products of ``e_n``, each
    row's next row's ``exp(g)``, from row j to the half's last row but one)
    and ``b_b`` times them. Each ``[R / 2H, H, BKS]``."""
    _, a_hi = halves(b_a, H)
    b_lo, _ = halves(b_b, H)
    _, e_hi = halves(e, H)
    ahead = tl.cumprod(e_hi, 1)
    if H > 1:
        e_n_lo, _ = halves(e_n, H)
        o_h = tl.arange(0, H)
        behind = tl.cumprod(tl.where((o_h < H - 1)[None, :, None], e_n_lo, 1.0), 1, reverse=True)
    else:
        behind = tl.full(b_lo.shape, 1.0, b_lo.dtype)
    return ahead, a_hi * ahead, behind, b_lo * behind


@triton.jit
def decayed_sides(b_a, b_b, e, e_n, H: tl.constexpr):
    """:func:`level_operands`' decayed rows alone: ``(a_i exp(Γ_i - Γ_r),
    b_j exp(Γ_r - Γ_j))``."""
    ahead, A, behind, B = level_operands(b_a, b_b, e, e_n, H)
    return A, B


@triton.constexpr_function
def channels_ahead(H, GATE):
    """Whether :func:`level_pairs` takes level ``H`` with the channels ahead:
    at 8, without the gate in the kernel. A formation's FP32-pipe
    instructions then fall by 127k a chunk and value head and its shuffles by
    the same (the scores 766k -> 639k and 493k -> 366k; sm_90 SASS of triton
    3.6, K = 128, ``tools/sass_counts.py``), with no spill in the scores, the
    WY inverse, the local dv or the output. At 4 too, 49k fewer again, but
    the local dv spilled 48 B a thread; with the gate in the kernel (its
    softplus, two an element, holds registers) level 8 alone spilled the
    scores 204 -> 368 B, the WY inverse 336 -> 480 (triton 3.9: nothing
    either way). Levels 2 and 1 gain nothing (one and two rows a side)."""
    return H == 8 and not GATE


@triton.jit
def level_pairs(b_a, b_b, e, e_n, H: tl.constexpr, AHEAD: tl.constexpr):
    """Level ``H`` < 16 of :func:`channel_products` for one key slice,
    elementwise: ``[R / 2H, H, H]``. With ``AHEAD`` the channels ride ahead
    of the pairs' rows and columns (``[R / 2H, BKS, H, H]``, summed over axis
    1), so the default layout sums each pair in its own threads, not across
    lanes (:func:`channels_ahead`)."""
    A, B = decayed_sides(b_a, b_b, e, e_n, H)
    if AHEAD:
        out = tl.sum(tl.permute(A, (0, 2, 1))[:, :, :, None] * tl.permute(B, (0, 2, 1))[:, :, None, :], 1)
    else:
        out = tl.sum(A[:, :, None, :] * B[:, None, :, :], 3)
    return out


@triton.jit
def slice_rows(a, b, a_rstd, b_rstd, g, gate_params, a_scale, tok, m_t, tok_n, m_n, H_qk, i_hk, HV, i_h, K, k0,
               BKS: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr, ACC: tl.constexpr):
    """One key slice of a chunk: a (times ``a_scale``), b, ``exp(g)`` of
    each row and of its next row (1 past the chunk's last)."""
    e = tl.exp(channel_gates(g, gate_params, tok, m_t, HV, i_h, K, k0, BKS, GATE, ACC))
    e_n = tl.exp(channel_gates(g, gate_params, tok_n, m_n, HV, i_h, K, k0, BKS, GATE, ACC))
    b_a = load_qk_cols(a, a_rstd, tok, m_t, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC) * a_scale[:, None]
    b_b = load_qk_cols(b, b_rstd, tok, m_t, H_qk, i_hk, K, k0, BKS, HAS_NORM, ACC)
    return b_a, b_b, e, e_n


@triton.jit
def channel_products(a, b, a_rstd, b_rstd, g, gate_params, b_scale, start, length, H_qk, i_hk, HV, i_h, K,
                     BT: tl.constexpr, SUB: tl.constexpr, BKS: tl.constexpr, HAS_NORM: tl.constexpr,
                     GATE: tl.constexpr, STRICT: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr):
    """One chunk (``start``, ``length``) of value head ``i_h``: a and b are the
    rows of key head ``i_hk`` (normalised by ``a_rstd`` / ``b_rstd`` when
    ``HAS_NORM``), ``b_scale`` ``[BT]`` scales row i (before the products
    round their operands), the products run under rule ``MM``. Returns the
    pairs across the 16-row sub-chunks at the dyadic levels of half width 32
    ``[1, 32, 32]`` and 16 ``[2, 16, 16]`` (:func:`across_sub_chunks` or
    :func:`pair_matrix` put them together) and those inside them
    ``[BT / SUB, SUB, SUB]``, on ``i >= j`` (``i > j`` when ``STRICT``), zero
    elsewhere."""
    tl.static_assert(BT == 64 and SUB == 16, "the dyadic levels are written out for 64-row chunks")
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    tok_n, o_n, m_n = chunk_tokens(start + 1, length - 1, BT)  # each row's next row
    # the two product levels as a plain [32, 32] product and a batch of [16, 16] ones: through level_dot, as the
    # pulls take them, the scores and the output spilled 280 and 344 B a thread under triton 3.6, against 204 and 244
    p32 = tl.zeros([BT // 2, BT // 2], dtype=ACC)
    p16 = tl.zeros([2, SUB, SUB], dtype=ACC)
    p8 = tl.zeros([4, 8, 8], dtype=ACC)
    p4 = tl.zeros([8, 4, 4], dtype=ACC)
    p2 = tl.zeros([16, 2, 2], dtype=ACC)
    p1 = tl.zeros([32, 1, 1], dtype=ACC)
    p0 = tl.zeros([BT], dtype=ACC)
    for k0 in range(0, K, BKS):
        b_a, b_b, e, e_n = slice_rows(a, b, a_rstd, b_rstd, g, gate_params, b_scale, tok, m_t, tok_n, m_n, H_qk,
                                      i_hk, HV, i_h, K, k0, BKS, HAS_NORM, GATE, ACC)
        A32, B32 = decayed_sides(b_a, b_b, e, e_n, 32)
        p32 += dot(tl.reshape(A32, [BT // 2, BKS]), tl.trans(tl.reshape(B32, [BT // 2, BKS])), MM)
        A16, B16 = decayed_sides(b_a, b_b, e, e_n, 16)
        p16 += dot(A16, tl.permute(B16, (0, 2, 1)), MM)
        p8 += level_pairs(b_a, b_b, e, e_n, 8, channels_ahead(8, GATE))
        p4 += level_pairs(b_a, b_b, e, e_n, 4, channels_ahead(4, GATE))
        p2 += level_pairs(b_a, b_b, e, e_n, 2, channels_ahead(2, GATE))
        p1 += level_pairs(b_a, b_b, e, e_n, 1, channels_ahead(1, GATE))
        if not STRICT:
            p0 += tl.sum(b_a * b_b, 1)
    b_D = assemble(assemble(assemble(assemble(tl.reshape(p0, [BT, 1, 1]), p1), p2), p4), p8)
    return tl.reshape(p32, [1, BT // 2, BT // 2]), p16, b_D


@triton.jit
def across_sub_chunks(p32, p16):
    """:func:`channel_products`' pairs across sub-chunks as a ``[BT, BT]``
    tile, zero on and above its ``[16, 16]`` diagonal blocks."""
    BT: tl.constexpr = 2 * p32.shape[1]
    return tl.reshape(assemble(assemble(tl.zeros([4, p16.shape[1], p16.shape[2]], dtype=p16.dtype), p16), p32),
                      [BT, BT])


@triton.jit
def pair_matrix(p32, p16, b_D):
    """All of :func:`channel_products`' pairs as one ``[BT, BT]`` tile."""
    BT: tl.constexpr = 2 * p32.shape[1]
    return tl.reshape(assemble(assemble(b_D, p16), p32), [BT, BT])


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
def decayed_key_half(k_decayed, chunk_decay, c, tok, m_t, HV, h, K, col0, BH: tl.constexpr, MM: tl.constexpr,
                     ACC: tl.constexpr):
    """:func:`channel_key_half` read back from what ``channel_decays``
    stored for chunk ``c``: ``K exp(G_C - G)`` as the products read it and
    ``gamma_C`` ``[BH]`` (1 past K)."""
    o_k = col0 + tl.arange(0, BH)
    gamma = tl.load(chunk_decay + (c * HV + h).to(tl.int64) * K + o_k, mask=o_k < K, other=1.0).to(ACC)
    return load_operand_cols(k_decayed, tok, m_t, HV, h, K, col0, BH, MM, ACC), gamma


@triton.jit
def decayed_advance_state(k_decayed, chunk_decay, c, X1, X2, b_vn, tok, m_t, HV, h, K, BH: tl.constexpr,
                          MM: tl.constexpr, ACC: tl.constexpr):
    """:func:`channel_advance_state` on the stored decays (:func:`decayed_key_half`)."""
    b_vs = operand(b_vn, MM)
    b_k, gamma = decayed_key_half(k_decayed, chunk_decay, c, tok, m_t, HV, h, K, 0, BH, MM, ACC)
    X1 = gamma[:, None] * X1 + dot(tl.trans(b_k), b_vs, MM)
    b_k, gamma = decayed_key_half(k_decayed, chunk_decay, c, tok, m_t, HV, h, K, BH, BH, MM, ACC)
    X2 = gamma[:, None] * X2 + dot(tl.trans(b_k), b_vs, MM)
    return X1, X2


@triton.jit
def decayed_state_chunk(w, u, v_new, k_decayed, chunk_decay, c, X1, X2, tok, m_t, HV, h, K, V, col,
                        BH: tl.constexpr, BV: tl.constexpr, HAS_U: tl.constexpr, STORE: tl.constexpr,
                        MM: tl.constexpr, ACC: tl.constexpr):
    """:func:`gated_state_chunk` with a gate per key channel on the decays
    ``channel_decays`` stored for chunk ``c`` (:func:`decayed_advance_state`).
    Returns ``(X1, X2)``."""
    b_vn = chunk_values(w, u, X1, X2, tok, m_t, HV, h, K, V, col, BH, BV, HAS_U, MM, ACC)
    if STORE:
        store_rows_cols(v_new, b_vn, tok, m_t, HV, h, V, col, BV)
    return decayed_advance_state(k_decayed, chunk_decay, c, X1, X2, b_vn, tok, m_t, HV, h, K, BH, MM, ACC)


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
def level_dot(x, y, MM: tl.constexpr):
    """A batch of products ``[N, M, J] x [N, J, D]``; one of N = 1 as a
    plain ``[M, J] x [J, D]`` (a warpgroup MMA)."""
    if x.shape[0] == 1:
        return tl.reshape(dot(tl.reshape(x, [x.shape[1], x.shape[2]]), tl.reshape(y, [y.shape[1], y.shape[2]]), MM),
                          [1, x.shape[1], y.shape[2]])
    else:
        return dot(x, y, MM)


@triton.jit
def level_pulls(low, b_a, b_b, e, e_n, H: tl.constexpr, CMM: tl.constexpr):
    """Level ``H`` of :func:`channel_pulls` for the pairs' gradient ``low``
    ``[R / 2H, H, H]`` (:func:`pair_levels`): a's side on the second halves'
    rows, b's on the first halves', each ``[R, BKS]`` (zero elsewhere); on
    tensor cores under ``CMM`` at H >= 16, elementwise below."""
    ahead, A, behind, B = level_operands(b_a, b_b, e, e_n, H)
    if H >= 16:
        t_a = level_dot(low, B, CMM)
        t_b = level_dot(tl.permute(low, (0, 2, 1)), A, CMM)
    else:
        t_a = tl.sum(low[:, :, :, None] * B[:, None, :, :], 2)
        t_b = tl.sum(low[:, :, :, None] * A[:, :, None, :], 1)
    zeros = tl.zeros_like(t_a)
    return unhalves(zeros, ahead * t_a), unhalves(behind * t_b, zeros)


@triton.jit
def channel_pulls(l32, l16, l8, l4, l2, l1, l0, a, b, a_rstd, b_rstd, g, gate_params, a_scale, start, length, H_qk,
                  i_hk, HV, i_h, K, col0, BT: tl.constexpr, BKS: tl.constexpr, HAS_NORM: tl.constexpr,
                  GATE: tl.constexpr, ACC: tl.constexpr, CMM: tl.constexpr):
    """The two gradients of :func:`channel_products` for the gradient ``dS``
    ``[BT, BT]`` (zero above the diagonal) of its pairs, at key columns
    ``[col0, col0 + BKS)``: ``sum_j dS_ij b_j exp(G_i - G_j)`` (a's side) and
    ``sum_i dS_ij s_i a_i exp(G_i - G_j)`` (b's side; ``a_scale`` ``[BT]``:
    s), each ``[BT, BKS]`` (``kernels.torch._channel.channel_pulls``). dS
    comes at its dyadic levels ``l32 .. l1`` and diagonal ``l0``
    (:func:`pair_levels`, which a caller walking key slices forms once); each
    level pulls through its anchors as the products take it, on tensor cores
    under ``CMM`` at 32 and 16."""
    tok, _, m_t = chunk_tokens(start, length, BT)
    tok_n, _, m_n = chunk_tokens(start + 1, length - 1, BT)  # each row's next row
    b_a, b_b, e, e_n = slice_rows(a, b, a_rstd, b_rstd, g, gate_params, a_scale, tok, m_t, tok_n, m_n, H_qk, i_hk,
                                  HV, i_h, K, col0, BKS, HAS_NORM, GATE, ACC)
    d_a, d_b = level_pulls(l32, b_a, b_b, e, e_n, 32, CMM)
    x_a, x_b = level_pulls(l16, b_a, b_b, e, e_n, 16, CMM)
    d_a, d_b = d_a + x_a, d_b + x_b
    x_a, x_b = level_pulls(l8, b_a, b_b, e, e_n, 8, CMM)
    d_a, d_b = d_a + x_a, d_b + x_b
    x_a, x_b = level_pulls(l4, b_a, b_b, e, e_n, 4, CMM)
    d_a, d_b = d_a + x_a, d_b + x_b
    x_a, x_b = level_pulls(l2, b_a, b_b, e, e_n, 2, CMM)
    d_a, d_b = d_a + x_a, d_b + x_b
    x_a, x_b = level_pulls(l1, b_a, b_b, e, e_n, 1, CMM)
    return d_a + x_a + l0[:, None] * b_b, d_b + x_b + l0[:, None] * b_a

"""KDA's intra-chunk products in Triton (a gate per key channel): the device
form of ``kernels/torch/_channel.py``, shared by the scores and the WY inverse.

``S_ij = s_i sum_d a_id b_jd exp(Γ_id - Γ_jd)`` for the rows ``j <= i`` of a
chunk comes in two parts. The pairs across sub-chunks are ``[BT, BT]``
products at M = N = BT (warpgroup MMAs), one per anchor ``r_J`` (the last row
of sub-chunk J): the rows after J decayed to it, ``a_i exp(Γ_i - Γ_r)``,
against the rows of J decayed from it, ``b_j exp(Γ_r - Γ_j)``. The pairs
inside a sub-chunk are taken elementwise. Every exponent is a sum of exactly
the gates it spans, none positive, so no factor overflows for any gate and a
``-inf`` gate (a hard reset of one channel) gives an exact zero.

Sub-chunks here have ``SUB`` = 16 rows (``tl.dot``'s least M and N) where the
torch twin's have 8, so the two agree to the rounding of the products'
operands, not bitwise; at 16 they are also the WY inverse's diagonal blocks
(``kernels.torch.prep.INVERSE_BLOCK``), which its substitution takes straight
from the elementwise part."""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import channel_gates, chunk_tokens, dot, load_qk_cols

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

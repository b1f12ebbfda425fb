"""Program #1's WY inverse (Triton): per chunk and value head
``A = (I + strict_lower(diag(beta) K K^T * exp(G_i - G_j)))^-1``, the first
launch of ``prep`` (``kernels.torch.prep`` computes the same A inside its prep).

A program of its own rather than a stage of one prep program: the inverse is a
chain of dependent substitution steps (15 when they ran on the 16-row blocks),
and in an 8-warp prep one program held an SM alone and waited out every step's
latency (the calibrated model, ``benchmarks/roofline.py``: 1.55 ms of prep at
T = 32K, HV = 32, against FLA's 0.57 ms for its two launches). At 4 warps over
key slices of 64, three programs share an SM and hide each other's steps; with
the block merges as batched ``[16, 16]`` and ``[32, 32]`` products
(:func:`merge_pairs`) the model priced it at 324 us (561 with the ``[64, 64]``
merges; 662 at 8 warps), and with the substitution on 8-row halves
(:func:`diagonal_block_inverse`) at 218 us, against 260 for FLA's kkt + solve."""

from __future__ import annotations

import triton
import triton.language as tl

from ..torch.prep import INVERSE_BLOCK
from ._common import (causal_segments, chunk_tokens, dot, load_beta, load_gates, load_qk_cols, operand, rows_reached,
                      store_rows_cols)
from .channel import BKS_CHANNEL as BKS_CHANNEL_INVERSE, across_sub_chunks, channel_products

NUM_WARPS = 4
"""Warps per program (compile_specs --report)."""

MAX_REGISTERS = 168
"""ptxas's registers per thread (``maxnreg``): three 4-warp programs share an
SM up to 168. Uncapped, triton 3.6 gives 175 (two per SM), and capped it
spills nothing (sm_90, bf16, K = V = 128)."""

BKS_INVERSE = 64
"""Key columns per slice of ``K K^T``. On sm_90 (bf16, K = V = 128, triton 3.6)
at 4 warps, with the substitution on the 16-row blocks: 167 registers and three
programs per SM at 64 and at 16, 201 and two at 32 (the calibrated model: 324
against 339 us a launch at T = 32K, HV = 32); at 2 warps slices of 32 spill
228 B per thread."""

BC = tl.constexpr(INVERSE_BLOCK)
"""Diagonal blocks of :func:`unit_lower_inverse` (``kernels.torch.prep.INVERSE_BLOCK``)."""

SUBSTITUTION_BLOCK = INVERSE_BLOCK // 2
"""Blocks solved by substitution (:func:`diagonal_block_inverse` halves each ``BC`` block)."""


@triton.jit
def blocks_of(b_L, BC: tl.constexpr, OFFSET: tl.constexpr):
    """``[BT / BC, BC, BC]``: block ``(a, a - OFFSET)`` of the ``[BT, BT]`` L
    at ``[a]`` (the diagonal blocks at OFFSET 0, those just below at 1; zero
    where ``a < OFFSET``)."""
    NB: tl.constexpr = b_L.shape[0] // BC
    o_b = tl.arange(0, NB)
    m_block = o_b[:, None, None, None] == o_b[None, None, :, None] + OFFSET  # [block, row, block, col]
    return tl.sum(tl.where(m_block, tl.reshape(b_L, [NB, BC, NB, BC]), 0.0), 2)


@triton.jit
def pair_member(x, i: tl.constexpr):
    """``x[2 p + i]`` at ``[p]`` of a ``[2 P, R, C]`` stack."""
    pairs = tl.reshape(x, [x.shape[0] // 2, 2, x.shape[1], x.shape[2]])
    o_m = tl.arange(0, 2)
    return tl.sum(tl.where(o_m[None, :, None, None] == i, pairs, 0.0), 1)


@triton.jit
def halves(b_D):
    """The ``[S, S]`` quarters of a ``[NB, 2 S, 2 S]`` stack that a merge reads:
    the two diagonal ones of each block (``[2 NB, S, S]``, block ``b``'s at
    ``2 b`` and ``2 b + 1``, the pairing of :func:`pair_member`) and the one
    below them (``[NB, S, S]``)."""
    NB: tl.constexpr = b_D.shape[0]
    S: tl.constexpr = b_D.shape[1] // 2
    quarters = tl.reshape(b_D, [NB, 2, S, 2, S])
    o_m = tl.arange(0, 2)
    s, t = o_m[None, :, None, None, None], o_m[None, None, None, :, None]
    diagonal = tl.reshape(tl.sum(tl.where(s == t, quarters, 0.0), 3), [2 * NB, S, S])
    below = tl.sum(tl.sum(tl.where((s == 1) & (t == 0), quarters, 0.0), 3), 1)
    return diagonal, below


@triton.jit
def small_products(a, b):
    """Batched ``[P, M, N] @ [P, N, R]`` by broadcast and sum, exact in the
    operands' dtype (blocks under ``tl.dot``'s 16)."""
    return tl.sum(a[:, :, :, None] * b[:, None, :, :], 2)


@triton.jit
def substitution_inverse(b_D):
    """``(I + D)^-1`` of a ``[NB, S, S]`` stack of strictly lower blocks, by
    forward substitution in the compute dtype: step r solves row r of every
    block at once, ``Ai[r] = e_r - D[r, :r] Ai[:r]``, over ``NB S^2``
    elements (as one packed ``[BT, BT]`` tile, each step was two
    4,096-element reductions, most of them masked zeros). Built as its
    transpose ``AiT[b, i, r] = Ai[b, r, i]`` so that each reduction yields its
    vector in the layout the next broadcast reads."""
    NB: tl.constexpr = b_D.shape[0]
    S: tl.constexpr = b_D.shape[1]
    o_c = tl.arange(0, S)
    eye = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0).to(b_D.dtype)
    b_AiT = tl.broadcast_to(eye[None, :, :], [NB, S, S])
    for r in tl.static_range(1, S):
        b_l = tl.sum(tl.where(o_c[None, :, None] == r, b_D, 0.0), 1)  # [block, j]: row r of each block
        b_a = -tl.sum(b_AiT * b_l[:, None, :], 2)  # [block, i]: rows above r are final, the rest read 0
        b_AiT = tl.where((o_c[None, None, :] == r) & (o_c[None, :, None] != r), b_a[:, :, None], b_AiT)
    return tl.trans(b_AiT, 0, 2, 1)


@triton.jit
def diagonal_block_inverse(b_D):
    """``(I + D)^-1`` of a ``[NB, BC, BC]`` stack of strictly lower blocks, all
    in the compute dtype (no operand rounding): the ``BC / 2`` halves by
    :func:`substitution_inverse`, merged by exact :func:`small_products`. At
    ``BC = 16`` that is 7 dependent steps over 512 elements and two
    ``[8, 8]`` products per block, where substitution over the whole blocks
    took 15 steps over 1,024 (the calibrated model: 92,160 fp32 operations a
    program against 29,696, the WY inverse 325 against 218 us at T = 32K,
    HV = 32)."""
    b_H, b_M = halves(b_D)
    return merge_pairs(substitution_inverse(b_H), b_M, "ieee")


@triton.jit
def merge_pairs(b_Ai, b_M, MM: tl.constexpr):
    """The inverses of ``I + L`` on its ``[2 BC, 2 BC]`` diagonal blocks
    (``[NB / 2, 2 BC, 2 BC]``) from those on its ``[BC, BC]`` ones (``b_Ai``,
    ``[NB, BC, BC]``) and the blocks between each pair (``b_M``,
    ``[NB / 2, BC, BC]``, as the products read them): for
    ``[[M11, 0], [M21, M22]]`` the inverse is ``[[Ai11, 0], [-Ai22 M21 Ai11, Ai22]]``.
    Every pair at once as two batched ``[BC, BC]`` products ``(Ai22 M21) Ai11``,
    at the rounding points of ``kernels.torch.prep.merge_lower_inverse`` (whose
    ``[BT, BT]`` products add exact zeros around these blocks: 34 of the
    inverse's 53 GFLOP at T = 32K, HV = 32 against 3 here); the diagonal
    blocks pass through unrounded."""
    BC: tl.constexpr = b_Ai.shape[1]
    b_E, b_O = pair_member(b_Ai, 0), pair_member(b_Ai, 1)
    if BC < 16:  # under tl.dot's smallest block (diagonal_block_inverse's halves, MM "ieee")
        b_X = small_products(small_products(b_O, b_M), b_E)
    else:
        b_X = dot(dot(b_O, b_M, MM), b_E, MM)
    o_m = tl.arange(0, 2)
    s, t = o_m[None, :, None, None, None], o_m[None, None, None, :, None]  # [pair, s, row, t, col]
    out = tl.where((s == 0) & (t == 0), b_E[:, None, :, None, :],
                   tl.where((s == 1) & (t == 1), b_O[:, None, :, None, :],
                            tl.where((s == 1) & (t == 0), -b_X[:, None, :, None, :], 0.0)))
    return tl.reshape(out, [b_M.shape[0], 2 * BC, 2 * BC])


@triton.jit
def unit_lower_inverse(b_L, BC: tl.constexpr, MM: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower ``[BT, BT]`` L (``BT = 4 BC``): the
    ``BC`` diagonal blocks by substitution (:func:`diagonal_block_inverse`),
    then merged to ``2 BC`` and ``4 BC`` (:func:`merge_pairs`) with products
    under the rule ``MM``, as ``kernels.torch.prep.unit_lower_inverse``. A
    non-finite entry of L is zeroed and its row and every row after it made
    NaN (:func:`rows_reached`): the products would spread ``0 * inf`` to rows
    before it, and row i of the inverse depends on rows ``<= i`` of L only."""
    finite = (b_L - b_L) == 0.0
    m_reached = rows_reached(finite)  # [BT] rather than the [BT, BT] mask live through the products
    b_L = tl.where(finite, b_L, 0.0)
    return blocked_lower_inverse(b_L, blocks_of(b_L, BC, 0), m_reached, MM)


@triton.jit
def blocked_lower_inverse(b_L, b_D, m_reached, MM: tl.constexpr):
    """:func:`unit_lower_inverse` from finite parts: the ``[BT, BT]`` L (its
    blocks below the ``[BC, BC]`` diagonal ones are read), the diagonal
    blocks ``b_D`` ``[4, BC, BC]`` and the rows to make NaN ``m_reached``
    ``[BT]``."""
    BC: tl.constexpr = b_D.shape[1]
    BT: tl.constexpr = b_L.shape[0]
    tl.static_assert(BT == 4 * BC)
    # The merges' operands first, in their operand dtype (bf16 for bf16 inputs), so the
    # fp32 L is not live through the substitution and the products.
    b_M1 = operand(pair_member(blocks_of(b_L, BC, 1), 1), MM)  # blocks (1, 0) and (3, 2)
    b_M2 = operand(pair_member(blocks_of(b_L, 2 * BC, 1), 1), MM)  # block (1, 0) at 2 BC
    b_Ai = diagonal_block_inverse(b_D)
    b_Ai = merge_pairs(merge_pairs(b_Ai, b_M1, MM), b_M2, MM)  # [2, 2 BC, 2 BC], then [1, BT, BT]
    return tl.where(m_reached[:, None], float("nan"), tl.reshape(b_Ai, [BT, BT]))


@triton.jit
def wy_inverse_kernel(
    k, g, gate_params, beta, chunk_table, k_rstd, A_out,
    n_chunks, H_qk, HV, K,
    BT: tl.constexpr, BKS: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
):
    """One chunk of one value head; grid (NC, HV). ``L = (diag(beta) K) K^T``
    summed over key slices of ``BKS`` (each slice's operands rounded as the
    whole tile's would be), then decayed and masked as ``causal_scores``."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    b_g, _, _ = load_gates(g, gate_params, tok, m_t, HV, i_h, GATE, ACC)
    b_beta, _ = load_beta(beta, tok, m_t, HV, i_h, BETA_SIGMOID, BETA_SCALE, ACC)
    b_kk = tl.zeros([BT, BT], dtype=ACC)
    for col in range(0, K, BKS):
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, col, BKS, HAS_NORM, ACC)
        b_kk += dot(b_beta[:, None] * b_k, tl.trans(b_k), MM)
    segment, keep = causal_segments(b_g, True)
    b_A = unit_lower_inverse(tl.where(keep, b_kk * tl.exp(segment), 0.0), BC, MM)
    store_rows_cols(A_out, b_A, tok, m_t, HV, i_h, BT, 0, BT)


@triton.jit
def channel_wy_inverse_kernel(
    k, g, gate_params, beta, chunk_table, k_rstd, A_out,
    n_chunks, H_qk, HV, K,
    BT: tl.constexpr, BKS: tl.constexpr, HAS_NORM: tl.constexpr, GATE: tl.constexpr,
    BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
    CMM: tl.constexpr,
):
    """:func:`wy_inverse_kernel` for a gate per key channel (KDA); grid (NC, HV).
    ``L_ij = beta_i sum_d k_id k_jd exp(Γ_id - Γ_jd)`` (``i > j``) from
    :func:`~.channel.channel_products` under ``CMM``
    (``kernels.precision.channel_mode``), its sub-chunks of ``BC`` rows the
    inverse's diagonal blocks, whose substitution reads them as they come;
    the merges under ``MM``, as ``kernels.torch.prep`` takes them."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    b_beta, _ = load_beta(beta, tok, m_t, HV, i_h, BETA_SIGMOID, BETA_SCALE, ACC)
    p32, p16, b_D = channel_products(k, k, k_rstd, k_rstd, g, gate_params, b_beta, start, length, H_qk, i_hk, HV,
                                     i_h, K, BT, BC, BKS, HAS_NORM, GATE, True, ACC, CMM)
    b_L = across_sub_chunks(p32, p16)
    finite_L, finite_D = (b_L - b_L) == 0.0, (b_D - b_D) == 0.0
    # the rows a non-finite entry reaches (rows_reached over both parts)
    bad = tl.max(tl.where(finite_L, 0, 1), 1) + tl.reshape(tl.max(tl.where(finite_D, 0, 1), 2), [BT])
    b_A = blocked_lower_inverse(tl.where(finite_L, b_L, 0.0), tl.where(finite_D, b_D, 0.0),
                                tl.cumsum(bad, 0) > 0, MM)
    store_rows_cols(A_out, b_A, tok, m_t, HV, i_h, BT, 0, BT)

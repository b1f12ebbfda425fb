"""Program #1's WY inverse (Triton): per chunk and value head
``A = (I + strict_lower(diag(beta) K K^T * exp(G_i - G_j)))^-1``, the first
launch of ``prep`` (``kernels.torch.prep`` computes the same A inside its prep).

A program of its own rather than a stage of prep's W, U program: the inverse is
a chain of 15 dependent substitution steps, and at the 8 warps W and U need one
program holds an SM alone and waits out every step's latency (the calibrated
model, ``benchmarks/roofline.py``: 1.5 ms of prep at T = 32K, HV = 32, against
FLA's 0.57 ms for its two launches). Here, at 4 warps over key slices of 32,
several programs share an SM and hide each other's steps."""

from __future__ import annotations

import triton
import triton.language as tl

from ..torch.prep import INVERSE_BLOCK
from ._common import (causal_segments, chunk_rows, dot, load_beta, load_gates, load_qk_cols, operand, rows_reached,
                      store_rows_cols)

NUM_WARPS = 4
"""Warps per program (compile_specs --report)."""

BKS_INVERSE = 32
"""Key columns per slice of ``K K^T`` (the whole ``[64, K]`` k tile in fp32 would
take 64 registers a thread at 4 warps)."""

BC = tl.constexpr(INVERSE_BLOCK)
"""Diagonal blocks of :func:`unit_lower_inverse` (``kernels.torch.prep.INVERSE_BLOCK``)."""


@triton.jit
def diagonal_block_inverse(b_L, BC: tl.constexpr):
    """``(I + L)^-1`` on the ``[BC, BC]`` diagonal blocks of a strictly lower
    ``[BT, BT]`` L (zero off them), by forward substitution in the compute dtype.
    The blocks are taken out as one ``[BT / BC, BC, BC]`` tensor, so step r
    solves row r of every block at once, ``Ai[r] = e_r - L[r, :r] Ai[:r]``,
    over ``BT BC`` elements: a quarter of the ``[BT, BT]`` reductions of the
    packed 2-D form, whose masked zeros were most of its work (prep's
    substitution was 15 steps of two 4,096-element reductions; the spill
    stores of the one-kernel prep at 8 warps on sm_90 fell 52 -> 20 B per
    thread with it). Built as its transpose ``AiT[b, i, r] = Ai[b, r, i]`` so
    that each reduction yields its vector in the layout the next broadcast reads."""
    BT: tl.constexpr = b_L.shape[0]
    NB: tl.constexpr = BT // BC
    o_b = tl.arange(0, NB)
    same = o_b[:, None, None, None] == o_b[None, None, :, None]  # [block, row, block, col]
    b_D = tl.sum(tl.where(same, tl.reshape(b_L, [NB, BC, NB, BC]), 0.0), 2)  # [block, row, col]
    o_c = tl.arange(0, BC)
    eye = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0).to(b_L.dtype)
    b_AiT = tl.broadcast_to(eye[None, :, :], [NB, BC, BC])
    for r in tl.static_range(1, BC):
        b_l = tl.sum(tl.where(o_c[None, :, None] == r, b_D, 0.0), 1)  # [block, j]: row r of each block
        b_a = -tl.sum(b_AiT * b_l[:, None, :], 2)  # [block, i]: rows above r are final, the rest read 0
        b_AiT = tl.where((o_c[None, None, :] == r) & (o_c[None, :, None] != r), b_a[:, :, None], b_AiT)
    b_Ai = tl.where(same, tl.trans(b_AiT, 0, 2, 1)[:, :, None, :], 0.0)  # back on the diagonal of [BT, BT]
    return tl.reshape(b_Ai, [BT, BT])


@triton.jit
def merge_operand(b_L, BC: tl.constexpr, MM: tl.constexpr):
    """The ``M21`` blocks that :func:`merge_lower_inverse` reads at ``BC``: L on
    its ``[2 BC, 2 BC]`` diagonal blocks but off the ``[BC, BC]`` ones (zero
    elsewhere), already as the products read it (:func:`operand`)."""
    o_i = tl.arange(0, b_L.shape[0])
    m_pair = o_i[:, None] // (2 * BC) == o_i[None, :] // (2 * BC)
    m_21 = m_pair & (o_i[:, None] // BC != o_i[None, :] // BC)
    return operand(tl.where(m_21, b_L, 0.0), MM)


@triton.jit
def merge_lower_inverse(b_Ai, b_M, MM: tl.constexpr):
    """The inverses of ``I + L`` on its ``[2 BC, 2 BC]`` diagonal blocks from
    those on its ``[BC, BC]`` ones (``b_Ai``, zero off them) and the ``M21``
    blocks ``b_M`` (:func:`merge_operand`): for ``[[M11, 0], [M21, M22]]`` the
    inverse is ``[[Ai11, 0], [-Ai22 M21 Ai11, Ai22]]``. Every block pair at once
    as two ``[BT, BT]`` tensor-core products, ``(Ai M21) Ai``, the zeros of both
    operands adding exact zeros; the diagonal blocks of ``b_Ai`` pass through
    unrounded."""
    return b_Ai - dot(dot(b_Ai, b_M, MM), b_Ai, MM)


@triton.jit
def unit_lower_inverse(b_L, BC: tl.constexpr, MM: tl.constexpr):
    """``(I + L)^-1`` of a strictly lower ``[BT, BT]`` L (``BT = 4 BC``): the
    ``BC`` diagonal blocks by substitution (:func:`diagonal_block_inverse`),
    then merged to ``2 BC`` and ``4 BC`` (:func:`merge_lower_inverse`) with
    products under the rule ``MM``, as ``kernels.torch.prep.unit_lower_inverse``.
    A non-finite entry of L is zeroed and its row and every row after it made
    NaN (:func:`rows_reached`): the products would spread ``0 * inf`` to rows
    before it, and row i of the inverse depends on rows ``<= i`` of L only."""
    tl.static_assert(b_L.shape[0] == 4 * BC)
    finite = (b_L - b_L) == 0.0
    m_reached = rows_reached(finite)  # [BT] rather than the [BT, BT] mask live through the products
    b_L = tl.where(finite, b_L, 0.0)
    # The merges' operands first, in their operand dtype (bf16 for bf16 inputs), so the
    # fp32 L is not live through the substitution and the products: prep's spill stores
    # on sm_90 152 -> 52 B per thread.
    b_M1 = merge_operand(b_L, BC, MM)
    b_M2 = merge_operand(b_L, 2 * BC, MM)
    b_Ai = diagonal_block_inverse(b_L, BC)
    b_Ai = merge_lower_inverse(b_Ai, b_M1, MM)
    b_Ai = merge_lower_inverse(b_Ai, b_M2, MM)
    return tl.where(m_reached[:, None], float("nan"), b_Ai)


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
    start, length, o_t, m_t = chunk_rows(chunk_table, n_chunks, i_c, BT)
    tok = start + o_t
    b_g, _, _ = load_gates(g, gate_params, tok, m_t, HV, i_h, GATE, ACC)
    b_beta, _ = load_beta(beta, tok, m_t, HV, i_h, BETA_SIGMOID, BETA_SCALE, ACC)
    b_kk = tl.zeros([BT, BT], dtype=ACC)
    for col in range(0, K, BKS):
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, i_hk, K, col, BKS, HAS_NORM, ACC)
        b_kk += dot(b_beta[:, None] * b_k, tl.trans(b_k), MM)
    segment, keep = causal_segments(b_g, True)
    b_A = unit_lower_inverse(tl.where(keep, b_kk * tl.exp(segment), 0.0), BC, MM)
    store_rows_cols(A_out, b_A, tok, m_t, HV, i_h, BT, 0, BT)

"""Triton helpers shared by the programs: chunk rows, decays, tile loads.

Layouts are the torch programs' (token layout ``[T, H, D]``, contiguous);
addresses are int64. ``ACC`` is the compute dtype (fp32, or fp64 for fp64
inputs); every ``tl.dot`` runs in it with ``input_precision="ieee"`` so the
Triton programs agree with their torch twins to fp32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import CHUNK_SIZE

BT = CHUNK_SIZE


def acc_dtype(t: torch.Tensor):
    """The Triton compute dtype of a program whose tapes are ``t``'s dtype."""
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def head_block(d: int) -> int:
    """A whole head dim as one tile (``tl.dot`` wants at least 16)."""
    return max(16, triton.next_power_of_2(d))


def value_block(V: int) -> int:
    """Value tiles of at most 64 columns: a ``[K, BV]`` fp32 state stays in registers."""
    return min(64, head_block(V))


@triton.jit
def dot(a, b):
    """Matrix product in the operands' dtype (fp32 without TF32 rounding)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def chunk_rows(chunk_table, n_chunks, c, BT: tl.constexpr):
    """Chunk ``c``: first token (int64), length, row offsets, valid rows."""
    start = tl.load(chunk_table + c).to(tl.int64)
    length = tl.load(chunk_table + n_chunks + c)
    o_t = tl.arange(0, BT)
    return start, length, o_t, o_t < length


@triton.jit
def load_rows(ptr, tok, m_t, H, h, D, BD: tl.constexpr, ACC: tl.constexpr):
    """Rows ``tok`` of head ``h`` of a ``[T, H, D]`` tensor as ``[BT, BD]`` (zero padded)."""
    o_d = tl.arange(0, BD)
    p = ptr + (tok[:, None] * H + h) * D + o_d[None, :]
    return tl.load(p, mask=m_t[:, None] & (o_d[None, :] < D), other=0.0).to(ACC)


@triton.jit
def load_rows_cols(ptr, tok, m_t, H, h, D, col0, BD: tl.constexpr, ACC: tl.constexpr):
    """Columns ``[col0, col0 + BD)`` of rows ``tok`` of head ``h`` of ``[T, H, D]``."""
    o_d = col0 + tl.arange(0, BD)
    p = ptr + (tok[:, None] * H + h) * D + o_d[None, :]
    return tl.load(p, mask=m_t[:, None] & (o_d[None, :] < D), other=0.0).to(ACC)


@triton.jit
def store_rows_cols(ptr, x, tok, m_t, H, h, D, col0, BD: tl.constexpr):
    o_d = col0 + tl.arange(0, BD)
    p = ptr + (tok[:, None] * H + h) * D + o_d[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=m_t[:, None] & (o_d[None, :] < D))


@triton.jit
def load_scalars(ptr, tok, m_t, H, h, ACC: tl.constexpr):
    """Per-token scalars of head ``h`` of a ``[T, H]`` tensor (zero padded)."""
    return tl.load(ptr + tok * H + h, mask=m_t, other=0.0).to(ACC)


@triton.jit
def load_gates(gcum, tok, length, start, H, h, ACC: tl.constexpr):
    """Gate cumsum of the chunk, padded rows holding the last value, and that value."""
    last = tl.load(gcum + (start + length - 1) * H + h).to(ACC)
    G = tl.load(gcum + tok * H + h, mask=tok < start + length, other=0.0).to(ACC)
    G = tl.where(tok < start + length, G, last)
    return G, last


@triton.jit
def load_qk(ptr, rstd, tok, m_t, H_qk, hk, K, BK: tl.constexpr, HAS_NORM: tl.constexpr, ACC: tl.constexpr):
    """q or k rows of key head ``hk``, L2-normalised when ``HAS_NORM``."""
    x = load_rows(ptr, tok, m_t, H_qk, hk, K, BK, ACC)
    if HAS_NORM:
        x = x * tl.load(rstd + tok * H_qk + hk, mask=m_t, other=0.0).to(ACC)[:, None]
    return x


@triton.jit
def causal_decay(G, STRICT: tl.constexpr):
    """``exp(G_i - G_j)`` on ``i >= j`` (``i > j`` when STRICT), zero above."""
    o_i = tl.arange(0, G.shape[0])
    if STRICT:
        keep = o_i[:, None] > o_i[None, :]
    else:
        keep = o_i[:, None] >= o_i[None, :]
    return tl.where(keep, tl.exp(tl.where(keep, G[:, None] - G[None, :], 0.0)), 0.0)


@triton.jit
def load_state(ptr, row, H, h, K, V, col0, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    """``[BK, BV]`` tile (columns from ``col0``) of state ``row`` of an ``[N, H, K, V]`` tensor."""
    o_k = tl.arange(0, BK)
    o_v = col0 + tl.arange(0, BV)
    p = ptr + ((row * H + h).to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    return tl.load(p, mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0.0).to(ACC)


@triton.jit
def store_state(ptr, x, row, H, h, K, V, col0, BK: tl.constexpr, BV: tl.constexpr):
    o_k = tl.arange(0, BK)
    o_v = col0 + tl.arange(0, BV)
    p = ptr + ((row * H + h).to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=(o_k[:, None] < K) & (o_v[None, :] < V))


@triton.jit
def store_state_strided(ptr, x, h, stride_h, stride_k, K, V, col0, BK: tl.constexpr, BV: tl.constexpr):
    """Store a ``[BK, BV]`` tile of head ``h`` into a strided ``[1, H, K, V]``
    view (a column slice of a wider pool)."""
    o_k = tl.arange(0, BK)
    o_v = col0 + tl.arange(0, BV)
    p = ptr + h.to(tl.int64) * stride_h + o_k[:, None] * stride_k + o_v[None, :]
    tl.store(p, x.to(ptr.dtype.element_ty), mask=(o_k[:, None] < K) & (o_v[None, :] < V))


@triton.jit
def frag_info(frag_table, n_frag, f):
    """Fragment ``f``: first chunk, chunk count, document, crossing flags."""
    first = tl.load(frag_table + 2 * n_frag + f)
    count = tl.load(frag_table + 3 * n_frag + f)
    doc = tl.load(frag_table + 4 * n_frag + f)
    flags = tl.load(frag_table + 5 * n_frag + f)
    return first, count, doc, flags


@triton.jit
def walk_operands(k, k_rstd, w, gcum, chunk_table, n_chunks, c, H_qk, hk, HV, h, K,
                  BT: tl.constexpr, BK: tl.constexpr, HAS_NORM: tl.constexpr, ACC: tl.constexpr):
    """What one step of a walk over chunk ``c`` reads: rows, W,
    ``diag(gamma_C / gamma) K`` and ``gamma_C``."""
    start, length, o_t, m_t = chunk_rows(chunk_table, n_chunks, c, BT)
    tok = start + o_t
    G, last = load_gates(gcum, tok, length, start, HV, h, ACC)
    b_k = load_qk(k, k_rstd, tok, m_t, H_qk, hk, K, BK, HAS_NORM, ACC)
    b_w = load_rows_cols(w, tok, m_t, HV, h, K, 0, BK, ACC)
    return tok, m_t, G, b_w, tl.exp(last - G)[:, None] * b_k, tl.exp(last)


@triton.jit
def chunk_scores(q, k, gcum, q_rstd, k_rstd, chunk_table, n_chunks, c, H_qk, hk, HV, h, K,
                 BT: tl.constexpr, BK: tl.constexpr, HAS_NORM: tl.constexpr, ACC: tl.constexpr):
    """Chunk ``c`` of head ``h``: rows, gates, q, and the decayed causal scores
    ``P = (Q K^T) * exp(G_i - G_j) * [i >= j]`` (output and local dv read them)."""
    start, length, o_t, m_t = chunk_rows(chunk_table, n_chunks, c, BT)
    tok = start + o_t
    G, _ = load_gates(gcum, tok, length, start, HV, h, ACC)
    b_q = load_qk(q, q_rstd, tok, m_t, H_qk, hk, K, BK, HAS_NORM, ACC)
    b_k = load_qk(k, k_rstd, tok, m_t, H_qk, hk, K, BK, HAS_NORM, ACC)
    return tok, m_t, G, b_q, dot(b_q, tl.trans(b_k)) * causal_decay(G, False)

"""The walks' decayed operands with a gate per key channel (Triton), once a
chunk and value head; one program per (chunk, value head). Same signature as
``kernels.torch.channel_decays``.

A walk program holds one value tile of ``walk_block(V)`` columns, so each of
the ``V / BV`` programs of a value head formed K's and Q's decays itself, a
reverse and a forward scan and two exponentials an element of the chunk, four
times over at V = 128. Here they are formed once, by the very functions the
walks ran (:func:`channel.channel_key_half`, :func:`channel.channel_decayed_rows`:
the same values, bit for bit), and stored as the products read them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import BT, acc_dtype, chunk_tokens, head_block, launch, mm_mode, pointer, store_rows_cols
from .channel import channel_decayed_rows, channel_key_half

BKD = 64
"""Key columns a program forms at a time (its tiles ``[BT, BKD]``)."""
NUM_WARPS = 8
"""Warps per program."""


@triton.jit
def channel_decays_kernel(
    q, k, g, gate_params, q_rstd, k_rstd, chunk_table, k_decayed, q_decayed, chunk_decay,
    n_chunks, H_qk, HV, K,
    BT: tl.constexpr, BKD: tl.constexpr, HAS_Q: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    GATE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr,
):
    """One chunk of one value head; grid (n_chunks, HV)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    for col0 in range(0, K, BKD):
        b_k, gamma = channel_key_half(k, k_rstd, g, gate_params, tok, m_t, length, H_qk, i_hk, HV, i_h, K, col0, BKD,
                                      HAS_K_NORM, GATE, MM, ACC)
        store_rows_cols(k_decayed, b_k, tok, m_t, HV, i_h, K, col0, BKD)
        o_k = col0 + tl.arange(0, BKD)
        tl.store(chunk_decay + (i_c * HV + i_h).to(tl.int64) * K + o_k, gamma, mask=o_k < K)
        if HAS_Q:
            b_q = channel_decayed_rows(q, q_rstd, g, gate_params, tok, m_t, H_qk, i_hk, HV, i_h, K, col0, BKD,
                                       HAS_Q_NORM, GATE, MM, ACC)
            store_rows_cols(q_decayed, b_q, tok, m_t, HV, i_h, K, col0, BKD)


def channel_decays(
    q: torch.Tensor | None,
    k: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    k_decayed_out: torch.Tensor,
    q_decayed_out: torch.Tensor | None,
    chunk_decay_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.channel_decays``."""
    if g.dim() != 3:
        raise ValueError(f"channel_decays takes a gate per key channel [T, HV, K], got g of shape {tuple(g.shape)}")
    if index.n_chunks == 0:
        return
    H_qk, K = k.shape[1], k.shape[2]
    HV = g.shape[1]
    launch(channel_decays_kernel)[(index.n_chunks, HV)](
        pointer(q, k), k, g, pointer(gate_params, g), pointer(q_rstd, g), pointer(k_rstd, g), index.chunk_table,
        k_decayed_out, pointer(q_decayed_out, k_decayed_out), chunk_decay_out,
        index.n_chunks, H_qk, HV, K,
        BT=BT, BKD=min(BKD, head_block(K)), HAS_Q=q is not None, HAS_Q_NORM=q_rstd is not None,
        HAS_K_NORM=k_rstd is not None, GATE=gate_params is not None, ACC=acc_dtype(k), MM=mm_mode(k),
        num_warps=NUM_WARPS,
    )

"""Backward (Triton): the local dv_new, ``scale (Q K^T * D)^T dO``; one program
per chunk and value head, or pair of value heads of one key head
(:func:`._common.heads_per_program`), that walks the value tiles, so q, k and
``Q K^T`` are loaded and formed once per chunk and program (with a program per
value tile they were once per tile: 1.63 against 1.08 GB moved at the
roofline's shape). Same signature as ``kernels.torch.bwd_local_dv``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ..precision import channel_mode, matmul_mode
from ._common import (BT, acc_dtype, chunk_qk, chunk_tokens, decayed_scores, dot, head_block, heads_per_program, launch,
                      load_rows_cols, mm_mode, pointer, register_cap, store_rows_cols)
from .channel import BKS_CHANNEL, channel_products, pair_matrix
from .scores import SUB_ROWS


NUM_WARPS = 4
"""Warps per program. On sm_90 (bf16, K = V = 128, triton 3.6) with key slices
of 32 and value tiles of 32 it takes 224 registers and spills nothing: two
programs share an SM, which the calibrated model prices at 354 us a launch at
T = 32K, HV = 32 (whole q and k tiles at 8 warps: 255 registers, one program
per SM, 467 us; FLA's 297)."""
BKS_LOCAL_DV = 16
"""Key columns per slice of Q and K: at 32, 224 registers (two programs per
SM) and 80 B of spills per thread when capped at 168 (sm_90, triton 3.6)."""
BV_LOCAL_DV = 32
"""Value columns per tile of dO and dv."""


def max_registers(constexprs) -> int | None:
    """ptxas's cap per thread (``maxnreg``) for the program of ``constexprs``.
    A program of one value head at 128: 4 warps, four programs per SM, no
    spill under triton 3.6 (106 registers; 150 uncapped:
    three per SM, 317 us a launch at the roofline's shape). A
    pair of value heads (``SHARE = 2``, :func:`._common.heads_per_program`)
    at 168: three programs per SM, no spill (sm_90, bf16, K = V = 128, triton
    3.6 and 3.9; 232 registers uncapped, two per SM). The calibrated model:
    237 us a launch at T = 32K, H_qk = 16, HV = 32, against 265 uncapped and
    298 with a program per value head. (Compiled without the head dims'
    divisibility the pair took 239 registers, and spilled 92 B per thread
    capped at 200, 220 B at 168.) With a gate per key channel, no cap (None): ``channel.channel_products``
    holds the ``[BT, BT]`` pairs beside a sub-chunk's ``[16, 16, BKS]``
    elementwise ones, as ``output_kernel``'s channel form does uncapped."""
    if constexprs["CHANNEL"]:
        return None
    return 128 if constexprs["SHARE"] == 1 else 168


@triton.jit
def bwd_local_dv_kernel(
    q, k, g, gate_params, do, dv, q_rstd, k_rstd, chunk_table, scale,
    n_chunks, H_qk, HV, K, V,
    BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr, SHARE: tl.constexpr, HAS_NORM: tl.constexpr,
    GATE: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr, CHANNEL: tl.constexpr, SUB: tl.constexpr,
    CMM: tl.constexpr,
):
    """One chunk of ``SHARE`` value heads of one key head (GVA): ``Q K^T``
    once, then each head's decayed scores against its value tiles; grid
    (NC, HV / SHARE). With ``CHANNEL`` (KDA; ``SHARE`` = 1) g holds a gate per
    key channel ``[T, HV, K]`` and the scores are the output's,
    ``channel.channel_products`` (dyadic anchors) under ``CMM``."""
    i_c, i_p = tl.program_id(0), tl.program_id(1)
    i_hk = i_p * SHARE // (HV // H_qk)
    start, length = tl.load(chunk_table + i_c), tl.load(chunk_table + n_chunks + i_c)
    tok, o_t, m_t = chunk_tokens(start, length, BT)
    if not CHANNEL:
        b_qk = chunk_qk(q, k, q_rstd, k_rstd, tok, m_t, H_qk, i_hk, K, BT, BKS, HAS_NORM, ACC, MM)
    for i_s in tl.static_range(SHARE):
        i_h = i_p * SHARE + i_s
        if CHANNEL:
            p32, p16, b_D = channel_products(q, k, q_rstd, k_rstd, g, gate_params, tl.full([BT], 1.0, ACC), start,
                                             length, H_qk, i_hk, HV, i_h, K, BT, SUB, BKS, HAS_NORM, GATE, False, ACC,
                                             CMM)
            b_scores_t = tl.trans(pair_matrix(p32, p16, b_D))
        else:
            b_scores_t = tl.trans(decayed_scores(b_qk, g, gate_params, tok, m_t, HV, i_h, GATE, ACC))
        for col in range(0, V, BV):
            b_do = load_rows_cols(do, tok, m_t, HV, i_h, V, col, BV, ACC)
            store_rows_cols(dv, scale * dot(b_scores_t, b_do, MM), tok, m_t, HV, i_h, V, col, BV)


def bwd_local_dv(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    do: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    dv_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.bwd_local_dv``."""
    H_qk, K = q.shape[1], q.shape[2]
    HV, V = do.shape[1], do.shape[2]
    if index.n_chunks == 0:
        return
    BV = min(BV_LOCAL_DV, head_block(V))
    channel = g.dim() == 3
    share = 1 if channel else heads_per_program(H_qk, HV)
    bks = min(BKS_CHANNEL if channel else BKS_LOCAL_DV, head_block(K))
    constexprs = dict(BT=BT, BKS=bks, BV=BV, SHARE=share, HAS_NORM=q_rstd is not None, GATE=gate_params is not None,
                      ACC=acc_dtype(k), MM=mm_mode(k), CHANNEL=channel, SUB=SUB_ROWS,
                      CMM=channel_mode(matmul_mode(k.dtype)))
    cap = max_registers(constexprs)
    launch(bwd_local_dv_kernel)[(index.n_chunks, HV // share)](
        q, k, g, pointer(gate_params, g), do, dv_out, pointer(q_rstd, g), pointer(k_rstd, g),
        index.chunk_table, scale, index.n_chunks, H_qk, HV, K, V,
        **constexprs, num_warps=NUM_WARPS, **({} if cap is None else register_cap(cap)),
    )

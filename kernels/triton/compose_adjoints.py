"""Segments, phase 2 (backward, Triton): compose each fragment's adjoint rows,
last first, ``Y_p = M_p^T Y_p+1 + nu_p`` from its end adjoint; one program per
(fragment, value head, value tile). Same signature as
``kernels.torch.compose_adjoints``. Exact products in the compute dtype, as in
``compose_segments`` (the adjoints of the states stay fp32 too)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (acc_dtype, exact_product, frag_info, head_block, launch, load_state, pointer, store_state,
                      store_state_strided, value_block)
from .compose_segments import BKB_COMPOSE, BV_COMPOSE

NUM_WARPS = 8
"""Warps per program (see compile_specs --report)."""


@triton.jit
def compose_adjoints_kernel(
    nu, summary, frag_table, frag_rows, d_final, lam, end, out, stride_h, stride_k,
    n_frag, max_rows, HV, K, V,
    BK: tl.constexpr, BV: tl.constexpr, BKB: tl.constexpr, HAS_FINAL: tl.constexpr, HAS_LAM: tl.constexpr,
    HAS_END: tl.constexpr, HAS_OUT: tl.constexpr, FIRST_ONLY: tl.constexpr, ACC: tl.constexpr,
):
    """Grid (n_frag, HV, V / BV); with ``FIRST_ONLY`` the first axis is 1 and the
    program composes fragment 0 alone (its fold into ``out``, the KCP ``nu``).
    ``end`` gets each row's end adjoint; ``out`` fragment 0's start adjoint
    when it crosses in (zero otherwise: the identity of the composition)."""
    i_h, i_v = tl.program_id(1), tl.program_id(2)
    col = i_v * BV
    if FIRST_ONLY:
        i_f = 0
    else:
        i_f = tl.program_id(0)
    _first, _count, _initial_row, flags = frag_info(frag_table, n_frag, i_f)
    # the summary rows, read here: stores address them (_common.chunk_tokens' note)
    first_row, count = tl.load(frag_rows + i_f), tl.load(frag_rows + n_frag + i_f)
    keep = ((flags & 5) == 1) & (count > 0)  # crosses in (a sentinel: never)
    n_steps = tl.minimum(count, max_rows)
    if FIRST_ONLY:
        n_steps = tl.where(keep, n_steps, 0)
    Y = tl.zeros([BK, BV], dtype=ACC)
    if HAS_FINAL:
        if (flags & 2) == 0:
            Y = load_state(d_final, i_f, HV, i_h, K, V, col, BK, BV, ACC)
    if HAS_LAM:
        if (flags & 2) != 0:
            Y = load_state(lam, 0, HV, i_h, K, V, col, BK, BV, ACC)
    for p in range(0, n_steps):
        row = first_row + count - 1 - p
        if HAS_END:
            store_state(end, Y, row, HV, i_h, K, V, col, BK, BV)
        Y = exact_product(summary, row, HV, i_h, K, V, Y, BK, BV, BKB, True, ACC) + load_state(
            nu, row, HV, i_h, K, V, col, BK, BV, ACC)
    if HAS_OUT:
        if i_f == 0:
            store_state_strided(out, tl.where(keep, Y, 0.0), i_h, stride_h, stride_k, K, V, 0, col, BK, BV)


def compose_adjoints(
    nu: torch.Tensor,
    summary: torch.Tensor,
    index: ChunkIndex,
    frag_rows: torch.Tensor,
    max_rows: int,
    *,
    d_final_state: torch.Tensor | None,
    lam: torch.Tensor | None,
    end_out: torch.Tensor | None,
    nu_out: torch.Tensor | None,
) -> None:
    """See ``kernels.torch.compose_adjoints`` (nu_out may be a strided view)."""
    HV, K, V = nu.shape[1], nu.shape[2], nu.shape[3]
    if index.n_frag == 0:  # nothing crosses in: the identity
        if nu_out is not None:
            nu_out.zero_()
        return
    if end_out is None and nu_out is None:
        return
    has_final = d_final_state is not None and d_final_state.shape[0] > 0
    first_only = end_out is None
    BV = min(BV_COMPOSE, value_block(V))
    launch(compose_adjoints_kernel)[(1 if first_only else index.n_frag, HV, triton.cdiv(V, BV))](
        nu, summary, index.frag_table, frag_rows, d_final_state if has_final else nu, pointer(lam, nu),
        pointer(end_out, nu), pointer(nu_out, nu),
        nu_out.stride(1) if nu_out is not None else 0, nu_out.stride(2) if nu_out is not None else 0,
        index.n_frag, max_rows if nu.shape[0] else 0, HV, K, V,
        BK=head_block(K), BV=BV, BKB=min(BKB_COMPOSE, head_block(K)), HAS_FINAL=has_final, HAS_LAM=lam is not None,
        HAS_END=end_out is not None, HAS_OUT=nu_out is not None, FIRST_ONLY=first_only, ACC=acc_dtype(nu),
        num_warps=NUM_WARPS,
    )

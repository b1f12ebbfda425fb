"""Segments, phase 2 (forward, Triton): compose each fragment's summary rows in
order, ``X_p+1 = M_p X_p + S_p`` from its start state; one program per
(fragment, value head, value tile). Same signature as
``kernels.torch.compose_segments``.

The products are exact in the compute dtype (``input_precision="ieee"``, fp32
FMA, not tensor cores): the states and M are never rounded to bf16 or tf32
(docs/design.md: every M and every state that crosses a boundary stays fp32),
and an error in a carry reaches every later segment of the fragment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..chunk_index import ChunkIndex
from ._common import (acc_dtype, exact_product, frag_info, head_block, last_real_fragment, launch, load_state,
                      load_state_cols, pointer, store_state, store_state_strided, value_block)
from .summary_walk import BF

BKB_COMPOSE = 16
BV_COMPOSE = 16
"""K blocks and value tiles of the exact products (:func:`exact_product`): an
FMA product holds its operands' rows and columns per thread, so the tiles are
small. At K = 128, 8 warps, sm_90 (compile_specs --report): value tiles of 16
spill nothing, of 32 20-24 B per thread, of 64 300-500 B; one K-long product
(no K blocks) spilled 15-19 KB."""

NUM_WARPS = 8
"""Warps per program (see compile_specs --report)."""


@triton.jit
def compose_segments_kernel(
    summary, frag_table, frag_rows, initial_state, s_in, start, final_state, out, stride_h, stride_k, out_col,
    n_frag, max_rows, HV, K, V, WIDTH,
    BK: tl.constexpr, BV: tl.constexpr, BKB: tl.constexpr, HAS_INITIAL: tl.constexpr, HAS_S_IN: tl.constexpr,
    HAS_START: tl.constexpr, HAS_FINAL: tl.constexpr, HAS_OUT: tl.constexpr, LAST_ONLY: tl.constexpr,
    IS_M: tl.constexpr, ACC: tl.constexpr,
):
    """Grid (n_frag, HV, WIDTH / BV); with ``LAST_ONLY`` the first axis is 1 and
    the program composes the last real fragment alone (its fold into ``out``,
    the KCP summary). WIDTH = V: the states (``start`` gets each row's start,
    ``final_state`` the end of a fragment of several rows that does not cross
    out, ``out`` = S_loc the end of the last real fragment when it crosses out).
    ``IS_M`` (with ``LAST_ONLY``), WIDTH = K: the fold ``M_n-1 ... M_0`` from the
    identity into ``out`` when that fragment crosses in and out. Otherwise
    ``out`` gets zeros: the identity of the composition."""
    i_h, i_v = tl.program_id(1), tl.program_id(2)
    col = i_v * BV
    if LAST_ONLY:
        i_f = last_real_fragment(frag_table, n_frag, BF)
    else:
        i_f = tl.program_id(0)
    _first, _count, initial_row, flags = frag_info(frag_table, n_frag, i_f)
    # the summary rows, read here: stores address them (_common.chunk_tokens' note)
    first_row, count = tl.load(frag_rows + i_f), tl.load(frag_rows + n_frag + i_f)
    if IS_M:
        keep = ((flags & 7) == 3) & (count > 0)  # a middle fragment: crosses in and out (a sentinel: never)
    else:
        keep = ((flags & 6) == 2) & (count > 0)  # crosses out
    n_steps = tl.minimum(count, max_rows)
    if LAST_ONLY:
        n_steps = tl.where(keep, n_steps, 0)
    o_k = tl.arange(0, BK)
    o_c = col + tl.arange(0, BV)
    if IS_M:
        X = tl.where(o_k[:, None] == o_c[None, :], 1.0, 0.0).to(ACC)
    else:
        X = tl.zeros([BK, BV], dtype=ACC)
        if HAS_INITIAL:
            if (flags & 1) == 0:
                X = load_state(initial_state, initial_row, HV, i_h, K, V, col, BK, BV, ACC)
        if HAS_S_IN:
            if (flags & 1) != 0:
                X = load_state(s_in, 0, HV, i_h, K, V, col, BK, BV, ACC)
    for p in range(0, n_steps):
        row = first_row + p
        if HAS_START:
            store_state(start, X, row, HV, i_h, K, V, col, BK, BV)
        X = exact_product(summary, row, HV, i_h, K, V, X, BK, BV, BKB, False, ACC)
        if not IS_M:
            X += load_state_cols(summary, row, HV, i_h, K, V + K, col, V, BK, BV, ACC)
    if HAS_FINAL:
        if (count > 1) & ((flags & 2) == 0):
            store_state(final_state, X, i_f, HV, i_h, K, V, col, BK, BV)
    if HAS_OUT:
        if LAST_ONLY:
            store_state_strided(out + out_col, tl.where(keep, X, 0.0), i_h, stride_h, stride_k, K, WIDTH, 0, col,
                                BK, BV)
        else:
            if i_f == last_real_fragment(frag_table, n_frag, BF):
                store_state_strided(out + out_col, tl.where(keep, X, 0.0), i_h, stride_h, stride_k, K, WIDTH, 0,
                                    col, BK, BV)


def compose_segments(
    summary: torch.Tensor,
    index: ChunkIndex,
    frag_rows: torch.Tensor,
    max_rows: int,
    *,
    initial_state: torch.Tensor | None,
    s_in: torch.Tensor | None,
    start_out: torch.Tensor | None,
    final_state_out: torch.Tensor | None,
    summary_out: torch.Tensor | None,
) -> None:
    """See ``kernels.torch.compose_segments``: S_loc and M are two launches
    into columns of the one ``summary_out`` (no views of it: traced, a launch
    that writes a view of a buffer costs a copy of the buffer)."""
    HV, K = summary.shape[1], summary.shape[2]
    V = summary.shape[3] - K
    out = summary_out
    folds = [(0, V, False)] + ([(V, K, True)] if out is not None and out.shape[-1] > V else [])
    if index.n_frag == 0:  # nothing crosses out: the identity
        if out is not None:
            out.zero_()
        return
    has_initial = initial_state is not None and initial_state.shape[0] > 0
    last_only = start_out is None and final_state_out is None
    steps = max_rows if summary.shape[0] else 0
    for out_col, width, is_m in folds:
        if out is None and last_only:
            continue
        BV = min(BV_COMPOSE, value_block(width))
        launch(compose_segments_kernel)[(1 if last_only or is_m else index.n_frag, HV, triton.cdiv(width, BV))](
            summary, index.frag_table, frag_rows, initial_state if has_initial else summary, pointer(s_in, summary),
            pointer(start_out, summary), pointer(final_state_out, summary), pointer(out, summary),
            out.stride(1) if out is not None else 0, out.stride(2) if out is not None else 0, out_col,
            index.n_frag, steps, HV, K, V, width,
            BK=head_block(K), BV=BV, BKB=min(BKB_COMPOSE, head_block(K)), HAS_INITIAL=has_initial and not is_m,
            HAS_S_IN=s_in is not None and not is_m,
            HAS_START=start_out is not None and not is_m, HAS_FINAL=final_state_out is not None and not is_m,
            HAS_OUT=out is not None, LAST_ONLY=last_only or is_m, IS_M=is_m, ACC=acc_dtype(summary),
            num_warps=NUM_WARPS,
        )

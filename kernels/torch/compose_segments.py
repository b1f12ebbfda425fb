"""Segments, phase 2 (forward): compose each fragment's summary rows in order.

For a composed fragment with rows ``(M_0, S_0) ... (M_n-1, S_n-1)`` and start
state ``X_0`` (its initial state, ``S_in`` when it crosses in and ``s_in`` is
given, else zero): ``X_p+1 = M_p X_p + S_p``. ``X_p`` is segment p's start
state (the carry plane of phase 3), ``X_n`` the fragment's end state. The fold
``(M_n-1 ... M_0, X_n)`` of the crossing-out fragment, walked from zero when it
crosses in, is its KCP summary ``(M, S_loc)``. States and M stay in the
compute dtype (fp32 products: every state that crosses a boundary is fp32).
"""

from __future__ import annotations

import torch

from ..chunk_index import CROSSING_IN, CROSSING_OUT, ChunkIndex, crosses, last_real_fragment
from ._chunks import put_rows
from .tape_walk import start_states


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
    """summary ``[n_sum, HV, K, V + K]`` (phase 1); ``index`` the rank's index,
    ``frag_rows`` ``[2, n_frag]`` (first summary row, count), ``max_rows`` the
    most rows of a fragment (P). Writes start_out ``[n_sum, HV, K, V]``, the
    final states of fragments of several segments that end here
    (``final_state_out`` rows as the tape walk's), and the fold of the crossing-out
    fragment into summary_out: S_loc ``[1, HV, K, V]``, or ``[S_loc | M]``
    ``[1, HV, K, V + K]`` (zero when no fragment crosses out: the identity)."""
    n_sum = summary.shape[0]
    V = summary.shape[-1] - summary.shape[-2]
    with_m = summary_out is not None and summary_out.shape[-1] > V
    first, count = frag_rows[0].long(), frag_rows[1].long()
    X = start_states(index, summary.new_empty((1,) + summary.shape[1:3] + (V,)), initial_state, s_in)
    fold = torch.eye(summary.shape[-2], dtype=summary.dtype, device=summary.device).expand(
        X.shape[:2] + (summary.shape[-2],) * 2)
    for p in range(max_rows if n_sum else 0):
        active = count > p
        row = (first + p).clamp(max=n_sum - 1)
        if start_out is not None:
            put_rows(start_out, row, active, X)
        M, S = summary[row, ..., V:], summary[row, ..., :V]
        on = active[:, None, None, None]
        X = torch.where(on, M @ X + S, X)
        if with_m:
            fold = torch.where(on, M @ fold, fold)
    if final_state_out is not None:
        ends = (count > 1) & ((index.frag_flags & CROSSING_OUT) == 0)
        n = final_state_out.shape[0]  # fragment f's final state is row f; no fragment past n ends here
        final_state_out.copy_(torch.where(ends[:n, None, None, None], X[:n].to(final_state_out.dtype),
                                          final_state_out))
    if summary_out is not None:
        last = last_real_fragment(index.frag_flags)
        folded = (crosses(index.frag_flags[last], CROSSING_OUT) & (count[last] > 0))[:, None, None, None]
        parts = [torch.where(folded, X[last], 0)]
        if with_m:  # M = 0 when the fragment starts its document here (S_loc holds its start)
            middle = folded & crosses(index.frag_flags[last], CROSSING_IN)[:, None, None, None]
            parts.append(torch.where(middle, fold[last], 0))
        summary_out.copy_(torch.cat(parts, dim=-1))

"""Segments, phase 2 (backward): compose each fragment's adjoint rows, last first.

For a composed fragment with rows ``(M_p, nu_p)`` and end adjoint ``Y_n`` (its
final-state gradient, ``lambda_end`` when it crosses out and ``lam`` is given,
else zero): ``Y_p = M_p^T Y_p+1 + nu_p``. ``Y_p+1`` is segment p's end adjoint
(the carry plane of phase 3), ``Y_0`` the fragment's start adjoint. The fold
of the crossing-in fragment, from its end adjoint without ``lam``, is its KCP
``nu``. Compute dtype throughout (fp32 products).
"""

from __future__ import annotations

import torch

from ..chunk_index import CROSSING_IN, ChunkIndex, crosses
from ._chunks import put_rows
from .adjoint_walk import end_adjoints


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
    """nu ``[n_sum, HV, K, V]`` (phase 1), summary ``[n_sum, HV, K, V + K]``
    (its M); ``index``, ``frag_rows``, ``max_rows`` as :func:`compose_segments`'s.
    Writes end_out ``[n_sum, HV, K, V]`` (each row's end adjoint; the
    adjoint walk of phase 3 writes the initial-state gradients) and the
    crossing-in fragment's fold into nu_out ``[1, HV, K, V]`` (zero when
    no fragment crosses in)."""
    n_sum, V = nu.shape[0], nu.shape[-1]
    first, count = frag_rows[0].long(), frag_rows[1].long()
    Y = end_adjoints(index, nu.new_empty((1,) + nu.shape[1:]), d_final_state, lam)
    for p in range(max_rows if n_sum else 0):
        active = count > p
        row = (first + count - 1 - p).clamp(0, n_sum - 1)
        if end_out is not None:
            put_rows(end_out, row, active, Y)
        Y = torch.where(active[:, None, None, None], summary[row, ..., V:].mT @ Y + nu[row], Y)
    if nu_out is not None:
        folded = (crosses(index.frag_flags[:1], CROSSING_IN) & (count[:1] > 0))[:, None, None, None]
        nu_out.copy_(torch.where(folded, Y[:1], 0))

"""Segments, phase 1 (backward): every summary row's ``nu``, its start adjoint
walked back from a zero end adjoint. With the true end adjoint
``lambda_end`` the segment's start adjoint is ``M_seg^T lambda_end + nu``."""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import accumulator_dtype
from ._chunks import chunk_rows, to_chunks
from ._walk import adjoint_step, q_decayed_do, walk_operands


def adjoint_segment_summary(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    do: torch.Tensor,
    dv_local: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    nu_out: torch.Tensor,
    k_decayed: torch.Tensor | None = None,
    q_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """q, k ``[T, H_qk, K]``; w ``[T, HV, K]``; g ``[T, HV]``; do, dv_local
    ``[T, HV, V]``; ``index`` the summary rows. Writes nu_out ``[n_sum, HV, K, V]``
    (compute dtype; an empty row: 0). KDA's decays may come formed (as for
    :func:`.adjoint_walk.adjoint_walk`)."""
    if index.n_frag == 0:
        return
    cdt = accumulator_dtype(k.dtype)
    rows = chunk_rows(index)
    ops = walk_operands(k, k_rstd, w, g, rows, cdt, gate_params, k_decayed, chunk_decay)
    pull = q_decayed_do(q, q_rstd, do, g, rows, cdt, scale, gate_params, q_decayed)
    dvl = to_chunks(dv_local, rows, cdt)
    dS = dvl.new_zeros((index.n_frag, w.shape[1], w.shape[2], do.shape[2]))
    last_chunk = max(index.n_chunks - 1, 0)
    for j in reversed(range(index.max_frag_chunks)):
        active = index.frag_n_chunks > j
        c = (index.frag_first_chunk.long() + j).clamp(max=last_chunk)
        _, dS_prev = adjoint_step(ops, dvl, pull, c, dS)
        dS = torch.where(active[:, None, None, None], dS_prev, dS)
    nu_out.copy_(dS)

"""Backward: the local part of dv_new, from the chunk's own outputs.

    dVn_local = scale ((Q K^T) * exp(G_i - G_j) * [i >= j])^T dO
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import accumulator_dtype, matmul_mode, mm
from ._chunks import causal_scores, chunk_gates, chunk_rows, from_chunks, load_qk, to_chunks


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
    """q, k ``[T, H_qk, K]``; g ``[T, HV]``; do ``[T, HV, V]``. Writes dv_out
    ``[T, HV, V]`` (computed in the compute dtype, rounded to dv_out's)."""
    cdt = accumulator_dtype(k.dtype)
    HV = do.shape[1]
    rows = chunk_rows(index)
    qc, kc = load_qk(q, q_rstd, rows, cdt, HV), load_qk(k, k_rstd, rows, cdt, HV)
    mode = matmul_mode(q.dtype)
    scores = causal_scores(qc, kc, chunk_gates(g, rows, cdt, gate_params), mode=mode)
    from_chunks(scale * mm(scores.mT, to_chunks(do, rows, cdt), mode), rows, dv_out)

"""Program #5, output: o from q, k, the gate cumsum and the walk's tapes.

    O = scale [ diag(gamma) Q S0 + ((Q K^T) * exp(G_i - G_j) * [i >= j]) Vn ]
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import accumulator_dtype, matmul_mode, mm
from ._chunks import causal_scores, chunk_gates, chunk_rows, from_chunks, load_qk, lower_matmul, to_chunks


def output(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    v_new: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    o_out: torch.Tensor,
) -> None:
    """q, k ``[T, H_qk, K]``; g ``[T, HV]``; h ``[NC, HV, K, V]``; v_new
    ``[T, HV, V]``. Writes o_out ``[T, HV, V]`` (any float dtype)."""
    cdt = accumulator_dtype(k.dtype)
    HV = v_new.shape[1]
    rows = chunk_rows(index)
    qc, kc = load_qk(q, q_rstd, rows, cdt, HV), load_qk(k, k_rstd, rows, cdt, HV)
    gates = chunk_gates(g, rows, cdt, gate_params)
    mode = matmul_mode(q.dtype)
    scores = causal_scores(qc, kc, gates, mode=mode)
    o = (mm(gates.rows(torch.exp(gates.cum)) * qc, h.to(cdt), mode)
         + lower_matmul(scores, to_chunks(v_new, rows, cdt), mode))
    from_chunks(scale * o, rows, o_out)

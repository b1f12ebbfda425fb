"""Forward: the chunk's decayed causal scores, for the walk with the output.

    P = (Q K^T) * exp(G_i - G_j) * [i >= j]          (per chunk and value head)

Stored in the input dtype, as the output's product reads them (its operands
are rounded to the input dtype), so the walk does the same arithmetic as
:func:`~gdn_kcp.kernels.torch.output` on the tapes.
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import accumulator_dtype, matmul_mode
from ._chunks import causal_scores, chunk_gates, chunk_rows, from_chunks, load_qk


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    scores_out: torch.Tensor,
) -> None:
    """q, k ``[T, H_qk, K]``; g ``[T, HV]``. Writes scores_out ``[T, HV, C]``:
    row t holds token t's scores against the tokens of its chunk, in chunk
    order (zero past t)."""
    cdt = accumulator_dtype(k.dtype)
    HV = scores_out.shape[1]
    rows = chunk_rows(index)
    qc, kc = load_qk(q, q_rstd, rows, cdt, HV), load_qk(k, k_rstd, rows, cdt, HV)
    p = causal_scores(qc, kc, chunk_gates(g, rows, cdt, gate_params), mode=matmul_mode(q.dtype))
    from_chunks(p, rows, scores_out)

"""Program #5, output: o from q, k, the gate cumsum and the walk's tapes.

    O = scale [ diag(gamma) Q S0 + ((Q K^T) * exp(G_i - G_j) * [i >= j]) Vn ]
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ._chunks import causal_decay, chunk_rows, from_chunks, gates_to_chunks, load_qk, to_chunks


def output(
    q: torch.Tensor,
    k: torch.Tensor,
    gcum: torch.Tensor,
    h: torch.Tensor,
    v_new: torch.Tensor,
    index: ChunkIndex,
    *,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    o_out: torch.Tensor,
) -> None:
    """q, k ``[T, H_qk, K]``; gcum ``[T, HV]``; h ``[NC, HV, K, V]``; v_new
    ``[T, HV, V]``. Writes o_out ``[T, HV, V]`` (any float dtype)."""
    cdt = h.dtype
    HV = v_new.shape[1]
    rows = chunk_rows(index)
    qc, kc = load_qk(q, q_rstd, rows, cdt, HV), load_qk(k, k_rstd, rows, cdt, HV)
    G = gates_to_chunks(gcum, rows, cdt)
    scores = (qc @ kc.mT) * causal_decay(G)
    o = (torch.exp(G)[..., None] * qc) @ h + scores @ to_chunks(v_new, rows, cdt)
    from_chunks(scale * o, rows, o_out)

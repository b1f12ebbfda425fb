"""Backward of the in-chunk gate cumsum: ``dg_i = sum_{j >= i} dG_j`` per chunk."""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ._chunks import chunk_rows, from_chunks, scalars_to_chunks, to_chunks


def bwd_gate_cumsum(dgcum: torch.Tensor, index: ChunkIndex, *, dg_out: torch.Tensor) -> None:
    """dgcum ``[T, HV]`` (gradient of the gate cumsum) -> dg_out ``[T, HV]``; a
    gate per key channel (KDA): ``[T, HV, K]`` both."""
    rows = chunk_rows(index)
    if dgcum.dim() == 3:
        dG = to_chunks(dgcum, rows, dgcum.dtype)
        from_chunks(dG.flip(-2).cumsum(-2).flip(-2), rows, dg_out)
        return
    dG = scalars_to_chunks(dgcum, rows, dgcum.dtype)
    from_chunks(dG.flip(-1).cumsum(-1).flip(-1), rows, dg_out)

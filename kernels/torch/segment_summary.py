"""Segments, phase 1 (forward): every summary row folded into ``[S | M]``.

Row r is one segment of a composed fragment (:mod:`gdn_kcp.kernels.segments`).
It walks its chunks from ``[0 | I]`` as one augmented state with
``u = [U | 0]``, so its end is ``[S_seg | M_seg]``: ``S_end = M_seg S_start + S_seg``.
All rows advance together, ``index.max_frag_chunks`` steps.
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import accumulator_dtype
from ._chunks import chunk_rows, to_chunks
from ._walk import state_step, walk_operands


def segment_summary(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor | None,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    k_rstd: torch.Tensor | None,
    summary_out: torch.Tensor,
    k_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """k ``[T, H_qk, K]``; w ``[T, HV, K]``, u ``[T, HV, V]``, g ``[T, HV]``;
    ``index`` the summary rows (``SegmentTables.summary``). Writes summary_out
    ``[n_sum, HV, K, V + K]`` (compute dtype): ``[S_seg | M_seg]`` per row
    (an empty row: ``[0 | I]``, the identity). ``u=None`` folds M alone
    (S_seg = 0): a backward that kept the tapes holds v_new, not u. KDA's
    decays may come formed (``k_decayed``, ``chunk_decay``:
    :func:`.channel_decays.channel_decays`)."""
    if index.n_frag == 0:
        return
    cdt = accumulator_dtype(k.dtype)
    HV, K = w.shape[1], w.shape[2]
    V = summary_out.shape[-1] - K
    rows = chunk_rows(index)
    ops = walk_operands(k, k_rstd, w, g, rows, cdt, gate_params, k_decayed, chunk_decay)
    uc = ops.w.new_zeros(ops.w.shape[:-1] + (V + K,))
    if u is not None:
        uc[..., :V] = to_chunks(u, rows, cdt)
    X = uc.new_zeros(index.n_frag, HV, K, V + K)
    X[..., V:] = torch.eye(K, dtype=cdt, device=X.device)
    last_chunk = max(index.n_chunks - 1, 0)
    for j in range(index.max_frag_chunks):
        active = index.frag_n_chunks > j
        c = (index.frag_first_chunk.long() + j).clamp(max=last_chunk)
        _, X_next = state_step(ops, uc, c, X)
        X = torch.where(active[:, None, None, None], X_next, X)
    summary_out.copy_(X)

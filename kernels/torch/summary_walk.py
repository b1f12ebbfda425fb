"""KCP summary: fold the crossing-out fragment into ``(M, S_loc)`` from a zero state.

Each chunk is affine in its start state, ``S_C = T_c S0 + B_c`` with
``T_c = gamma_C I - (diag(gamma_C / gamma) K)^T W`` and
``B_c = (diag(gamma_C / gamma) K)^T U``; the fragment folds to
``S_end = M S_start + S_loc``, ``M = T_n ... T_1``. M is only needed when the
fragment also crosses in (a middle rank); a fragment that starts its document
walks from its initial state (zero without one) and sends ``S_loc`` alone.

On a capped index the crossing-out fragment is the last real one (sentinels
follow it), and a rank whose fragments do not cross out, or whose crossing-out
fragment starts here, writes the composition's identity (``S_loc = 0``, and
``M = 0``): read from the device table.
"""

from __future__ import annotations

import torch

from ..chunk_index import CROSSING_IN, CROSSING_OUT, ChunkIndex, crosses, last_real_fragment
from ..precision import accumulator_dtype
from ._chunks import chunk_rows, to_chunks
from ._walk import state_step, walk_operands
from .tape_walk import gather_states


def summary_walk(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    k_rstd: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    summary_out: torch.Tensor,
    k_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """Walk the last fragment (the crossing-out one) of ``index`` from zero, or
    from its initial state when it starts its document.

    k ``[T, H_qk, K]``; w ``[T, HV, K]``, u ``[T, HV, V]``, g ``[T, HV]`` (the
    gates); initial_state ``[N_start, HV, K, V]`` as the tape walk's or None.
    Writes summary_out ``[1, HV, K, V]`` (S_loc) or ``[1, HV, K, V + K]``
    (``[S_loc | M]``, a middle rank), in the compute dtype. With a gate per
    key channel the decays may come formed (``k_decayed``, ``chunk_decay``:
    ``channel_decays``' pools).
    """
    cdt = accumulator_dtype(k.dtype)
    HV, K, V = w.shape[1], w.shape[2], u.shape[2]
    rows = chunk_rows(index)
    ops = walk_operands(k, k_rstd, w, g, rows, cdt, gate_params, k_decayed, chunk_decay)
    uc = to_chunks(u, rows, cdt)
    # The augmented state [S | M] walks as one state with u = [U | 0]: its step is
    # [T_c S + B_c | T_c M], and it starts at [S_start | I].
    with_m = summary_out.shape[-1] > V
    X = summary_out.new_zeros(1, HV, K, V + (K if with_m else 0))
    last = last_real_fragment(index.frag_flags)
    flags = index.frag_flags[last]
    crosses_out = crosses(flags, CROSSING_OUT)
    middle = crosses_out & crosses(flags, CROSSING_IN)
    starts = gather_states(index, initial_state, CROSSING_IN, X.new_zeros(index.n_frag, HV, K, V))[last]
    X[..., :V] = torch.where(crosses_out[:, None, None, None], starts, 0)
    if with_m:
        uc = torch.cat([uc, uc.new_zeros(uc.shape[:-1] + (K,))], dim=-1)
        X[..., V:] = torch.eye(K, dtype=cdt, device=X.device) * middle[:, None, None, None]
    n = torch.where(crosses_out, index.frag_n_chunks[last].long(), 0)
    first = index.frag_first_chunk[last].long()
    for j in range(index.max_frag_chunks):
        c = (first + j).clamp(max=index.n_chunks - 1)
        _, X_next = state_step(ops, uc, c, X)
        X = torch.where((n > j)[:, None, None, None], X_next, X)
    summary_out.copy_(X)

"""Program #2, tape walk: every fragment from its start state, chunk by chunk.

    h[c] = S0                      (state at the chunk start, the tape)
    Vn   = U - W S0                (v_new)
    S_C  = gamma_C S0 + (diag(gamma_C / gamma) K)^T Vn

All fragments advance together: step j walks chunk j of every fragment that
has one, so the loop runs ``index.max_frag_chunks`` times.
"""

from __future__ import annotations

import torch

from ..chunk_index import CROSSING_IN, CROSSING_OUT, ChunkIndex
from ._chunks import chunk_rows, from_chunks, to_chunks
from ._walk import state_step, walk_operands


def start_states(
    index: ChunkIndex, like: torch.Tensor, initial_state: torch.Tensor | None, s_in: torch.Tensor | None
) -> torch.Tensor:
    """``[F, HV, K, V]``: zero, ``initial_state[frag_doc]``, or ``s_in[0]`` for
    the crossing-in fragment (always fragment 0)."""
    S = like.new_zeros((index.n_frag,) + like.shape[1:])
    crossing_in = (index.frag_flags & CROSSING_IN) != 0
    if initial_state is not None:
        S = torch.where(crossing_in[:, None, None, None], S, initial_state[index.frag_doc.long()].to(S.dtype))
    if s_in is not None:
        S = torch.where(crossing_in[:, None, None, None], s_in[:1].to(S.dtype), S)
    return S


def write_end_states(index: ChunkIndex, S: torch.Tensor, out: torch.Tensor | None, skip_flag: int) -> None:
    """``out[frag_doc[f]] = S[f]`` for every fragment without ``skip_flag``."""
    if out is None:
        return
    keep = (index.frag_flags & skip_flag) == 0
    out[index.frag_doc[keep].long()] = S[keep].to(out.dtype)


def tape_walk(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    k_rstd: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    s_in: torch.Tensor | None,
    h_out: torch.Tensor,
    v_new_out: torch.Tensor,
    final_state_out: torch.Tensor | None,
) -> None:
    """Walk the states.

    k: ``[T, H_qk, K]``; w ``[T, HV, K]``, u ``[T, HV, V]``, g ``[T, HV]`` (the gates); initial_state ``[N, HV, K, V]`` (rows by ``frag_doc``) or None;
    s_in ``[1, HV, K, V]``, the start state of the crossing-in fragment, or None.
    Writes h_out ``[NC, HV, K, V]`` (state at each chunk start), v_new_out
    ``[T, HV, V]`` and, for every fragment that does not cross out,
    ``final_state_out[frag_doc]`` (``[N, HV, K, V]``).
    """
    cdt = h_out.dtype
    HV, K, V = w.shape[1], w.shape[2], u.shape[2]
    rows = chunk_rows(index)
    ops = walk_operands(k, k_rstd, w, g, rows, cdt)
    uc = to_chunks(u, rows, cdt)
    v_new = torch.empty_like(uc)
    S = start_states(index, h_out.new_empty((1, HV, K, V)), initial_state, s_in)
    last_chunk = max(index.n_chunks - 1, 0)
    for j in range(index.max_frag_chunks):
        active = index.frag_n_chunks > j
        c = (index.frag_first_chunk.long() + j).clamp(max=last_chunk)
        h_out[c[active]] = S[active]
        vn, S_next = state_step(ops, uc, c, S)
        v_new[c[active]] = vn[active]
        S = torch.where(active[:, None, None, None], S_next, S)
    from_chunks(v_new, rows, v_new_out)
    write_end_states(index, S, final_state_out, CROSSING_OUT)

"""Program #2, tape walk: every fragment from its start state, chunk by chunk.

    h[c] = S0                      (state at the chunk start, the tape)
    Vn   = U - W S0                (v_new)
    S_C  = gamma_C S0 + (diag(gamma_C / gamma) K)^T Vn

All fragments advance together: step j walks chunk j of every fragment that
has one, so the loop runs ``index.max_frag_chunks`` times.
"""

from __future__ import annotations

import torch

from ..chunk_index import CROSSING_IN, CROSSING_OUT, ChunkIndex, initial_row_shift
from ..segments import SEGMENT
from ..precision import accumulator_dtype
from ._chunks import chunk_rows, from_chunks, put_rows, to_chunks
from ._walk import forward_steps, state_step, walk_operands


def state_rows(index: ChunkIndex, flag: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per fragment: its row in the initial states (``flag=CROSSING_IN``:
    ``f - n_in``) or the final states (``CROSSING_OUT``: ``f``), and whether
    it has one (it does not cross that way)."""
    rows = torch.arange(index.n_frag, device=index.frag_flags.device)
    if flag == CROSSING_IN:
        rows = rows - initial_row_shift(index.frag_flags)
    return rows, (index.frag_flags & flag) == 0


def gather_states(index: ChunkIndex, states: torch.Tensor | None, flag: int, S: torch.Tensor) -> torch.Tensor:
    """``S`` with ``states[row]`` for every fragment that has a row (see
    :func:`state_rows`); ``states`` ``[n_rows, HV, K, V]``."""
    if states is None or states.shape[0] == 0:
        return S
    rows, has_row = state_rows(index, flag)
    picked = states[rows.clamp(0, states.shape[0] - 1)].to(S.dtype)
    return torch.where(has_row[:, None, None, None], picked, S)


def start_states(
    index: ChunkIndex, like: torch.Tensor, initial_state: torch.Tensor | None, s_in: torch.Tensor | None,
    carry_in: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[F, HV, K, V]``: zero, the fragment's initial state, or ``s_in[0]`` for
    the crossing-in fragment (always fragment 0); a ``SEGMENT`` row of a
    segmented index: ``carry_in[frag_carry]``."""
    S = gather_states(index, initial_state, CROSSING_IN, like.new_zeros((index.n_frag,) + like.shape[1:]))
    if s_in is not None:
        crossing_in = (index.frag_flags & CROSSING_IN) != 0
        S = torch.where(crossing_in[:, None, None, None], s_in[:1].to(S.dtype), S)
    return carried(index, S, carry_in)


def carried(index: ChunkIndex, S: torch.Tensor, carry_in: torch.Tensor | None) -> torch.Tensor:
    """``S`` with ``carry_in[frag_carry]`` on the rows flagged ``SEGMENT``."""
    if carry_in is None or carry_in.shape[0] == 0:
        return S
    picked = carry_in[index.frag_carry.long().clamp(0, carry_in.shape[0] - 1)].to(S.dtype)
    return torch.where(((index.frag_flags & SEGMENT) != 0)[:, None, None, None], picked, S)


def write_end_states(index: ChunkIndex, S: torch.Tensor, out: torch.Tensor | None, flag: int) -> None:
    """``out[row] = S[f]`` for every fragment f that does not cross ``flag``'s
    way (rows of :func:`state_rows`)."""
    if out is None:
        return
    rows, has_row = state_rows(index, flag)
    put_rows(out, rows, has_row, S)


def tape_walk(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    k_rstd: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    s_in: torch.Tensor | None,
    h_out: torch.Tensor,
    v_new_out: torch.Tensor,
    final_state_out: torch.Tensor | None,
    carry_in: torch.Tensor | None = None,
    k_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """Walk the states.

    k: ``[T, H_qk, K]``; w ``[T, HV, K]``, u ``[T, HV, V]``, g ``[T, HV]`` (the gates); initial_state ``[N_start, HV, K, V]`` (the documents that start in this range, in order) or None;
    s_in ``[1, HV, K, V]``, the start state of the crossing-in fragment, or None.
    Writes h_out ``[NC, HV, K, V]`` (state at each chunk start), v_new_out
    ``[T, HV, V]`` and ``final_state_out`` ``[N_end, HV, K, V]``, the final states
    of the documents that end in this range, in order. With segments
    (``index`` a phase-3 index of :mod:`gdn_kcp.kernels.segments`), carry_in
    ``[n_sum, HV, K, V]`` holds the start states of its ``SEGMENT`` rows. A
    gate per key channel may come with its decays formed once a chunk
    (``k_decayed``, ``chunk_decay``: :func:`.channel_decays.channel_decays`),
    read in place of k's and g's.
    """
    cdt = accumulator_dtype(k.dtype)
    HV, K, V = w.shape[1], w.shape[2], u.shape[2]
    rows = chunk_rows(index)
    ops = walk_operands(k, k_rstd, w, g, rows, cdt, gate_params, k_decayed, chunk_decay)
    uc = to_chunks(u, rows, cdt)
    v_new = torch.empty_like(uc)
    S = start_states(index, uc.new_empty((1, HV, K, V)), initial_state, s_in, carry_in)
    for active, c in forward_steps(index):
        put_rows(h_out, c, active, S)
        vn, S_next = state_step(ops, uc, c, S)
        put_rows(v_new, c, active, vn)
        S = torch.where(active[:, None, None, None], S_next, S)
    from_chunks(v_new, rows, v_new_out)
    write_end_states(index, S, final_state_out, CROSSING_OUT)

"""Intra-rank segments on the host path (docs/kcp.md, :mod:`gdn_kcp.kernels.segments`).

Phase 1 binds the tables and every summary row's ``[S | M]``; phase 2 composes
them into the carry planes (and into the KCP summary or ``nu`` of a crossing
fragment); phase 3 is the ordinary tape walk or adjoint walk over the
segmented index. The pool order here is what :mod:`gdn_kcp.queries.schedule`
models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_kcp.kernels.segments import SegmentTables, segment_tables


@dataclass
class Segments:
    """One call's segment tables and the planes bound so far."""

    tables: SegmentTables
    summary: torch.Tensor  # seg_summary [n_sum, HV, K, V + K]
    start: torch.Tensor | None = None  # seg_start [n_sum, HV, K, V]
    nu: torch.Tensor | None = None  # seg_nu [n_sum, HV, K, V]
    end: torch.Tensor | None = None  # seg_end [n_sum, HV, K, V]


def run_segment_summaries(k, g, call, tapes, buffers, *, phase_call: str, with_s: bool = True,
                          decays: dict | None = None) -> Segments | None:
    """Phase 1 (None without segments): the tables and ``[S | M]`` of every
    summary row (``with_s=False``: M only, for a backward whose tapes hold
    v_new rather than u); ``decays``: KDA's, where already formed
    (``forward.run_channel_decays``)."""
    if call.P == 1:
        return None
    arena = buffers.arena
    arena.phase(f"{phase_call}.phase.segments")
    tables = segment_tables(call.index, call.P, call.ctx.summary_rows(call.P), exchanges=call.ctx.exchanges,
                            out=arena.bind("seg_index"))
    seg = Segments(tables=tables, summary=arena.bind("seg_summary"))
    call.programs.segment_summary(
        k, tapes.w, tapes.v_new if with_s else None, g, tables.summary, k_rstd=tapes.k_rstd,
        summary_out=seg.summary, **call.gate, **state_decays(decays),
    )
    return seg


def state_decays(decays: dict | None) -> dict:
    """Of KDA's formed decays (``forward.run_channel_decays``), those a state
    walk reads: K's and the chunks' (none where none were formed)."""
    return {name: decays[name] for name in ("k_decayed", "chunk_decay") if decays and name in decays}


def fold_summary(call, seg: Segments, summary: torch.Tensor, *, initial_state) -> None:
    """The crossing-out fragment's KCP summary ``[S_loc | M]`` from its segments."""
    call.programs.compose_segments(
        seg.summary, call.index, seg.tables.frag_rows, call.P, initial_state=initial_state, s_in=None,
        start_out=None, final_state_out=None, summary_out=summary,
    )


def compose_starts(call, seg: Segments, buffers, *, phase_call: str, initial_state, s_in, final_state_out) -> None:
    """Phase 2 (forward): every segment's start state into ``seg_start`` and the
    final states of fragments of several segments."""
    arena = buffers.arena
    arena.phase(f"{phase_call}.phase.compose")
    seg.start = arena.bind("seg_start")
    call.programs.compose_segments(
        seg.summary, call.index, seg.tables.frag_rows, call.P, initial_state=initial_state,
        s_in=s_in[:, : call.HV] if s_in is not None and call.ctx.n_in else None,
        start_out=seg.start, final_state_out=final_state_out, summary_out=None,
    )
    if phase_call == "fwd":
        arena.release("seg_summary")


def run_segment_nu(q, k, g, do, dv_local, call, tapes, seg: Segments | None, buffers,
                   decays: dict | None = None) -> None:
    """Phase 1 (backward): every summary row's ``nu`` into ``seg_nu``
    (``decays``: KDA's, where already formed, q's raw)."""
    if seg is None:
        return
    buffers.arena.phase("bwd.phase.segment_nu")
    seg.nu = buffers.arena.bind("seg_nu")
    call.programs.adjoint_segment_summary(
        q, k, tapes.w, g, do, dv_local, seg.tables.summary, scale=call.scale, q_rstd=tapes.q_rstd,
        k_rstd=tapes.k_rstd, nu_out=seg.nu, **call.gate, **(decays or {}),
    )


def fold_nu(call, seg: Segments, nu: torch.Tensor, *, d_final_state) -> None:
    """The crossing-in fragment's KCP ``nu`` from its segments."""
    call.programs.compose_adjoints(
        seg.nu, seg.summary, call.index, seg.tables.frag_rows, call.P, d_final_state=d_final_state, lam=None,
        end_out=None, nu_out=nu,
    )


def compose_ends(call, seg: Segments | None, buffers, *, d_final_state, lam) -> None:
    """Phase 2 (backward): every segment's end adjoint into ``seg_end``."""
    if seg is None:
        return
    arena = buffers.arena
    arena.phase("bwd.phase.compose_adjoint")
    seg.end = arena.bind("seg_end")
    call.programs.compose_adjoints(
        seg.nu, seg.summary, call.index, seg.tables.frag_rows, call.P, d_final_state=d_final_state,
        lam=lam[:, : call.HV] if lam is not None and call.ctx.n_out else None, end_out=seg.end, nu_out=None,
    )
    arena.release("seg_nu", "seg_summary")

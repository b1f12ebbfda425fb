"""Intra-rank segments (docs/kcp.md): each long fragment walked as P parallel pieces.

With P > 1 every fragment of n chunks is cut at chunk boundaries into segments of
``L = ceil(max_frag_chunks / P)`` chunks (the last may be shorter), so the
rank's longest fragment has P segments and a fragment of at most L chunks one.
A fragment is *composed* when it has more than one segment, or when it crosses
a rank boundary in a call that exchanges (its KCP summary is then the
composition of its segments' summaries). Each segment of a composed fragment is
a *summary row*: phase 1 folds it into ``(M, S)`` from ``[0 | I]``, phase 2
composes the rows of each fragment in order, phase 3 walks every segment from
its true start state (backward: end adjoint).

The tables, written by :func:`segment_tables` into one int32 pool:

- ``summary``: a :class:`ChunkIndex` whose fragments are the summary rows
  (chunk ranges of the segments; the walks of phase 1 read it);
- ``walk`` (forward, phase 3) and ``adjoint`` (backward, phase 3): a
  :class:`ChunkIndex` with ``n_frag + n_sum`` rows and a seventh row,
  ``frag_carry``. Row ``f < n_frag`` is fragment f's first segment, so the
  state-row rules of the walks hold unchanged: it starts at the fragment's
  start state and writes its initial-state gradient. When the fragment has
  several segments, the forward row is also flagged ``CROSSING_OUT`` (phase 2
  writes the final state) and the backward row ``SEGMENT`` (it ends at the
  carry plane). Row ``n_frag + r`` is summary row r's segment when that is not
  a first one, flagged ``CROSSING_IN | CROSSING_OUT | SEGMENT``: it starts
  (ends) at row ``frag_carry`` of the carry plane that phase 2 wrote, and
  writes no final state (initial-state gradient). Otherwise it is an empty
  sentinel row;
- ``frag_rows`` ``[2, n_frag]``: each fragment's first summary row and count
  (0 when it is not composed).

Row counts: the exact count comes from the host index (:func:`summary_rows`);
on a capped index at most ``2 P - 2`` rows belong to fragments of several
segments, plus 2 for crossing fragments (:func:`capped_summary_rows`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from .chunk_index import CHUNK_SIZE, CROSSING_IN, CROSSING_OUT, PADDING, SENTINEL_FLAGS, ChunkIndex

SEGMENT = 8
"""Fragment flag of a phase-3 row that starts (forward) or ends (backward) at
row ``frag_carry`` of the carry plane, not at a state of the fragment."""

MAX_SEGMENTS = 64
"""The most segments a fragment is cut into (``OptionsKcp.segments``'s ceiling)."""


def segment_chunks(max_frag_chunks: int, P: int) -> int:
    """``L``: chunks per segment, so that the longest fragment has P segments."""
    return max(1, -(-max_frag_chunks // P))


def summary_rows(frag_n_chunks: list[int], frag_flags: list[int], P: int, max_frag_chunks: int, *,
                 exchanges: bool) -> int:
    """The exact number of summary rows of an index (host lists); 0 at P = 1
    (no segments)."""
    if P == 1:
        return 0
    L = segment_chunks(max_frag_chunks, P)
    total = 0
    for n, flags in zip(frag_n_chunks, frag_flags):
        parts = max(1, -(-n // L))
        crossing = exchanges and not flags & PADDING and flags & (CROSSING_IN | CROSSING_OUT)
        total += parts if parts > 1 or crossing else 0
    return total


def summary_row_counts(frag_n_chunks: list[int], frag_flags: list[int], max_frag_chunks: int, *,
                       exchanges: bool) -> tuple[int, ...]:
    """:func:`summary_rows` at every P of ``1 .. MAX_SEGMENTS``, from one
    histogram of the fragments' chunk counts (a context records all of them:
    for a rank of 4,096 short documents this takes the context build from
    147 ms, with 64 passes over the fragments, to 39 ms)."""
    plain: Counter[int] = Counter()
    crossing = []
    for n, flags in zip(frag_n_chunks, frag_flags):
        if exchanges and not flags & PADDING and flags & (CROSSING_IN | CROSSING_OUT):
            crossing.append(n)
        else:
            plain[n] += 1
    counts = [0]
    for P in range(2, MAX_SEGMENTS + 1):
        L = segment_chunks(max_frag_chunks, P)
        parts = {n: max(1, -(-n // L)) for n in plain}
        counts.append(sum(max(1, -(-n // L)) for n in crossing)
                      + sum(times * parts[n] for n, times in plain.items() if parts[n] > 1))
    return tuple(counts)


def capped_summary_rows(P: int, *, exchanges: bool) -> int:
    """The most summary rows any packing of a capped index can have.

    Let k fragments have more than one segment, S segments in all, in a range
    of T tokens with ``N0 = ceil(T / C) <= P L`` (C = 64). A fragment of s
    segments has at least ``(s - 1) L + 1`` chunks, and k fragments cut at most
    ``N0 + k - 1`` chunks, so ``(S - k) L + k <= N0 + k - 1 < P L + k``, that is
    ``S - k <= P - 1``; and ``k (L + 1) <= N0 + k - 1`` gives ``k <= P - 1``.
    So ``S <= 2 P - 2``; a crossing-in and a crossing-out fragment of one
    segment add one row each.
    """
    return 0 if P == 1 else 2 * P - 2 + (2 if exchanges else 0)


def table_elements(n_frag: int, n_sum: int) -> int:
    """int32 elements of the tables: the summary index (``3 NC`` shared, so
    ``6 n_sum``), two phase-3 indexes (``7 (n_frag + n_sum)`` each) and
    ``frag_rows`` (``2 n_frag``)."""
    return 6 * n_sum + 14 * (n_frag + n_sum) + 2 * n_frag


@dataclass(frozen=True)
class SegmentTables:
    """What :func:`segment_tables` wrote (views of its int32 buffer)."""

    summary: ChunkIndex
    walk: ChunkIndex
    adjoint: ChunkIndex
    frag_rows: torch.Tensor

    @property
    def n_sum(self) -> int:
        return self.summary.n_frag


def segment_tables(index: ChunkIndex, P: int, n_sum: int, *, exchanges: bool, out: torch.Tensor) -> SegmentTables:
    """Cut ``index`` into segments (P > 1) and write the tables into ``out``
    (int32, :func:`table_elements` elements). Torch ops at static shapes on the
    index's device (no host read), so capped indexes trace into one graph."""
    C, F = CHUNK_SIZE, index.n_frag
    L = segment_chunks(index.max_frag_chunks, P)
    device = index.frag_table.device
    n = index.frag_n_chunks.long()
    flags = index.frag_flags.long()
    real = (flags & PADDING) == 0
    parts = torch.clamp((n + L - 1) // L, min=1)
    crossing = real & ((flags & (CROSSING_IN | CROSSING_OUT)) != 0) & exchanges
    count = torch.where((parts > 1) | crossing, parts, 0)
    first_row = torch.cumsum(count, 0) - count

    # summary rows: fragment f, part p
    r = torch.arange(n_sum, device=device)
    f = torch.searchsorted(first_row + count, r, right=True).clamp(max=max(F - 1, 0))
    used = r < count.sum()
    p = r - first_row[f] if F else r
    frag = index.frag_table.long()[:, f] if F else torch.zeros(6, n_sum, dtype=torch.long, device=device)

    def piece(part, frag_cols):
        """start, len, first chunk, chunks of segment ``part`` of each column's fragment."""
        start, length, first, chunks = frag_cols[0], frag_cols[1], frag_cols[2], frag_cols[3]
        return (start + part * L * C, (length - part * L * C).clamp(0, L * C), first + part * L,
                (chunks - part * L).clamp(0, L))

    s_start, s_len, s_first, s_n = piece(p, frag)
    zero = torch.zeros_like(r)
    summary = torch.stack([
        torch.where(used, s_start, index.n_tokens), torch.where(used, s_len, 0),
        torch.where(used, s_first, index.n_chunks), torch.where(used, s_n, 0),
        torch.where(used, frag[4], -1), torch.where(used, zero, SENTINEL_FLAGS),
    ])

    def phase3(lead_flag, lead_carry):
        """Lead rows (each fragment's first segment), then one row per summary row."""
        base = index.frag_table.long()
        l_start, l_len, l_first, l_n = piece(torch.zeros_like(n), base)
        multi = parts > 1
        lead = torch.stack([
            l_start, l_len, l_first, l_n, base[4], flags | torch.where(multi, lead_flag, 0),
            torch.where(multi, lead_carry, -1),
        ])
        carry = used & (p > 0)
        rest = torch.stack([
            torch.where(carry, s_start, index.n_tokens), torch.where(carry, s_len, 0),
            torch.where(carry, s_first, index.n_chunks), torch.where(carry, s_n, 0),
            torch.where(carry, frag[4], -1),
            torch.where(carry, CROSSING_IN | CROSSING_OUT | SEGMENT, SENTINEL_FLAGS), r,
        ])
        return torch.cat([lead, rest], dim=1)

    # forward: a first segment starts at its fragment's start and leaves the
    # final state to phase 2; backward: it ends at the carry plane and writes
    # the initial-state gradient
    walk = phase3(CROSSING_OUT, torch.full_like(n, -1))
    adjoint = phase3(SEGMENT, first_row)
    frag_rows = torch.stack([first_row, count])

    sizes = (6 * n_sum, 7 * (F + n_sum), 7 * (F + n_sum), 2 * F)
    views = out.split(sizes)
    for view, table in zip(views, (summary, walk, adjoint, frag_rows)):
        view.copy_(table.reshape(-1))
    rows = F + n_sum
    steps = min(L, index.max_frag_chunks)  # a segment holds at most L chunks, and no more than the index has
    return SegmentTables(
        summary=ChunkIndex(index.chunk_table, views[0].view(6, n_sum), index.n_tokens, index.n_chunks, n_sum, steps),
        walk=ChunkIndex(index.chunk_table, views[1].view(7, rows), index.n_tokens, index.n_chunks, rows, steps),
        adjoint=ChunkIndex(index.chunk_table, views[2].view(7, rows), index.n_tokens, index.n_chunks, rows, steps),
        frag_rows=views[3].view(2, F),
    )

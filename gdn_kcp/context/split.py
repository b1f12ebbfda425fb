"""How a packed stream splits over the ranks: the rank ranges, each rank's
fragments (its parts of the documents) and the chains of ranks a crossing
document runs along. Pure list work on host ints: no tensor, no collective."""

from __future__ import annotations

from gdn_kcp.kernels import CROSSING_IN, CROSSING_OUT


def default_ranges(T: int, R: int) -> list[tuple[int, int]]:
    """Contiguous ranges as equal as possible: rank r holds ``[r T // R, (r + 1) T // R)``."""
    return [(r * T // R, (r + 1) * T // R) for r in range(R)]


def check_ranges(ranges: object, T: int, R: int) -> list[tuple[int, int]]:
    if not isinstance(ranges, (list, tuple)) or len(ranges) != R:
        raise ValueError(f"rank_ranges must list one (start, end) per rank (R = {R}), got {ranges!r}")
    pairs = [tuple(int(x) for x in pair) for pair in ranges]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"rank_ranges must hold (start, end) pairs, got {ranges!r}")
    if pairs[0][0] != 0 or pairs[-1][1] != T:
        raise ValueError(f"rank_ranges must cover [0, T = {T}), got {pairs}")
    for r, (start, end) in enumerate(pairs):
        if end < start:
            raise ValueError(f"rank_ranges[{r}] = {(start, end)} ends before it starts")
        if r + 1 < R and pairs[r + 1][0] != end:
            raise ValueError(
                f"rank_ranges must be contiguous, got rank_ranges[{r}] = {(start, end)} and "
                f"rank_ranges[{r + 1}] = {pairs[r + 1]}"
            )
    return pairs


def rank_fragments(bounds: list[int], start: int, end: int, last_rank: bool) -> list[tuple[int, int, int, int]]:
    """``(doc, local_start, local_end, flags)`` of every document part in
    ``[start, end)``. A zero-length document at position p belongs to the rank
    with ``start <= p < end`` (the last rank for p = T): it carries its initial
    state to its final state there."""
    frags = []
    for doc in range(len(bounds) - 1):
        s, e = bounds[doc], bounds[doc + 1]
        lo, hi = max(s, start), min(e, end)
        if lo < hi or (s == e and (start <= s < end or (last_rank and s == end))):
            flags = (CROSSING_IN if s < start else 0) | (CROSSING_OUT if e > end else 0)
            frags.append((doc, lo - start, max(hi, lo) - start, flags))
    return frags


def start_and_end_docs(frags: list[tuple[int, int, int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(start_docs, end_docs)`` of a rank's fragments (:func:`rank_fragments`)."""
    return (tuple(doc for doc, _, _, flags in frags if not flags & CROSSING_IN),
            tuple(doc for doc, _, _, flags in frags if not flags & CROSSING_OUT))


def chain_neighbours(chains: tuple[tuple[int, ...], ...], R: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(rank_prev, rank_next)`` along the chains (-1 for none)."""
    rank_prev, rank_next = [-1] * R, [-1] * R
    for chain in chains:
        for before, after in zip(chain, chain[1:]):
            rank_next[before], rank_prev[after] = after, before
    return tuple(rank_prev), tuple(rank_next)

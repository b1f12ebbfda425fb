"""Segment test cases (docs/kcp.md, "Intra-rank segments"): packings whose ranks hold fragments of many
chunks, crossing in and out, a middle rank, an empty rank and zero-length
documents; every P of each rank's range is checked against the single-rank run."""

from __future__ import annotations

from dataclasses import replace

from kcp_cases import KcpCase, check_case_on_rank, reference

from gdn_kcp import build_kcp_context
from gdn_kcp.plan import segment_range

SEGMENT_CASES = {
    1: KcpCase("seg-one-rank", (0, 0, 7, 300, 330, 900), None, H_qk=1, HV=2, K=16, V=8, l2=True),
    2: KcpCase("seg-cross", (0, 0, 7, 500, 530, 900), None, H_qk=1, HV=2, K=16, V=8),
    3: KcpCase("seg-middle", (0, 5, 5, 1000, 1100), ((0, 300), (300, 800), (800, 1100)), H_qk=1, HV=2, K=16, V=8,
               l2=True),
    4: KcpCase("seg-empty-rank", (0, 30, 30, 700, 711, 900), ((0, 400), (400, 400), (400, 650), (650, 900)),
               H_qk=1, HV=2, K=16, V=8),
}


KDA_SEGMENT_CASES = {R: replace(SEGMENT_CASES[R], name=f"kda-{SEGMENT_CASES[R].name}", kda=True) for R in (1, 3, 4)}
"""The same packings with a gate per key channel (KDA): segments compose the
summaries' ``M`` as matrices already, so the cases differ only in the gate."""


def largest_range(case: KcpCase, R: int) -> int:
    """The largest P any rank of the case may ask for."""
    from gdn_kcp.context import context_from_split, default_ranges

    bounds = list(case.bounds)
    split = case.ranges and list(case.ranges) or default_ranges(bounds[-1], R)
    return max(segment_range(context_from_split(bounds, split, r)) for r in range(R))


def run_every_p(rank: int, R: int, kda: bool = False) -> None:
    """fp64, a2a with initial and final states: every P from 1 to the largest
    range (each rank cuts it to its own); ring without states and a capped
    context at P = 3. ``kda``: the case of ``KDA_SEGMENT_CASES``."""
    case = (KDA_SEGMENT_CASES if kda else SEGMENT_CASES)[R]
    inputs, given, expected = reference(case, True)
    for P in range(1, largest_range(case, R) + 1):
        check_case_on_rank(case, rank, "a2a", inputs, given, expected, segments=P)
    inputs, given, expected = reference(case, False)
    check_case_on_rank(case, rank, "ring", inputs, given, expected, segments=3)
    max_docs = len(case.bounds) + 1
    inputs, given, expected = reference(case, True, max_docs)
    check_case_on_rank(case, rank, "a2a", inputs, given, expected, max_docs=max_docs, segments=3)
    assert build_kcp_context(list(case.bounds), rank_ranges=case.ranges and list(case.ranges)).R == R


TIGHT_CAPPED = KcpCase("seg-tight-capped", (0, 364, 748, 1200), ((0, 300), (300, 940), (940, 1200)), H_qk=1, HV=2,
                       K=16, V=8)
"""Rank 1 holds 640 tokens (10 chunks; at P = 2, L = 5): a crossing-in fragment
of one chunk, a document of 6 chunks (two segments) and a crossing-out
fragment of 3 chunks: 4 summary rows, the capped bound ``2 P - 2 + 2``."""


def run_tight_capped(rank: int, R: int) -> None:
    """The capped bound is reached (rank 1), and every rank equals the one-rank run."""
    case, max_docs = TIGHT_CAPPED, 4
    inputs, given, expected = reference(case, True, max_docs)
    check_case_on_rank(case, rank, "a2a", inputs, given, expected, max_docs=max_docs, segments=2)
    if rank == 1:
        from gdn_kcp.context import context_from_split

        exact = context_from_split(list(case.bounds), list(case.ranges), 1)
        capped = context_from_split(list(case.bounds), list(case.ranges), 1, max_docs=max_docs)
        assert exact.summary_rows(2) == capped.summary_rows(2) == 4


PLANNED = KcpCase("seg-planned", (0, 30, 30, 2000, 2011, 2600, 2600, 2600),
                  ((0, 400), (400, 400), (400, 2600), (2600, 2600)), H_qk=1, HV=2, K=16, V=8)
"""The plan's P (``segments=None``) on 132 SMs: P > 1 on every rank, among them
an empty rank and a last rank that holds only zero-length documents (no chunk)."""


def run_planned(rank: int, R: int) -> None:
    """Every rank takes the plan's P (> 1, the same on every rank) and equals the
    one-rank run, exact and capped."""
    from gdn_kcp.context import context_from_split
    from gdn_kcp.plan import plan_segments

    case = PLANNED
    plans = {plan_segments(context_from_split(list(case.bounds), list(case.ranges), r, n_sms=132), case.HV, case.K,
                           case.V) for r in range(R)}
    assert len(plans) == 1 and plans.pop() > 1
    for max_docs in (None, len(case.bounds) + 1):
        inputs, given, expected = reference(case, True, max_docs)
        check_case_on_rank(case, rank, "a2a", inputs, given, expected, max_docs=max_docs, n_sms=132)

"""The segment plan: how many segments P each long fragment is walked as.

P is a function of the context's metadata (the longest fragment on any rank,
``plan_chunks``; the most fragments on one rank, ``plan_frags``; both the same
on every rank), the heads and head dims, and the SM count ``ctx.n_sms``: so
the same topology gives the same P on every rank, and a capped context's P
depends on its caps alone.

Cost model, in dependent walk steps (one chunk step of a walk program; its
latency is the same for every walk, and one step of the composition costs
about as much):

- a walk launch of ``x`` programs runs in ``waves(x) = ceil(x / (n_sms r))``
  waves, ``r`` = walk programs resident per SM (:data:`WALK_RESIDENT`);
- ``P = 1``: the tape walk, ``n`` steps (n = ``plan_chunks``) of
  ``F HV ceil(V / BV)`` programs (F = ``plan_frags``): ``n waves(F HV Vt)``;
- ``P > 1``: phase 1 folds the P segments of each fragment, ``ceil(n / P)``
  steps of ``F P HV ceil((V + K) / BV)`` programs (``[S | M]``); phase 2
  composes P rows, ``P`` steps of ``F HV Vt`` programs; phase 3 walks the
  ``F P`` segments, ``ceil(n / P)`` steps of ``F P HV Vt`` programs.

The plan takes the P in ``[1, min(64, n)]`` of least cost (the smaller on a
tie). Every fragment is costed as long as the longest: an upper bound, under
which the plan keeps P = 1 when the rank's fragments already fill the device.
The backward mirrors the forward (adjoint summaries of width V, the forward's
M reused), so the forward's P serves both.

Example: one document of 32,768 tokens (n = 512 chunks), HV = 32, K = V =
128 on 132 SMs. P = 1 runs 64 programs, one wave of 512 steps. With today's
walks (r = 1) P = 2 costs ``256 (2 + 1) + 2 = 770`` (phase 1 needs 256
programs, two waves): segments add work, and 64 programs already hold half
the device, so the plan keeps P = 1. With r = 2 (264 slots) P = 4 costs
``128 (2 + 1) + 4 = 388`` and the plan picks 4 (:func:`walk_cost`,
``resident=2``): the walks must first fit two programs per SM.
"""

from __future__ import annotations

from gdn_kcp.context import KcpContext
from gdn_kcp.kernels.segments import MAX_SEGMENTS

WALK_VALUE_TILE = 64
"""Value columns per walk program (``kernels.triton._common.value_block``)."""

WALK_RESIDENT = 1
"""Walk programs resident on one SM at once. The Triton walks compile (sm_90,
bf16, K = V = 128) to 255 registers x 8 warps, the whole register file of an
SM (the README's compile table; tests/test_triton_compile.py checks this value
against the compile). At 4 warps two would fit, but tape_walk then spills
1,880 B per thread at BV = 64; at BV = 32 it spills 564 B but needs twice the
programs, which cancels the second slot."""


def _waves(programs: int, slots: int) -> int:
    return -(-programs // slots)


def walk_cost(P: int, *, chunks: int, frags: int, HV: int, K: int, V: int, n_sms: int,
              resident: int = WALK_RESIDENT) -> int:
    """Dependent steps of the forward walks at P segments (the module's model)."""
    slots, F = n_sms * resident, max(frags, 1)
    tiles = -(-V // WALK_VALUE_TILE)
    if P == 1:
        return chunks * _waves(F * HV * tiles, slots)
    steps = -(-chunks // P)
    summary = _waves(F * P * HV * -(-(V + K) // WALK_VALUE_TILE), slots)
    walk = _waves(F * P * HV * tiles, slots)
    return steps * (summary + walk) + P * _waves(F * HV * tiles, slots)


def segment_range(ctx: KcpContext) -> int:
    """The largest P an int ``segments`` may ask for on this rank:
    ``max(1, min(64, chunks of the rank's longest fragment))``."""
    return max(1, min(MAX_SEGMENTS, ctx.index.max_frag_chunks))


def plan_segments(ctx: KcpContext, HV: int, K: int, V: int) -> int:
    """The P of least :func:`walk_cost` for this context's metadata."""
    chunks = ctx.plan_chunks
    if chunks <= 1:
        return 1
    costs = {P: walk_cost(P, chunks=chunks, frags=ctx.plan_frags, HV=HV, K=K, V=V, n_sms=ctx.n_sms)
             for P in range(1, min(MAX_SEGMENTS, chunks) + 1)}
    return min(costs, key=lambda P: (costs[P], P))


def segments_for(ctx: KcpContext, HV: int, K: int, V: int, segments: int | None) -> int:
    """The P a call runs: ``segments`` when given (checked against the range of
    :func:`segment_range`), else the plan's."""
    if segments is None:
        return plan_segments(ctx, HV, K, V)
    top = segment_range(ctx)
    if not 1 <= segments <= top:
        raise ValueError(
            f"segments = {segments} is out of range for this rank: it must lie in [1, {top}] "
            f"(max(1, min({MAX_SEGMENTS}, {ctx.index.max_frag_chunks} chunks of its longest fragment)))"
        )
    return segments

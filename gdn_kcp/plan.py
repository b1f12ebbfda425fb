"""The segment plan: how many segments P each long fragment is walked as.

P is a function of the context's metadata (the longest fragment on any rank,
``plan_chunks``; the most fragments on one rank, ``plan_frags``; both the same
on every rank), the heads and head dims, and the SM count ``ctx.n_sms``: so
the same topology gives the same P on every rank, and a capped context's P
depends on its caps alone.

Cost model: the time of the forward's walks, the same model as
``benchmarks/roofline.py``'s serial term. A walk launch of x programs, each a
chain of s dependent steps that stream beta bytes and do work of w seconds
at one SM's rates, runs ``waves(x) = ceil(x / (n_sms r))`` waves (r:
programs resident per SM, :data:`WALK_RESIDENT` for the walks,
:data:`COMPOSE_RESIDENT` for phase 2), and each step takes the longer of the
step latency plus its work (times the programs sharing an SM) and the time
the programs in flight need to stream their bytes:
``max(STEP_LATENCY + sharing w, beta in_flight / min(HBM, busy SMs x SM_BANDWIDTH))``.

- ``P = 1``: the tape walk, ``n`` steps (n = ``plan_chunks``) of
  ``F HV Vt`` programs (F = ``plan_frags``, ``Vt = ceil(V / 64)``), each step
  reading k, w, u and writing v_new and h (bf16; ``tape_step_bytes``);
- ``P > 1``: phase 1 folds the P segments of each fragment, ``ceil(n / P)``
  steps of ``F P HV ceil((V + K) / 64)`` programs reading k, w, u; phase 2
  composes P rows, ``P`` steps of ``F HV ceil(V / 16)`` programs (fp32 M and S);
  phase 3 walks the ``F P`` segments, ``ceil(n / P)`` steps of ``F P HV Vt``
  programs.

Every fragment is costed as long as the longest (an upper bound). The plan
takes the P in ``[1, min(64, n)]`` of least cost (the smaller on a 1 % tie).

What it says: segments pay when the walk is bound by its steps or by the
bandwidth of the few SMs it occupies, that is when it runs few programs
(few heads per rank, as under tensor-parallel head sharding). One document of
32,768 tokens (n = 512) with K = V = 128 on 132 SMs: at HV = 4 (8 programs,
each bound by its SM's bandwidth) P = 1 costs 288 us and the plan picks P = 5
(135 us); at HV = 32 (64 programs) the tape walk streams 2.2 GB, already
HBM-bound at 450 us, and every P > 1 adds phase 1's reads (P = 4: 1,050 us),
so the plan keeps P = 1 (tests/test_segments.py checks these figures). It
would keep P = 1 there with no bandwidth limit at all (282 us, against 329 at
P = 4): segments triple the walk's program-steps (phase 1 folds the V + K
columns, phase 3 walks again), and the 68 SMs the tape walk leaves idle add at
most 132 / 64 of tensor throughput.
"""

from __future__ import annotations

import functools

from gdn_kcp.context import KcpContext
from gdn_kcp.kernels.chunk_index import CHUNK_SIZE
from gdn_kcp.kernels.segments import MAX_SEGMENTS

WALK_VALUE_TILE = 64
"""Value columns per walk program (``kernels.triton._common.value_block``)."""

COMPOSE_VALUE_TILE = 16
"""Value columns per composition program (``kernels.triton.compose_segments.BV_COMPOSE``:
its exact fp32 products stay in registers at 16 columns)."""

WALK_RESIDENT = 2
"""Walk programs resident on one SM at once. The Triton forward walks (tape
walk, segment summary) compile (sm_90, bf16, K = V = 128) to 255 registers x
4 warps, half the register file of an SM (the README's compile table;
tests/test_segments.py checks this value against the tape walk's warps)."""

COMPOSE_RESIDENT = 1
"""Composition programs resident on one SM: ``compose_segments`` compiles to
239 / 244 registers x 8 warps (the README's compile table)."""

STEP_LATENCY = 0.27e-6
"""Seconds of one dependent walk step (``benchmarks/roofline.py``'s default:
two dependent cross-warp exchanges of about 250 cycles at 1.83 GHz)."""

HBM_BANDWIDTH = 4.8e12
"""Bytes per second of HBM (H200 SXM)."""

SM_BANDWIDTH = 64 * 1.83e9
"""Bytes per second one SM moves to and from L2 (64 B per clock, roofline's assumption)."""

SM_TENSOR_RATE = 989e12 / 132
"""bf16 FLOP/s of one SM's tensor cores (H200 SXM, dense, over its 132 SMs)."""

SM_FMA_RATE = 67e12 / 132
"""fp32 FLOP/s of one SM's FMA pipes (the compositions' exact products)."""


def _launch(programs: int, steps: int, step_bytes: int, step_time: float, n_sms: int, resident: int) -> float:
    """Seconds of a walk launch of ``programs`` chains of ``steps`` steps, each
    step ``step_time`` seconds of work at one SM's rates."""
    if programs == 0 or steps == 0:
        return 0.0
    in_flight = min(programs, n_sms * resident)
    busy = min(programs, n_sms)
    waves = -(-programs // in_flight)
    sharing = -(-in_flight // busy)  # programs sharing one SM's rates
    bandwidth = min(HBM_BANDWIDTH, busy * SM_BANDWIDTH)
    return waves * steps * max(STEP_LATENCY + sharing * step_time, step_bytes * in_flight / bandwidth)


def tape_step_bytes(K: int, V: int) -> int:
    """Bytes one tape-walk program moves per step at bf16: k and w rows, the
    k norm and gate, u read and v_new written, the h tile."""
    C, BV = CHUNK_SIZE, min(WALK_VALUE_TILE, V)
    return 2 * C * K * 2 + C * (4 + 2) + 2 * C * BV * 2 + K * BV * 2


def walk_cost(P: int, *, chunks: int, frags: int, HV: int, K: int, V: int, n_sms: int,
              resident: int = WALK_RESIDENT) -> float:
    """Seconds of the forward's walks at P segments (the module's model)."""
    C, F = CHUNK_SIZE, max(frags, 1)
    BV = min(WALK_VALUE_TILE, V)
    tiles = -(-V // WALK_VALUE_TILE)
    walk_step = 2 * (2 * C * K * BV) / SM_TENSOR_RATE  # V_new = U - W S, then K^T V_new: bf16 tensor products
    if P == 1:
        return _launch(F * HV * tiles, chunks, tape_step_bytes(K, V), walk_step, n_sms, resident)
    steps = -(-chunks // P)
    summary_bytes = 2 * C * K * 2 + C * (4 + 2) + C * BV * 2
    BC = min(COMPOSE_VALUE_TILE, V)
    compose_bytes = (K * K + 2 * K * BC) * 4
    compose_step = 2 * K * K * BC / SM_FMA_RATE
    return (_launch(F * P * HV * -(-(V + K) // WALK_VALUE_TILE), steps, summary_bytes, walk_step, n_sms, resident)
            + _launch(F * HV * -(-V // BC), P, compose_bytes, compose_step, n_sms, COMPOSE_RESIDENT)
            + _launch(F * P * HV * tiles, steps, tape_step_bytes(K, V), walk_step, n_sms, resident))


def segment_range(ctx: KcpContext) -> int:
    """The largest P an int ``segments`` may ask for:
    ``max(1, min(64, chunks of the longest fragment on any rank))``. A
    group-wide fact (``ctx.plan_chunks``), so every rank accepts or refuses
    the same P and none is left waiting in a collective for a rank that
    raised; a rank whose own fragments are shorter cuts them into fewer
    segments (at least one chunk each)."""
    return max(1, min(MAX_SEGMENTS, ctx.plan_chunks))


def plan_segments(ctx: KcpContext, HV: int, K: int, V: int) -> int:
    """The P of least :func:`walk_cost` for this context's metadata (the
    smallest P within 1 % of the least cost)."""
    return _plan(ctx.plan_chunks, ctx.plan_frags, ctx.n_sms, int(HV), int(K), int(V))


@functools.lru_cache(maxsize=4096)
def _plan(chunks: int, frags: int, n_sms: int, HV: int, K: int, V: int) -> int:
    """:func:`plan_segments` on plain ints, computed once per fact set (a call
    and its queries ask for P a dozen times)."""
    if chunks <= 1:
        return 1
    costs = {P: walk_cost(P, chunks=chunks, frags=frags, HV=HV, K=K, V=V, n_sms=n_sms)
             for P in range(1, min(MAX_SEGMENTS, chunks) + 1)}
    best = min(costs.values())
    return min(P for P, cost in costs.items() if cost <= best * 1.01)


def segments_for(ctx: KcpContext, HV: int, K: int, V: int, segments: int | None) -> int:
    """The P a call runs: ``segments`` when given (checked against the range of
    :func:`segment_range`), else the plan's."""
    if segments is None:
        return plan_segments(ctx, HV, K, V)
    top = segment_range(ctx)
    if not 1 <= segments <= top:
        raise ValueError(
            f"segments = {segments} is out of range: it must lie in [1, {top}] "
            f"(max(1, min({MAX_SEGMENTS}, {ctx.plan_chunks} chunks of the longest fragment on any rank)))"
        )
    return segments

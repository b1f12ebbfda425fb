"""The segment plan: how many segments P each long fragment is walked as.

P is a function of the context's metadata (the longest fragment on any rank,
``plan_chunks``; the most fragments on one rank, ``plan_frags``; both the same
on every rank), the heads and head dims, and the SM count ``ctx.n_sms``: so
the same topology gives the same P on every rank, and a capped context's P
depends on its caps alone.

Cost model: the time of the forward's walk launches on the shared H200 model
(:func:`gdn_kcp.cost_model.terms`, whose three constants are fitted to
measured times) on ``n_sms`` SMs, with the walks' compile facts
(:data:`WALK_FACTS`, :data:`COMPOSE_FACTS`: registers, warps, shared memory
and spills of the sm_90 compile, which tests/test_roofline.py ties to the
committed compile facts). ``benchmarks/roofline.py`` times the same
launches (:func:`walk_launches`).

- ``P = 1``: the walk with the output (the forward's walk under the default
  save modes at K <= 128; ``save_mode="full"`` and K > 128 walk the tape
  walk, priced as this one), ``n`` steps (n = ``plan_chunks``) of ``F HV Vt`` programs
  (F = ``plan_frags``, ``Vt = ceil(V / 32)``), each step reading q, k, w,
  u and the scores and writing o (bf16; ``walk_step_bytes``);
- ``P > 1``: phase 1 folds the P segments of each fragment, ``ceil(n / P)``
  steps of ``F P HV ceil((V + K) / 32)`` programs reading k, w, u; phase 2
  composes P rows, ``P`` steps of ``F HV ceil(V / 16)`` programs (fp32 M and S);
  phase 3 walks the ``F P`` segments, ``ceil(n / P)`` steps of ``F P HV Vt``
  programs.

Every fragment is costed as long as the longest (an upper bound). The plan
takes the P in ``[1, min(64, n)]`` of least cost (the smaller on a 1 % tie).
The table of the plan in docs/kcp.md and tests/test_segments.py state what it picks.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from gdn_kcp.context import KcpContext
from gdn_kcp.cost_model import H200, Launch, Machine, Work, terms, walk
from gdn_kcp.kernels.chunk_index import CHUNK_SIZE
from gdn_kcp.kernels.segments import MAX_SEGMENTS

WALK_VALUE_TILE = 32
"""Value columns per walk program (``kernels.triton._common.walk_block``)."""

SEGMENT_VALUE_TILE = 32
"""Value columns per phase-1 program, over the V + K columns of ``[S | M]``
(``kernels.triton._common.walk_block``)."""

COMPOSE_VALUE_TILE = 16
"""Value columns per composition program (``kernels.triton.compose_segments.BV_COMPOSE``:
its exact fp32 products stay in registers at 16 columns)."""

WALK_FACTS = {"products": "wgmma", "num_warps": 8, "registers": 230, "shared": 82_452, "spill_stores": 0,
              "spill_loads": 0}
"""Compile facts of the walk with the output, the forward's walk in the
default save modes (sm_90, bf16, K = V = 128 as a launch specialises them,
triton 3.6: the committed ``benchmarks/h200_facts.json``, which a test ties
to these): 230 registers x 8 warps, one program per SM, no spills."""

SEGMENT_FACTS = {"products": "wgmma", "num_warps": 8, "registers": 124, "shared": 49_408, "spill_stores": 0,
                 "spill_loads": 0}
"""The segment summary's (phase 1) compile facts, as :data:`WALK_FACTS`: two programs per SM."""

COMPOSE_FACTS = {"products": "fma", "num_warps": 8, "registers": 170, "shared": 20_480, "spill_stores": 0,
                 "spill_loads": 0}
"""``compose_segments``' (phase 2) compile facts: exact fp32 products, one program per SM."""


def walk_step_bytes(K: int, V: int) -> int:
    """Bytes one program of the walk with the output moves per step at bf16:
    q, k and w rows, the q and k norms (fp32) and the gate, u read, the
    chunk's scores read and o written."""
    C, BV = CHUNK_SIZE, min(WALK_VALUE_TILE, V)
    return 3 * C * K * 2 + C * (2 * 4 + 2) + C * BV * 2 + C * C * 2 + C * BV * 2


def walk_launches(P: int, *, chunks: int, frags: int, HV: int, K: int, V: int) -> list[tuple[Launch, dict]]:
    """The forward's walk launches at P segments, each with its compile facts
    (the module's phases; every fragment as long as ``chunks``)."""
    C, F = CHUNK_SIZE, max(frags, 1)
    BV = min(WALK_VALUE_TILE, V)
    tiles = -(-V // WALK_VALUE_TILE)
    # diag(gamma) Q S, V_new = U - W S, K^T V_new and P V_new: bf16 tensor products
    step = Work(bf16=3 * (2 * C * K * BV) + 2 * C * C * BV, bytes=walk_step_bytes(K, V))
    if P == 1:
        return [(walk("fwd", "walk_output_kernel", F * HV * tiles, chunks, step), WALK_FACTS)]
    steps = -(-chunks // P)
    SB = min(SEGMENT_VALUE_TILE, V)  # phase 1's value tile
    summary = Work(bf16=2 * (2 * C * K * SB), bytes=2 * C * K * 2 + C * (4 + 2) + C * SB * 2)
    BC = min(COMPOSE_VALUE_TILE, V)
    compose = Work(fp32=2 * K * K * BC, bytes=(K * K + 2 * K * BC) * 4)
    return [(walk("fwd", "segment_summary_kernel", F * P * HV * -(-(V + K) // SEGMENT_VALUE_TILE), steps, summary),
             SEGMENT_FACTS),
            (walk("fwd", "compose_segments_kernel", F * HV * -(-V // BC), P, compose), COMPOSE_FACTS),
            (walk("fwd", "walk_output_kernel", F * P * HV * tiles, steps, step), WALK_FACTS)]


def walk_cost(P: int, *, chunks: int, frags: int, HV: int, K: int, V: int, n_sms: int,
              machine: Machine = H200) -> float:
    """Seconds of the forward's walks at P segments on ``n_sms`` SMs of the
    model's machine (the module's model): its per-SM rates, ``n_sms`` of them."""
    share = n_sms / machine.sms
    m = replace(machine, sms=n_sms, bf16=machine.bf16 * share, tf32=machine.tf32 * share, fp32=machine.fp32 * share)
    return sum(terms(launch, facts, m)["time"]
               for launch, facts in walk_launches(P, chunks=chunks, frags=frags, HV=HV, K=K, V=V))


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
    return _planned(ctx.plan_chunks, ctx.plan_frags, ctx.n_sms, int(HV), int(K), int(V))


@torch.compiler.assume_constant_result
def _planned(chunks: int, frags: int, n_sms: int, HV: int, K: int, V: int) -> int:
    """:func:`_plan`, a constant to torch.compile: traced code takes the plan's
    P, not a trace of the cost model's Python (nor of its cache wrapper)."""
    return _plan(chunks, frags, n_sms, HV, K, V)


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

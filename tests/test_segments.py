"""Intra-rank segments (docs/kcp.md, "Intra-rank segments"): exact against the single-rank
run at every P on R = 1..4, within rounding of P = 1 in fp32, the option's
range, and the plan."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from arena_cases import CAPPED_MAX_DOCS, H_QK, HV, K, SEGMENT_PACKINGS, V, run_arena
from segment_cases import KDA_SEGMENT_CASES, SEGMENT_CASES, run_every_p, run_planned, run_tight_capped
from spawn import spawn_ranks


@pytest.mark.parametrize("R", sorted(SEGMENT_PACKINGS))
@pytest.mark.parametrize("P", [2, 7])
def test_recorded_bytes_equal_the_layout_with_segments(R, P):
    """The arena check of tests/test_workspace_arena.py at P segments: every
    phase, call and pool at tolerance 0, and the saved bytes."""
    spawn_ranks(R, run_arena, torch.float32, None, P)


@pytest.mark.parametrize("R", [1, 2])
def test_capped_segments_record_one_figure_for_every_packing(R):
    """On a capped context P is a cap: random packings record the same figures."""
    spawn_ranks(R, run_arena, torch.float32, CAPPED_MAX_DOCS, 3)


@pytest.mark.parametrize("R", sorted(SEGMENT_CASES))
def test_every_p_equals_single_rank_fp64(R):
    spawn_ranks(R, run_every_p)


@pytest.mark.parametrize("R", sorted(KDA_SEGMENT_CASES))
def test_kda_every_p_equals_single_rank_fp64(R):
    """KDA (a gate per key channel) on the same packings: every P exact."""
    spawn_ranks(R, run_every_p, True)


def test_kda_recorded_bytes_equal_the_layout_with_segments():
    """The arena check on KDA calls at P = 2 segments on 2 ranks (the ``dgcum`` pool ``[T, HV, K]``)."""
    spawn_ranks(2, run_arena, torch.float32, None, 2, (H_QK, HV, K, V), True)


def test_capped_bound_is_reached_and_holds():
    """A capped rank whose packing needs every summary row of the bound."""
    spawn_ranks(3, run_tight_capped)


def test_the_plans_p_on_every_rank():
    """segments=None on 132 SMs: the plan's P (> 1) on 4 ranks, an empty one and
    one holding only zero-length documents among them, exact and capped."""
    spawn_ranks(4, run_planned)


def test_fp32_within_rounding_of_one_segment():
    """fp32, one rank: every P gives P = 1's outputs and gradients within fp32
    rounding (the composition reorders fp32 sums; measured max rel RMS 1.5e-7,
    against 2e-6 here)."""
    import torch

    from gdn_inputs import make_inputs, rel_rms
    from gdn_kcp import OptionsKcp, build_kcp_context, gdn_kcp

    bounds = [0, 3, 600, 610, 1100]
    inputs = make_inputs(bounds[-1], 2, 4, 32, 16, dtype=torch.float32, seed=5, l2=True)
    ctx = build_kcp_context(bounds, n_sms=1)
    state0 = torch.randn(4, 4, 32, 16, generator=torch.Generator().manual_seed(1))
    results = {}
    for P in (1, 2, 3, 8):
        leaves = [x.clone().requires_grad_() for x in inputs] + [state0.clone().requires_grad_()]
        o, fs = gdn_kcp(*leaves[:5], ctx, options=OptionsKcp(segments=P, use_qk_l2norm=True),
                        initial_state=leaves[5], output_final_state=True)
        grads = torch.autograd.grad(o.square().sum() + fs.square().sum(), leaves)
        results[P] = [o, fs, *grads]
    for P in (2, 3, 8):
        for name, ours, ref in zip(("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"), results[P], results[1]):
            assert rel_rms(ours, ref) < 2e-6, (P, name, rel_rms(ours, ref))


def test_segments_option_range():
    from gdn_kcp import OptionsKcp, build_kcp_context, gdn_workspace_bytes_kcp

    for bad in (0, -1, 65, True, 2.0, "3"):
        with pytest.raises(ValueError, match=r"OptionsKcp.segments must be None or an int in \[1, 64\], got"):
            OptionsKcp(segments=bad)
    ctx = build_kcp_context([0, 100, 700], n_sms=1)  # longest fragment: 600 tokens, 10 chunks
    assert gdn_workspace_bytes_kcp(ctx, 1, 2, 16, 16, options=OptionsKcp(segments=10)) > 0
    with pytest.raises(ValueError, match=r"segments = 11 is out of range: it must lie in \[1, 10\] \(max\(1, "
                                         r"min\(64, 10 chunks of the longest fragment on any rank\)\)\)"):
        gdn_workspace_bytes_kcp(ctx, 1, 2, 16, 16, options=OptionsKcp(segments=11))
    empty = build_kcp_context([0, 0], n_sms=1)
    with pytest.raises(ValueError, match=r"segments = 2 is out of range: it must lie in \[1, 1\]"):
        gdn_workspace_bytes_kcp(empty, 1, 2, 16, 16, options=OptionsKcp(segments=2))


def test_plan_cost_model():
    """The documented model on one document of 32,768 tokens (n = 512 chunks),
    K = V = 128, 132 SMs, with the walks' compile facts (their spills reloaded
    every step): the walk with the output's steps are bound by their latency
    and products, so at HV = 32 (128 programs, one per SM) segments only add
    phase 1's work: P = 1; at HV = 4 its 16 programs take as long, and
    segments spread them over more SMs: P = 8 at about a third of the time."""
    import math
    from dataclasses import replace

    from gdn_kcp.context import context_from_split
    from gdn_kcp.cost_model import H200
    from gdn_kcp.plan import WALK_FACTS, plan_segments, walk_cost, walk_step_bytes

    shape = dict(chunks=512, frags=1, K=128, V=128, n_sms=132)
    assert walk_step_bytes(128, 128) == 66176  # value tiles of 32
    spills = (WALK_FACTS["spill_stores"] + WALK_FACTS["spill_loads"]) * 32 * WALK_FACTS["num_warps"]
    step = 66176 + spills  # bytes one walk program moves per step
    eta = H200.memory_efficiency
    # diag(gamma) Q S, W S, K^T V_new (2*64*128*32 each) and P V_new (2*64*64*32): one step's, one SM
    products = (3 * (2 * 64 * 128 * 32) + 2 * 64 * 64 * 32) / (H200.bf16 / 132 * H200.compute_efficiency)
    assert step * 128 / (4.8e12 * eta) < H200.step_latency + products  # 128 programs: bound by latency and work
    assert walk_cost(1, HV=32, **shape) == pytest.approx(512 * (H200.step_latency + products))  # 1,009 us
    assert walk_cost(4, HV=32, **shape) * 1e6 == pytest.approx(2117, abs=1)
    assert walk_cost(1, HV=4, **shape) == walk_cost(1, HV=32, **shape)  # 16 programs: each as long
    assert walk_cost(8, HV=4, **shape) * 1e6 == pytest.approx(313, abs=1)
    ctx = context_from_split([0, 32768], [(0, 32768)], 0, n_sms=132)
    assert plan_segments(ctx, 32, 128, 128) == 1
    assert plan_segments(ctx, 4, 128, 128) == 8
    assert plan_segments(context_from_split([0, 32768], [(0, 32768)], 0, n_sms=2), 4, 128, 128) == 1
    # many fragments fill the device: P = 1
    assert min(range(1, 65), key=lambda P: walk_cost(P, HV=4, **dict(shape, frags=64))) == 1
    # HV = 32 keeps P = 1 with no bandwidth limit at all: the steps' latency and products alone
    unbound = replace(H200, hbm=math.inf, sm_bytes_per_clock=math.inf)
    alone = {P: walk_cost(P, HV=32, machine=unbound, **shape) * 1e6 for P in range(1, 65)}
    assert min(alone, key=alone.get) == 1
    assert (round(alone[1]), round(alone[4])) == (1009, 2063)
    # the table of the plan in docs/kcp.md
    stated = (Path(__file__).resolve().parent.parent / "docs" / "kcp.md").read_text()
    for HV in (32, 8, 4, 2):
        P = plan_segments(ctx, HV, 128, 128)
        cost = {p: walk_cost(p, HV=HV, **shape) * 1e6 for p in (1, P)}
        row = f"| {HV} | {cost[1]:,.0f} us | {P} | {cost[P]:,.0f} us |"
        assert row in stated, row


def test_plan_constants_are_the_kernels():
    """The plan's tiles and warps are the Triton walks' launch facts (its
    registers, shared memory and spills: tests/test_roofline.py ties them to
    the committed compile facts); the walk and the composition hold one
    program per SM, the segment summary (phase 1, 124 registers) two."""
    pytest.importorskip("triton")
    from gdn_kcp.cost_model import resident
    from gdn_kcp.kernels.triton._common import walk_block
    from gdn_kcp.kernels.triton.compose_segments import BV_COMPOSE
    from gdn_kcp.kernels.triton.compose_segments import NUM_WARPS as COMPOSE_WARPS
    from gdn_kcp.kernels.triton.segment_summary import NUM_WARPS as SUMMARY_WARPS
    from gdn_kcp.kernels.triton.tape_walk import NUM_WARPS
    from gdn_kcp.plan import (COMPOSE_FACTS, COMPOSE_VALUE_TILE, SEGMENT_FACTS, SEGMENT_VALUE_TILE, WALK_FACTS,
                              WALK_VALUE_TILE)

    assert (WALK_VALUE_TILE, SEGMENT_VALUE_TILE, COMPOSE_VALUE_TILE) == (walk_block(128), walk_block(256), BV_COMPOSE)
    assert (WALK_FACTS["num_warps"], SEGMENT_FACTS["num_warps"], COMPOSE_FACTS["num_warps"]) == (
        NUM_WARPS, SUMMARY_WARPS, COMPOSE_WARPS)
    assert (resident(WALK_FACTS), resident(SEGMENT_FACTS), resident(COMPOSE_FACTS)) == (1, 2, 1)


def test_plan_is_the_same_on_every_rank():
    """The plan reads the topology's facts (longest fragment anywhere, most
    fragments on a rank, SM count), not the rank's own: one P for all ranks."""
    from gdn_kcp.context import context_from_split
    from gdn_kcp.plan import plan_segments

    bounds, ranges = [0, 10, 30000, 30010, 65536], [(0, 16384), (16384, 16384), (16384, 40000), (40000, 65536)]
    for n_sms in (1, 132, 10_000):
        for max_docs in (None, 8):
            plans = {plan_segments(context_from_split(bounds, ranges, r, n_sms=n_sms, max_docs=max_docs), 2, 128, 128)
                     for r in range(4)}
            assert len(plans) == 1, (n_sms, max_docs, plans)
    # a device wide enough for every segment program: the plan cuts the long document of one value head
    wide = context_from_split(bounds, ranges, 1, n_sms=132)
    assert plan_segments(wide, 1, 128, 128) > 1
    assert plan_segments(context_from_split(bounds, ranges, 1, n_sms=2), 1, 128, 128) == 1


def test_budget_prints_p():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "gdn_kcp", "budget", "--docs", "32768", "--hq", "16", "--hv", "32",
                          "--segments", "4", "--detail"], capture_output=True, text=True, check=True).stdout
    assert "segments: the plan's P = 1 on 132 SMs (longest fragment 512 chunks" in out  # HV = 32: HBM-bound
    assert "segments P = 4: 4 summary rows" in out
    assert "fwd.phase.segments" in out and "bwd.phase.compose_adjoint" in out


def test_row_counts_of_every_p_are_the_per_p_counts():
    """The context's 64 summary-row counts (one histogram) equal the per-P
    definition, on random fragment lists with crossing and padding flags."""
    from gdn_kcp.kernels.chunk_index import CROSSING_IN, CROSSING_OUT, PADDING
    from gdn_kcp.kernels.segments import MAX_SEGMENTS, summary_row_counts, summary_rows

    rng = random.Random(5)
    for _ in range(50):
        F = rng.randint(0, 40)
        n = [rng.choice([0, 1, 2, 3, rng.randint(1, 300)]) for _ in range(F)]
        flags = [0] * F
        if F:
            flags[0] |= rng.choice([0, CROSSING_IN])
            flags[-1] |= rng.choice([0, CROSSING_OUT, PADDING])
        top = max(n, default=0) + rng.choice([0, 0, 37])  # the group's longest fragment may be another rank's
        for exchanges in (False, True):
            counts = summary_row_counts(n, flags, top, exchanges=exchanges)
            assert len(counts) == MAX_SEGMENTS
            assert counts == tuple(summary_rows(n, flags, P, top, exchanges=exchanges)
                                   for P in range(1, MAX_SEGMENTS + 1))


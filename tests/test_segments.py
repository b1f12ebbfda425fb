"""Intra-rank segments (issue 12, DESIGN.md §3): exact against the single-rank
run at every P on R = 1..4, within rounding of P = 1 in fp32, the option's
range, and the plan."""

from __future__ import annotations

import pytest
import torch
from arena_cases import CAPPED_MAX_DOCS, SEGMENT_PACKINGS, run_arena
from segment_cases import SEGMENT_CASES, run_every_p
from spawn import spawn_ranks


@pytest.mark.parametrize("R", sorted(SEGMENT_CASES))
def test_every_p_equals_single_rank_fp64(R):
    spawn_ranks(R, run_every_p)


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

"""Byte queries against the real host path at tolerance 0: every phase, call and
pool of the recorded arena, and the bytes the forward really saves, on every
rank of R = 1, 2, 4, 5 for every valid option combination; all combinations
give the single-rank outputs and gradients."""

from __future__ import annotations

import pytest
from arena_cases import PACKINGS, run_arena, valid_options
from spawn import spawn_ranks


def test_option_matrix_is_large():
    assert len(valid_options()) >= 40


@pytest.mark.parametrize("R", sorted(PACKINGS))
def test_recorded_bytes_equal_the_layout(R):
    spawn_ranks(R, run_arena)

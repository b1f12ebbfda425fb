"""Byte queries against the real host path at tolerance 0: every phase, call and
pool of the recorded arena, and the bytes the forward really saves, on every
rank of R = 1, 2, 4 (5 in make test-extended) for every valid option combination; all combinations
give the single-rank outputs and gradients; and at K = 256, V = 512."""

from __future__ import annotations

import pytest
import torch
from arena_cases import CAPPED_MAX_DOCS, CAPPED_R, H_QK, HV, K, PACKINGS, V, run_arena, valid_options
from extended import extended_at
from spawn import spawn_ranks


def test_option_matrix_is_large():
    assert len(valid_options()) >= 40


@pytest.mark.parametrize("R", extended_at(sorted(PACKINGS), {5}))
def test_recorded_bytes_equal_the_layout(R):
    spawn_ranks(R, run_arena)


def test_recorded_bytes_at_fla_head_sizes():
    """K = 256, V = 512 (FLA's layer head sizes, the largest the CUDA programs
    take) on 2 ranks: the queries equal the recorded bytes there too."""
    spawn_ranks(2, run_arena, torch.float32, None, None, (1, 1, 256, 512))


@pytest.mark.parametrize("R", extended_at(CAPPED_R, {4}))
def test_capped_contexts_record_one_figure_for_every_packing(R):
    """Capped contexts over random packings: recorded bytes equal the queries
    at tolerance 0, and the recorded figures of every packing are the same."""
    spawn_ranks(R, run_arena, torch.float32, CAPPED_MAX_DOCS)


@pytest.mark.parametrize("R", (1, 2))
def test_kda_recorded_bytes_equal_the_kda_queries(R):
    """KDA calls (a gate per key channel, hard resets and strong decays among
    the gates) on every valid option combination: the ``kda_*`` queries equal
    the recorded bytes at tolerance 0, and every rank's outputs and gradients
    the single-rank chunk_kda's (R = 4 passed too, 32 s: left to the GDN rows,
    whose terms are the same but one pool, for CI's budget)."""
    spawn_ranks(R, run_arena, torch.float32, None, None, (H_QK, HV, K, V), True)


@pytest.mark.extended  # 43 s on 2 ranks; CI keeps GDN's capped figure and KDA's uncapped bytes
def test_kda_capped_contexts_record_one_figure_for_every_packing():
    spawn_ranks(2, run_arena, torch.float32, CAPPED_MAX_DOCS, None, (H_QK, HV, K, V), True)

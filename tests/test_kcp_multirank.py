"""KCP on real gloo process groups (R = 1..5): every rank's output and gradients
equal the single-rank run on the unsplit stream, with both exchanges, and the
bytes the exchanges hand to torch.distributed equal gdn_comm_bytes_kcp."""

from __future__ import annotations

import pytest
from kcp_cases import CASES, expect_metadata_error, run_cases, run_state_modes
from spawn import spawn_ranks


@pytest.mark.parametrize("R", sorted(CASES))
def test_kcp_equals_single_rank(R):
    spawn_ranks(R, run_cases)


@pytest.mark.parametrize("R", [2, 3])
def test_states_under_the_replaying_modes(R):
    """boundary_mode="replay" and save_for_backward=False with initial and
    final states, a2a and ring: the replayed boundary carries the states."""
    spawn_ranks(R, run_state_modes)


def test_different_metadata_names_the_ranks():
    spawn_ranks(3, expect_metadata_error)

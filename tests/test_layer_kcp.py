"""GatedDeltaNet with kcp_context on R = 1..4 gloo ranks equals the one-rank
layer: rows, input gradients and summed parameter gradients, exact and capped
contexts; the halo rounds the rank ranges need; both layers (GDN's and
KDA's) compile once over packings (KDA's KCP cases: tests/test_kda_layer.py)."""

from __future__ import annotations

import pytest
from layer_kcp_cases import LAYER_CASES, check_layer_on_rank
from spawn import spawn_ranks

from gdn_kcp.layers.halo import halo_rounds


@pytest.mark.parametrize("R", sorted(LAYER_CASES))
def test_layer_kcp_equals_one_rank(R):
    spawn_ranks(R, check_layer_on_rank)


def test_halo_rounds_reach_back_over_short_ranks():
    assert halo_rounds(((0, 100),), 3) == 0
    assert halo_rounds(((0, 100), (100, 200)), 3) == 1
    assert halo_rounds(((0, 100), (100, 101), (101, 160)), 3) == 2  # 1 token: reach one more rank back
    assert halo_rounds(((0, 60), (60, 60), (60, 62), (62, 180)), 3) == 3  # 2 tokens then an empty rank
    assert halo_rounds(((0, 1), (1, 2), (2, 3)), 3) == 2  # rank 0 is as far back as there is


def test_layer_kcp_compiles_once_on_two_ranks():
    """GatedDeltaNet's and KimiDeltaAttention's layers, in one spawn."""
    from layer_kcp_cases import every_layer_compiles_once

    spawn_ranks(2, every_layer_compiles_once)

"""Layout properties over many contexts and every valid option combination
(pure queries, no process group): each call's arena is exactly its largest
phase, pools bound at the same time never share a byte, and the figures follow
the options."""

from __future__ import annotations

import random

import pytest
import torch
from arena_cases import valid_options

from gdn_kcp import (OptionsKcp, gdn_det_workspace_bytes_kcp, gdn_saved_layout_kcp, gdn_workspace_bytes_kcp,
                     gdn_workspace_layout_kcp)
from gdn_kcp.context import context_from_split, default_ranges
from gdn_kcp.queries.layout import _lifetimes


def random_split(seed: int):
    rng = random.Random(seed)
    R = rng.randint(1, 6)
    T = rng.randint(R, 700)
    bounds = sorted({0, T, *(rng.randint(0, T) for _ in range(rng.randint(0, 6)))})
    if rng.random() < 0.5:
        bounds.insert(1, 0)  # a zero-length document
    cuts = sorted(rng.randint(0, T) for _ in range(R - 1))
    edges = [0, *cuts, T]
    ranges = [(edges[r], edges[r + 1]) for r in range(R)] if rng.random() < 0.7 else default_ranges(T, R)
    return bounds, ranges


def assert_tight(call) -> None:
    assert call.bytes == max(call.phases.values(), default=0), call.call
    spans = _lifetimes(call.events, call.graph)
    pools = call.pools
    for a in pools:
        assert pools[a].offset % 256 == 0 and pools[a].offset + pools[a].nbytes <= call.bytes
        for b in pools:
            if a < b and pools[a].nbytes and pools[b].nbytes:
                live_together = spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
                disjoint = pools[a].offset + pools[a].nbytes <= pools[b].offset or \
                    pools[b].offset + pools[b].nbytes <= pools[a].offset
                assert disjoint or not live_together, (a, b)


@pytest.mark.parametrize("seed", range(24))
def test_arena_is_the_largest_phase_and_pools_never_collide(seed):
    bounds, ranges = random_split(seed)
    shapes = [(1, 3, 16, 8), (16, 48, 128, 128)][seed % 2]
    for rank in range(len(ranges)):
        ctx = context_from_split(bounds, ranges, rank)
        for options in valid_options():
            layout = gdn_workspace_layout_kcp(ctx, *shapes, options=options)
            assert_tight(layout.fwd)
            assert_tight(layout.bwd)
            assert layout.bytes == max(layout.fwd.bytes, layout.bwd.bytes)


def test_graph_replay_binds_every_pool_at_once():
    ctx = context_from_split([0, 10, 300], default_ranges(300, 3), 1)
    layout = gdn_workspace_layout_kcp(ctx, 2, 4, 32, 32, options=OptionsKcp(graph="replay"))
    for call in (layout.fwd, layout.bwd):
        assert call.bytes == sum(spec.nbytes for spec in call.pools.values())
    eager = gdn_workspace_layout_kcp(ctx, 2, 4, 32, 32)
    assert eager.bwd.bytes < layout.bwd.bytes


def test_full_mode_moves_tapes_out_of_the_backward_workspace():
    ctx = context_from_split([0, 200], default_ranges(200, 1), 0)
    light = gdn_workspace_layout_kcp(ctx, 1, 2, 64, 64)
    full = gdn_workspace_layout_kcp(ctx, 1, 2, 64, 64, options=OptionsKcp(save_mode="full"))
    assert "h" in light.bwd.pools and "h" not in full.bwd.pools
    assert full.bwd.bytes < light.bwd.bytes and full.fwd.bytes < light.fwd.bytes


@pytest.mark.parametrize("l2", [False, True])
def test_inverse_mode_saves_A_and_the_norms_and_binds_the_rest(l2):
    """save_mode="inverse": the saved set is A (and the q/k norms), the light
    workspace less those pools; the backward still binds w, v_new and h."""
    ctx = context_from_split([0, 200], default_ranges(200, 1), 0)
    light, inverse = (OptionsKcp(save_mode=mode, use_qk_l2norm=l2) for mode in ("light", "inverse"))
    saved = gdn_saved_layout_kcp(ctx, 1, 2, 64, 64, dtype=torch.bfloat16, options=inverse)
    norms = {"q_rstd", "k_rstd"} if l2 else set()
    assert set(saved) == {"A"} | norms and not gdn_saved_layout_kcp(ctx, 1, 2, 64, 64, options=light)
    assert saved["A"].shape == (200, 2, 64) and saved["A"].dtype == torch.bfloat16
    layouts = {o.save_mode: gdn_workspace_layout_kcp(ctx, 1, 2, 64, 64, dtype=torch.bfloat16, options=o)
               for o in (light, inverse)}
    for call in ("fwd", "bwd"):
        pools = getattr(layouts["light"], call).pools
        assert set(getattr(layouts["inverse"], call).pools) == set(pools) - {"A"} - norms, call
    assert {"w", "v_new", "h"} <= set(layouts["inverse"].bwd.pools)
    assert layouts["inverse"].bwd.bytes < layouts["light"].bwd.bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_tapes_and_backward_buffers_in_the_input_dtype_everything_else_in_the_compute_dtype(dtype):
    ctx = context_from_split([0, 130], default_ranges(130, 1), 0)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    layout = gdn_workspace_layout_kcp(ctx, 1, 2, 64, 64, dtype=dtype)  # light: the backward recomputes the tapes
    pools = {**layout.fwd.pools, **layout.bwd.pools}
    saved = gdn_saved_layout_kcp(ctx, 1, 2, 64, 64, dtype=dtype, options=OptionsKcp(save_mode="full"))
    assert {"A", "w", "v_new", "h", "scores", "dh", "dq_heads"} <= set(pools) and {"A", "w", "v_new", "h"} <= set(saved)
    for name, spec in [*pools.items(), *saved.items()]:
        narrow = name in ("A", "w", "v_new", "h", "scores", "dh", "dv_new", "dq_heads", "dk_heads", "dw")
        assert spec.dtype == (dtype if narrow else compute), name
    assert saved["h"].nbytes == 3 * 2 * 64 * 64 * dtype.itemsize


def test_fp64_doubles_and_det_twin_matches():
    ctx = context_from_split([0, 130], default_ranges(130, 1), 0)
    # bf16 and fp16 tapes take half the bytes of fp32 ones, and the same as each other
    assert gdn_workspace_bytes_kcp(ctx, 1, 2, 64, 64, dtype=torch.bfloat16) == gdn_workspace_bytes_kcp(
        ctx, 1, 2, 64, 64, dtype=torch.float16
    ) < gdn_workspace_bytes_kcp(ctx, 1, 2, 64, 64)
    assert gdn_workspace_bytes_kcp(ctx, 1, 2, 64, 64, dtype=torch.float64) > gdn_workspace_bytes_kcp(ctx, 1, 2, 64, 64)
    assert gdn_det_workspace_bytes_kcp(ctx, 1, 2, 64, 64) == gdn_workspace_bytes_kcp(ctx, 1, 2, 64, 64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(save_mode="full", save_for_backward=False), r"save_mode='full' keeps the forward tapes, but save_for_backward=False"),
        (dict(save_mode="full", boundary_mode="replay"), r"save_mode='full' .* boundary_mode='replay' has nothing"),
        (dict(save_for_backward=False), r"boundary_mode='saved' keeps S_in .* save_for_backward=False"),
        (dict(save_transfer=True, exchange="ring"), r"save_transfer=True .* exchange='ring' sends no M"),
        (dict(schedule="overlap", exchange="ring"), r"schedule='overlap' .* exchange='ring' .* use exchange='a2a'"),
        (dict(schedule="eager"), r"OptionsKcp.schedule must be one of \('serial', 'overlap'\), got 'eager'"),
        (dict(graph="cuda"), r"OptionsKcp.graph must be one of \('off', 'replay'\), got 'cuda'"),
        (dict(save_mode="heavy"), r"OptionsKcp.save_mode must be one of \('light', 'inverse', 'full'\), got 'heavy'"),
        (dict(save_mode="inverse", boundary_mode="replay", save_for_backward=False),
         r"save_mode='inverse' keeps the WY inverse and the q/k norms, but save_for_backward=False keeps no saved set"),
        (dict(deterministic="yes"), r"OptionsKcp.deterministic must be a bool, got 'yes'"),
    ],
)
def test_bad_option_combinations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptionsKcp(**kwargs)


def test_query_argument_checks():
    ctx = context_from_split([0, 130], default_ranges(130, 1), 0)
    with pytest.raises(ValueError, match=r"HV must be a positive int, got 0"):
        gdn_workspace_bytes_kcp(ctx, 1, 0, 16, 16)
    with pytest.raises(ValueError, match=r"HV = 3 must be a multiple of H_qk = 2"):
        gdn_workspace_bytes_kcp(ctx, 2, 3, 16, 16)
    with pytest.raises(ValueError, match=r"call must be None, 'fwd' or 'bwd', got 'both'"):
        gdn_workspace_bytes_kcp(ctx, 1, 2, 16, 16, call="both")
    with pytest.raises(TypeError, match=r"ctx must be a KcpContext, got list"):
        gdn_workspace_bytes_kcp([], 1, 2, 16, 16)


def test_pools_are_rounded_up_to_256_bytes():
    ctx = context_from_split([0, 5], default_ranges(5, 1), 0)
    pools = gdn_workspace_layout_kcp(ctx, 1, 3, 16, 8).bwd.pools
    assert pools["dgcum"].shape == (5, 3) and pools["dgcum"].nbytes == 256  # 60 bytes of fp32
    assert pools["w"].shape == (5, 3, 16) and pools["w"].nbytes == 1024  # 960 bytes
    assert pools["h"].nbytes == 1 * 3 * 16 * 8 * 4  # 1536, already a multiple

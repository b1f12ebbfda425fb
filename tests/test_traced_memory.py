"""The traced host path's memory against the byte queries (docs/compile.md,
"Lowering: the traced host path"). Run eagerly inside ``trace_host_path()``,
each pool is its own tensor and a release frees it: the pools a call holds
at once peak at the layout's ``tensor_bytes`` (the query's phases, each pool
at its tensor's bytes; ``bytes`` adds the arena's 256-byte alignment), on
one rank and three, in every save mode, with segments and under graph
replay, and the results equal the opaque ops' bit for bit. A FakeTensor
``MemTracker`` trace of it equals the real run's and sees exactly those
pools."""

from __future__ import annotations

import pytest
import torch
from fake_tracing_cases import BOUNDS, MAX_DOCS, STEPS, check_fake_peaks_on_rank, real_and_fake_peaks
from spawn import spawn_ranks
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from traced_memory_cases import check_pool_peaks_on_rank, pool_peaks_and_queries

import gdn_kcp
from gdn_kcp import OptionsKcp, build_kcp_context, gdn_workspace_layout_kcp
from gdn_kcp.workspace import Pools

CASES = [
    (dict(), torch.float32),
    (dict(boundary_mode="replay", save_for_backward=False, segments=2), torch.float32),
    (dict(save_mode="full", segments=2), torch.bfloat16),
    (dict(save_mode="inverse"), torch.bfloat16),
    (dict(graph="replay", deterministic=True), torch.float32),
]


@pytest.mark.parametrize("more, dtype", CASES)
def test_pools_peak_at_the_query(more, dtype):
    peaks, queries = pool_peaks_and_queries(OptionsKcp(use_qk_l2norm=True, **more), dtype)
    for call in ("fwd", "bwd"):
        tensor_bytes, arena_bytes = queries[call]
        assert peaks[call] == tensor_bytes <= arena_bytes, (call, peaks, queries)
    assert peaks["bwd"] > 0


def test_pools_peak_at_the_query_on_three_ranks():
    spawn_ranks(3, check_pool_peaks_on_rank)


@pytest.mark.parametrize("step", ["fla", "kcp", "layer"])
def test_fake_trace_of_the_traced_path_equals_the_real_run(step):
    with gdn_kcp.trace_host_path():
        real, fake = real_and_fake_peaks(step)
    assert fake == real
    assert real["Total"] > 0


def test_fake_trace_of_the_traced_path_on_two_ranks():
    spawn_ranks(2, traced_fake_peaks_on_rank)


def traced_fake_peaks_on_rank(rank: int, R: int) -> None:
    with gdn_kcp.trace_host_path():
        check_fake_peaks_on_rank(rank, R)


def test_memtracker_sees_the_backward_pools_at_the_query():
    """``gdn_kcp`` on a capped context under FakeTensorMode: from the
    backward's first pool to its widest phase only pools are allocated, so
    MemTracker's peak is what it held at that first bind plus the backward's
    ``tensor_bytes``."""
    bound = []
    bind = Pools.bind

    def noting_bind(self, name):
        if self.call == "bwd" and not bound:
            bound.append(tracker.get_tracker_snapshot("current")[torch.device("cpu")]["Total"])
        return bind(self, name)

    ctx = build_kcp_context(BOUNDS, max_docs=MAX_DOCS)  # the caps of STEPS["kcp"]
    layout = gdn_workspace_layout_kcp(ctx, 2, 4, 16, 16, dtype=torch.float32,
                                      options=OptionsKcp(use_qk_l2norm=True))
    Pools.bind = noting_bind
    try:
        with FakeTensorMode(), gdn_kcp.trace_host_path():
            tracker = MemTracker()
            with tracker:
                STEPS["kcp"]()
    finally:
        Pools.bind = bind
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    assert peak == bound[0] + layout.bwd.tensor_bytes < bound[0] + layout.bwd.bytes, (peak, bound, layout.bwd)

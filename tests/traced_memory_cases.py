"""The traced host path's memory, run eagerly inside ``trace_host_path()``:
each pool is its own tensor (``Pools``), freed with its last reference. The
bytes of pools alive at once, at every bind, against the layout query's
``tensor_bytes`` (the same phases, each pool at its tensor's bytes)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from gdn_inputs import make_inputs
from spawn import gloo_releases_tensors

import gdn_kcp
from gdn_kcp import OptionsKcp, build_kcp_context, gdn_kcp as run_gdn_kcp, gdn_workspace_layout_kcp
from gdn_kcp.workspace import Pools

H_QK, HV, K, V = 1, 2, 16, 16
T = 400  # the second document spans 6 chunks on one rank, so segments = 2 applies


@contextlib.contextmanager
def live_pool_peaks() -> Iterator[dict[str, int]]:
    """Within the block, ``peaks[call]`` is the most pool bytes a traced call
    held at once: at each bind, the bytes of the storages of that call's
    pools as they are then (weak references: a pool counts until Python
    frees it or its storage is resized to nothing)."""
    peaks: dict[str, int] = {}
    bind = Pools.bind

    def counted_bind(self, name):
        pool = bind(self, name)
        refs = self.__dict__.setdefault("_refs", [])
        refs.append(weakref.ref(pool))
        live = sum(pool.untyped_storage().nbytes() for pool in {id(r()): r() for r in refs if r() is not None}.values())
        peaks[self.call] = max(peaks.get(self.call, 0), live)
        return pool

    Pools.bind = counted_bind
    try:
        yield peaks
    finally:
        Pools.bind = bind


def leaves(T_rank: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    return [x.requires_grad_() for x in make_inputs(T_rank, H_QK, HV, K, V, dtype=dtype, seed=seed, l2=True)]


def step(ctx, options: OptionsKcp, dtype: torch.dtype) -> list[torch.Tensor]:
    """A forward + backward of this rank's tokens: o and every input's gradient."""
    lo, hi = ctx.rank_ranges[ctx.rank]
    inputs = leaves(hi - lo, dtype, seed=ctx.rank)
    o, _ = run_gdn_kcp(*inputs, ctx, options=options)
    o.float().square().sum().backward()
    return [o, *(x.grad for x in inputs)]


def pool_peaks_and_queries(options: OptionsKcp, dtype: torch.dtype = torch.float32, bounds=(0, 20, T)):
    """One traced (eager) forward + backward: the live pool peaks of both
    calls and the layout's ``(tensor_bytes, bytes)`` of each. Its outputs and
    gradients equal the opaque ops' bit for bit (the same programs in the
    same order on the same bytes)."""
    ctx = build_kcp_context(list(bounds))
    opaque = step(ctx, options, dtype)
    with live_pool_peaks() as peaks, gdn_kcp.trace_host_path(), gloo_releases_tensors():
        traced = step(ctx, options, dtype)
    for i, (a, b) in enumerate(zip(traced, opaque, strict=True)):
        assert torch.equal(a, b), (ctx.rank, options, i, float((a.double() - b.double()).abs().max()))
    layout = gdn_workspace_layout_kcp(ctx, H_QK, HV, K, V, dtype=dtype, options=options)
    queries = {call: (getattr(layout, call).tensor_bytes, getattr(layout, call).bytes) for call in ("fwd", "bwd")}
    return {call: peaks.get(call, 0) for call in ("fwd", "bwd")}, queries


RANK_OPTIONS = (
    dict(),
    dict(boundary_mode="replay"),
    dict(save_transfer=True, segments=2),
    dict(save_mode="full", segments=2),
    dict(save_mode="inverse", schedule="overlap"),
    dict(graph="replay", boundary_mode="replay"),
)


def check_pool_peaks_on_rank(rank: int, R: int) -> None:
    for more in RANK_OPTIONS:
        peaks, queries = pool_peaks_and_queries(OptionsKcp(use_qk_l2norm=True, **more))
        for call in ("fwd", "bwd"):
            assert peaks[call] == queries[call][0] <= queries[call][1], (rank, more, call, peaks, queries)

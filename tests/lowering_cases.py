"""Rank functions of tests/test_inductor_lowering.py (run by ``spawn.spawn_ranks``)."""

from __future__ import annotations

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from gdn_kcp import OptionsKcp, build_kcp_context, gdn_kcp, record_comm_bytes, trace_host_path


def randn(*shape, dtype=torch.float64, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def traced_equals_eager(fn, run, where) -> list:
    """``run(fn)`` eagerly and ``run`` of ``fn`` compiled in :func:`trace_host_path`
    (aot_eager): every result equal within 1e-12, and the bytes each exchange
    hands to torch.distributed (:func:`record_comm_bytes`, counted inside the
    traced exchanges' ops) the same; returns the forward and backward graphs."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    with record_comm_bytes() as eager_bytes:
        eager = run(fn)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    with trace_host_path(), record_comm_bytes() as traced_bytes:
        got = run(compiled)
    for i, (a, b) in enumerate(zip(got, eager, strict=True)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (where, i, float((a - b).abs().max()))
    assert traced_bytes == eager_bytes, (where, traced_bytes, eager_bytes)
    return graphs


def traced_ranks(rank: int, R: int, exchange: str, boundary_mode: str, more: dict) -> None:
    """One rank of :func:`test_ranks_trace_the_exchange`: its slice of a
    packing whose second document crosses every boundary (R = 3: rank 1 is a
    middle rank, M travels), eager and traced (aot_eager). A replayed
    boundary runs c1 / c2 again in the backward; ``more``: further options
    (save_transfer, segments; with segments the stream is 400 tokens, so
    that each rank's fragments span several chunks)."""
    T, H_qk, HV, K, V = 400 if more.get("segments", 1) > 1 else 150, 1, 2, 16, 16
    ctx = build_kcp_context([0, 20, T])
    lo, hi = ctx.rank_ranges[rank]
    local = [x[:, lo:hi] for x in (randn(1, T, H_qk, K, seed=3), randn(1, T, H_qk, K, seed=4),
                                    randn(1, T, HV, V, seed=5), -randn(1, T, HV, seed=6).abs(),
                                    randn(1, T, HV, seed=7).sigmoid())]
    options = OptionsKcp(exchange=exchange, boundary_mode=boundary_mode, use_qk_l2norm=True, **more)

    def fn(q, k, v, g, b):
        return gdn_kcp(q, k, v, g, b, ctx, options=options)[0]

    def run(f):
        leaves = [x.clone().requires_grad_() for x in local]
        o = f(*leaves)
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)
        return [o.detach(), *torch.autograd.grad((o * w).sum(), leaves)]

    graphs = traced_equals_eager(fn, run, (rank, exchange))
    assert len(graphs) == 2
    for gm, kind in zip(graphs, ("forward", "backward")):
        calls = [(str(n.target), [str(a) for a in n.args]) for n in gm.graph.nodes if n.op == "call_function"]
        effects = [args[1] for target, args in calls if target.endswith("with_effects")]
        started = [i for i, (target, args) in enumerate(calls) if "all_to_all_start" in "".join(args)]
        waited = [i for i, (target, args) in enumerate(calls) if "all_to_all_wait" in "".join(args)]
        exchanges = effects.count("gdn_kcp.all_to_all.default") + len(started)
        hops = effects.count("gdn_kcp.send_recv.default")
        opaque = [x for target, args in calls for x in (target, *args) if "gdn_kcp.fwd" in x or "gdn_kcp.bwd" in x]
        assert not opaque, (rank, opaque)
        replayed = 1 if kind == "forward" or boundary_mode == "saved" else 2
        if exchange == "a2a":  # forward c1 + c2; backward b1 + b2, after c1 + c2 again if replayed
            assert (exchanges, hops) == (2 * replayed, 0), (rank, kind, exchanges, hops)
        else:  # one hop (send or receive) at a chain's end, two (receive, then send) on a middle rank
            assert (exchanges, hops) == (0, (2 if ctx.rank_middle[rank] else 1) * replayed), (rank, kind, hops)
        overlapped = kind == "backward" and more.get("schedule") == "overlap"
        assert len(started) == len(waited) == int(overlapped), (rank, kind, started, waited)
        if overlapped:  # b2 is issued before the recomputed tape walk and waited for after it
            between = [target for target, _ in calls[started[0] + 1 : waited[0]] if target.startswith("aten.")]
            assert len(between) > 20 and any("bmm" in t or "mm" in t for t in between), (rank, between)


def traced_layer_ranks(rank: int, R: int) -> None:
    """One rank of :func:`test_layer_traces_over_ranks`: FLA's layer with a KCP
    context (3 ranks, one of a single token: the halo reaches two ranks back),
    eager and traced (aot_eager), outputs and every gradient."""
    from layer_kcp_cases import LAYER_CASES, make_layer

    bounds, ranges = LAYER_CASES[R][0]
    layer = make_layer()
    x = randn(1, bounds[-1], 32, seed=1)
    ctx = build_kcp_context(list(bounds), rank_ranges=list(ranges))
    start, end = ctx.rank_ranges[rank]

    def run(f):
        leaf = x[:, start:end].clone().requires_grad_()
        o = f(leaf)
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)
        return [o.detach(), *torch.autograd.grad((o * w).sum(), [leaf, *layer.parameters()])]

    def fn(x):
        return layer(x, kcp_context=ctx)[0]

    graphs = traced_equals_eager(fn, run, rank)
    names = {str(n.args[1]) if str(n.target).endswith("with_effects") else str(n.target)
             for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert "gdn_kcp.all_to_all.default" in names and "gdn_kcp.halo_shift.default" in names, (rank, names)
    assert not [n for n in names if "gdn_kcp.fwd" in n or "gdn_kcp.bwd" in n], rank


def overlap_in_output_code(rank: int, R: int) -> None:
    """One rank of ``test_inductor_overlaps_b2_with_the_walk``: gdn_kcp with
    ``schedule="overlap"`` compiled by Inductor in :func:`trace_host_path`.
    The backward's output code issues b2 (``all_to_all_start``), runs the
    recomputed tape walk's kernels, then waits (``all_to_all_wait``); outputs
    and gradients equal eager within 1e-12 (fp64), and the bytes counted by
    :func:`record_comm_bytes` too."""
    from torch._inductor.utils import run_and_get_code

    T, H_qk, HV, K, V = 200, 1, 2, 16, 16  # every rank walks a fragment of two chunks
    ctx = build_kcp_context([0, 20, T])
    lo, hi = ctx.rank_ranges[rank]
    local = [x[:, lo:hi] for x in (randn(1, T, H_qk, K, seed=3), randn(1, T, H_qk, K, seed=4),
                                    randn(1, T, HV, V, seed=5), -randn(1, T, HV, seed=6).abs(),
                                    randn(1, T, HV, seed=7).sigmoid())]
    # A replayed boundary: the recomputed walk depends on the replayed c2, so it stays in the backward
    # (with a saved one the CPU's recompute is the forward's, and AOT autograd merges the two).
    options = OptionsKcp(schedule="overlap", boundary_mode="replay", use_qk_l2norm=True)

    def run(f):
        leaves = [x.clone().requires_grad_() for x in local]
        o = f(*leaves, ctx, options=options)[0]
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)
        return [o.detach(), *torch.autograd.grad((o * w).sum(), leaves)]

    with record_comm_bytes() as eager_bytes:
        eager = run(gdn_kcp)
    torch._dynamo.reset()
    with trace_host_path(), record_comm_bytes() as compiled_bytes:
        got, codes = run_and_get_code(run, torch.compile(gdn_kcp, fullgraph=True))
    for i, (a, b) in enumerate(zip(got, eager, strict=True)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (rank, i, float((a - b).abs().max()))
    assert compiled_bytes == eager_bytes, (rank, compiled_bytes, eager_bytes)  # Inductor runs the ops' bodies
    backward = [code for code in codes if "all_to_all_start" in code]
    assert len(backward) == 1, (rank, len(codes))
    calls = [line.strip() for line in backward[0].splitlines() if "(" in line and "def " not in line]
    start = next(i for i, line in enumerate(calls) if "gdn_kcp.all_to_all_start" in line)
    wait = next(i for i, line in enumerate(calls) if "gdn_kcp.all_to_all_wait" in line)
    kernels = [line for line in calls[start + 1 : wait] if line.startswith(("cpp_fused", "extern_kernels.bmm"))]
    assert start < wait and len(kernels) >= 10, (rank, start, wait, kernels)

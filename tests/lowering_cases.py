"""Rank functions of tests/test_inductor_lowering.py (run by ``spawn.spawn_ranks``)."""

from __future__ import annotations

import re

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from gdn_kcp import OptionsKcp, build_kcp_context, gdn_kcp, record_comm_bytes, trace_host_path
from gdn_kcp.layers.halo import halo_rounds


def randn(*shape, dtype=torch.float64, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def traced_equals_eager(fn, run, where, atol: float = 1e-12) -> list:
    """``run(fn)`` eagerly and ``run`` of ``fn`` compiled in :func:`trace_host_path`
    (aot_eager): every result equal within ``atol`` (0: bit for bit), and the
    bytes each exchange hands to torch.distributed (:func:`record_comm_bytes`,
    counted inside the traced exchanges' ops) the same; returns the forward
    and backward graphs."""
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
        assert (torch.equal(a, b) if atol == 0 else torch.allclose(a, b, rtol=0, atol=atol)), \
            (where, i, float((a - b).abs().max()))
    assert traced_bytes == eager_bytes, (where, traced_bytes, eager_bytes)
    return graphs


def wait_follows_the_walk_by_data(gm, where) -> None:
    """What orders an overlapped b2 (``schedule="overlap"``) in the backward
    graph ``gm``: the host path's data, not a graph pass. The handle that
    ``all_to_all_start`` returns feeds every ``all_to_all_issued`` copy of the
    walk's index tables; the walk reads them and writes ``h`` (through the
    walk's state products, ``bmm``); ``all_to_all_wait`` takes that handle and
    ``h`` as ``after``. So no schedule of the graph can issue b2 after the
    walk or wait before it. Fails if any link is missing (the wait's
    ``after`` not the walk's output, the walk not reading the issued tables,
    no state product between them)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]

    def effect(node, name: str) -> bool:
        return str(node.target).endswith("with_effects") and str(node.args[1]) == f"gdn_kcp.{name}.default"

    (start,) = [n for n in nodes if effect(n, "all_to_all_start")]
    (wait,) = [n for n in nodes if effect(n, "all_to_all_wait")]
    (handle,) = [n for n in start.users if n.args[1] == 1]  # with_effects returns (token, handle)
    issued = [n for n in nodes if n.target is torch.ops.gdn_kcp.all_to_all_issued.default]
    assert issued and all(n.args[0] is handle for n in issued), (where, [n.args for n in issued])
    _, _, wait_handle, _send, _recvs, after = wait.args  # with_effects(token, op, handle, send, recvs, after)
    assert wait_handle is handle, where
    read_issued, todo = set(), list(issued)  # every node the issued tables reach
    while todo:
        node = todo.pop()
        if node not in read_issued:
            read_issued.add(node)
            todo.extend(node.users)
    after_reads, todo = set(), [after]  # every node the wait's after depends on
    while todo:
        node = todo.pop()
        if node not in after_reads:
            after_reads.add(node)
            todo.extend(node.all_input_nodes)
    walk = read_issued & after_reads  # the work data places between the issue and the wait
    assert after in walk, (where, "the wait's after does not depend on the issued tables", after.format_node())
    products = [n for n in walk if n.target is torch.ops.aten.bmm.default]
    assert products, (where, "no state product of the walk between the issue and the wait")


def traced_ranks(rank: int, R: int, exchange: str, boundary_mode: str, more: dict) -> None:
    """One rank of :func:`test_ranks_trace_the_exchange`: its slice of a
    packing whose second document crosses every boundary (R = 3: rank 1 is a
    middle rank, M travels), eager and traced (aot_eager). A replayed
    boundary runs c1 / c2 again in the backward; ``more``: further options
    (save_transfer, segments, schedule; the stream's length is set below).
    With ``schedule="overlap"`` the backward graph must order b2's wait after
    the recomputed walk by data (:func:`wait_follows_the_walk_by_data`)."""
    # segments: 400 tokens, so that each rank's fragments span several chunks; overlap: 100 a rank, so that
    # every rank's crossing fragment spans two (the overlapped walk's h then holds a state the walk computed)
    T = 400 if more.get("segments", 1) > 1 else 100 * R if more.get("schedule") == "overlap" else 150
    H_qk, HV, K, V = 1, 2, 16, 16
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
        if overlapped:
            wait_follows_the_walk_by_data(gm, (rank, kind))


EFFECTS = ("all_to_all", "all_to_all_start", "all_to_all_wait", "send_recv", "halo_shift", "halo_shift_back")
"""The exchanges registered as ordered effects (gdn_kcp.exchange.ordered, gdn_kcp.layers.halo)."""


def effect_label(op: str, args: list[str]) -> str:
    """An ordered exchange by what :func:`record_comm_bytes` calls it: the
    all-to-all's ``collective`` argument (c1, c2, b1, b2), ``halo`` and
    ``halo_grad`` for the layer's halo shifts, the op's name otherwise."""
    if op in ("all_to_all", "all_to_all_start"):
        return args[4]
    return {"halo_shift": "halo", "halo_shift_back": "halo_grad"}.get(op, op)


def effects_in_graph(gm) -> list[str]:
    """The ordered effects of an AOT graph, in graph order (which is their token
    order: each ``with_effects`` takes the previous one's token), by
    :func:`effect_label`. An exchange called without ``with_effects`` is an
    error: it would not be ordered."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if str(node.target).endswith("with_effects"):
            op = str(node.args[1])
            name = op.removeprefix("gdn_kcp.").removesuffix(".default")
            assert op.startswith("gdn_kcp.") and name in EFFECTS, op
            found.append(effect_label(name, [str(a) for a in node.args[2:]]))
        else:
            assert not any(f"gdn_kcp.{name}.default" == str(node.target) for name in EFFECTS), node.format_node()
    return found


_CODE_CALL = re.compile(r"torch\.ops\.gdn_kcp\.(\w+)\.default\((.*)\)\s*$")


def effects_in_code(code: str) -> list[str]:
    """The ordered effects Inductor's output code calls, in the order it calls
    them, by :func:`effect_label` (Inductor calls an effect's op by name and
    checks its result as ``torch.ops.with_effects``)."""
    found = []
    for line in code.splitlines():
        call = _CODE_CALL.search(line)
        if call and call.group(1) in EFFECTS:
            quoted = re.findall(r"'([^']*)'", call.group(2))  # all_to_all: group name, collective
            found.append(effect_label(call.group(1), ["", "", "", *quoted]))
    return found


def layer_effects(ctx, rank: int) -> tuple[list[str], list[str]]:
    """The exchanges the layer's forward and backward on ``rank`` run, in order:
    the halo rounds, then c1 and c2; b1 and b2, then the halo gradients' rounds
    (the convolution runs before GDN, its backward after GDN's)."""
    rounds = halo_rounds(ctx.rank_ranges, 3)  # make_layer's convolution: W = 4, a halo of 3 rows
    return ["halo"] * rounds + ["c1", "c2"], ["b1", "b2"] + ["halo_grad"] * rounds


def traced_layer_ranks(rank: int, R: int, backend: str) -> None:
    """One rank of ``test_layer_traces_over_ranks`` and
    ``test_inductor_traces_the_layer_over_ranks``: FLA's layer with a KCP
    context (the first case of ``LAYER_CASES[R]``: on 2 ranks a document
    crossing the boundary, on 3 a rank of a single token, so the halo reaches
    two ranks back), eager and compiled in :func:`trace_host_path` with
    ``backend``. ``"aot_eager"``: the outputs and every gradient equal
    eager bit for bit (the graph runs the same torch ops on the same
    operands, in the same order). ``"inductor"``: within 1e-12 (fp64;
    Inductor's fused C++ kernels sum in another order). Both: the bytes each
    exchange hands to torch.distributed equal eager's, no opaque
    gdn_kcp::fwd / bwd is called, and every exchange, the halo's included,
    is an ordered effect, in the order of :func:`layer_effects`."""
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

    if backend == "aot_eager":
        graphs = traced_equals_eager(fn, run, rank, atol=0.0)
        effects = [effects_in_graph(gm) for gm in graphs]
        called = {str(n.args[1]) if str(n.target).endswith("with_effects") else str(n.target)
                  for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    else:
        codes = inductor_equals_eager(fn, run, rank)
        effects = [effects_in_code(code) for code in codes]
        called = {call for code in codes for call in re.findall(r"torch\.ops\.gdn_kcp\.\w+", code)}
    assert effects == list(layer_effects(ctx, rank)), (rank, effects)
    assert not [n for n in called if "gdn_kcp.fwd" in n or "gdn_kcp.bwd" in n], (rank, called)


def inductor_equals_eager(fn, run, rank: int) -> list[str]:
    """``run(fn)`` eagerly and ``run`` of ``fn`` compiled by Inductor in
    :func:`trace_host_path`: equal within 1e-12 (fp64; Inductor's fused C++
    kernels sum in another order), the bytes :func:`record_comm_bytes` counts
    equal too (Inductor runs the ops' bodies). Returns the output code."""
    from torch._inductor.utils import run_and_get_code

    with record_comm_bytes() as eager_bytes:
        eager = run(fn)
    torch._dynamo.reset()
    with trace_host_path(), record_comm_bytes() as compiled_bytes:
        got, codes = run_and_get_code(run, torch.compile(fn, fullgraph=True))
    for i, (a, b) in enumerate(zip(got, eager, strict=True)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (rank, i, float((a - b).abs().max()))
    assert compiled_bytes == eager_bytes, (rank, compiled_bytes, eager_bytes)
    return codes


def overlap_in_output_code(rank: int, R: int) -> None:
    """One rank of ``test_inductor_overlaps_b2_with_the_walk``: gdn_kcp with
    ``schedule="overlap"`` compiled by Inductor in :func:`trace_host_path`.
    The backward's output code keeps the order the graph's data forces
    (:func:`wait_follows_the_walk_by_data`; no Inductor pass moves the wait):
    it issues b2 (``all_to_all_start``), copies the walk's index tables
    (``all_to_all_issued``), runs at least ten of the recomputed tape walk's
    kernels, one of which writes the buffer the wait takes as ``after``
    (made after the issue), then waits (``all_to_all_wait``). Outputs and
    gradients equal eager within 1e-12 (fp64), and the bytes counted by
    :func:`record_comm_bytes` too."""
    T, H_qk, HV, K, V = 200, 1, 2, 16, 16  # every rank walks a fragment of two chunks
    ctx = build_kcp_context([0, 20, T])
    lo, hi = ctx.rank_ranges[rank]
    local = [x[:, lo:hi] for x in (randn(1, T, H_qk, K, seed=3), randn(1, T, H_qk, K, seed=4),
                                    randn(1, T, HV, V, seed=5), -randn(1, T, HV, seed=6).abs(),
                                    randn(1, T, HV, seed=7).sigmoid())]
    # A replayed boundary: the backward also runs c1 and c2 again, so the overlapped b2 is ordered after
    # three exchanges of the same graph (the CI case of test_ranks_trace_the_exchange with the same options).
    options = OptionsKcp(schedule="overlap", boundary_mode="replay", use_qk_l2norm=True)

    def run(f):
        leaves = [x.clone().requires_grad_() for x in local]
        o = f(*leaves, ctx, options=options)[0]
        w = torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)
        return [o.detach(), *torch.autograd.grad((o * w).sum(), leaves)]

    codes = inductor_equals_eager(gdn_kcp, run, rank)
    backward = [code for code in codes if "all_to_all_start" in code]
    assert len(backward) == 1, (rank, len(codes))
    calls = [line.strip() for line in backward[0].splitlines() if "(" in line and "def " not in line]
    (start,) = [i for i, line in enumerate(calls) if "gdn_kcp.all_to_all_start" in line]
    (wait,) = [i for i, line in enumerate(calls) if "gdn_kcp.all_to_all_wait" in line]
    issued = [i for i, line in enumerate(calls) if "gdn_kcp.all_to_all_issued" in line]
    assert issued and start < min(issued) and max(issued) < wait, (rank, start, issued, wait)
    between = calls[start + 1 : wait]
    kernels = [line for line in between if line.startswith(("cpp_fused", "extern_kernels.bmm"))]
    assert len(kernels) >= 10, (rank, kernels)
    # the wait's after (the walk's h) is a buffer made and written by a kernel after the issue
    after = re.search(r"all_to_all_wait\.default\(.*, (\w+)\)$", calls[wait]).group(1)
    made = [line for line in between if line.startswith(f"{after} = ")]
    written = [line for line in kernels if re.search(rf"\b{after}\b", line)]
    assert made and written, (rank, after, made, written)

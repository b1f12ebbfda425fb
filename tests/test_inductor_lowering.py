"""docs/compile.md, "Lowering: the traced host path": inside
``gdn_kcp.trace_host_path()``, ``torch.compile`` traces the host path. The
page's block (fp64, two documents, initial states, the in-kernel norm) runs
here: its compiled outputs, final states and every gradient equal eager, the
output code runs every program and pool itself (no opaque ``gdn_kcp::fwd`` /
``bwd`` call) and Inductor reuses buffers. One compile of a forward and
backward (about 75 s on 2 cores, empty Inductor cache) serves the first two tests."""

from __future__ import annotations

import os

import pytest
import torch
from doc_blocks import run_block
from lowering_cases import overlap_in_output_code, randn, traced_layer_ranks, traced_ranks
from torch._inductor.utils import run_and_get_code

import gdn_kcp
from gdn_kcp import chunk_gated_delta_rule
from gdn_kcp.ops.boundary import BOUNDARY_OPS

HEADING = "Lowering: the traced host path"
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


@pytest.fixture(scope="module")
def block():
    torch._dynamo.reset()
    return run_and_get_code(run_block, "docs/compile.md", HEADING)


def eager_step(ns):
    """The block's step run eagerly on copies of its leaves: outputs and gradients."""
    leaves = [ns[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "b", "h0")]
    o, final_state = ns["step"](*leaves)
    grads = torch.autograd.grad(o.square().sum() + final_state.square().sum(), leaves)
    return (o, final_state, *grads)


def test_compiled_host_path_equals_eager(block):
    ns, _ = block
    got = (ns["o"], ns["final_state"], *(ns[n].grad for n in ("q", "k", "v", "g", "b", "h0")))
    for name, a, b in zip(NAMES, got, eager_step(ns), strict=True):
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=0, atol=1e-10), (name, float((a - b).abs().max()))


def test_output_code_runs_the_programs_and_reuses_pools(block):
    _, codes = block
    assert len(codes) == 2, "a forward and a backward graph"
    for code in codes:
        assert "gdn_kcp" not in code, "an opaque gdn_kcp op is still called"
        assert "# reuse" in code, "Inductor reused no buffer"


def test_without_the_block_compile_keeps_the_opaque_ops(block):
    ns, _ = block
    torch._dynamo.reset()
    leaves = [ns[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "b", "h0")]

    def run():
        o, final_state = torch.compile(ns["step"], fullgraph=True)(*leaves)
        return (o, final_state, *torch.autograd.grad(o.square().sum() + final_state.square().sum(), leaves))

    got, codes = run_and_get_code(run)
    assert any("torch.ops.gdn_kcp.fwd" in code for code in codes)
    assert any("torch.ops.gdn_kcp.bwd" in code for code in codes)
    for name, a, b in zip(NAMES, got, eager_step(ns), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), name


def traced_aot_eager(fn, inputs, parameters=()):
    """``fn``'s outputs and gradients (of its inputs and ``parameters``): eager,
    and compiled with ``aot_eager`` (Dynamo and AOT autograd, no Inductor) in
    ``trace_host_path``; also the gdn_kcp ops the traced graphs still call."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    def run(f):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = f(*leaves)
        loss = (out.double() * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)).sum()
        return [out, *torch.autograd.grad(loss, [*leaves, *parameters])]

    eager = run(fn)
    torch._dynamo.reset()
    with gdn_kcp.trace_host_path():
        compiled = run(torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)))
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes if "gdn_kcp" in str(node.target)}
    return eager, compiled, ops


CU_CAPPED = torch.tensor([0, 30, 70, 70, 70])  # padded with zero-length documents: a capped context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # fp64: the tests above
def test_gate_keywords_trace_at_every_dtype(dtype):
    """FLA's gate and beta keywords (computed in the programs), negative
    eigenvalues, a capped cu_seqlens: the traced path computes exactly what
    eager does (aot_eager runs the same torch ops), and calls no gdn_kcp op."""
    T, H_qk, HV, K, V = 70, 1, 2, 16, 16
    A_log, dt_bias = randn(HV, seed=1), randn(HV, seed=2)

    def fn(q, k, v, a, b):
        return chunk_gated_delta_rule(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                                      use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=CU_CAPPED)[0]

    inputs = [randn(1, T, H_qk, K, dtype=dtype, seed=3), randn(1, T, H_qk, K, dtype=dtype, seed=4),
              randn(1, T, HV, V, dtype=dtype, seed=5), randn(1, T, HV, dtype=dtype, seed=6),
              randn(1, T, HV, dtype=dtype, seed=7)]
    eager, compiled, ops = traced_aot_eager(fn, inputs)
    assert {op.split(".")[1] for op in ops} <= BOUNDARY_OPS, ops  # identities that run no program
    for i, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert torch.equal(a, b), (dtype, i, float((a.double() - b.double()).abs().max()))


def test_layer_traces():
    """FLA's layer (projections, short convolution, gates, norm) on packed rows:
    outputs and every parameter's gradient equal eager; the graphs call the
    short convolution's op and no gdn_kcp::fwd / bwd."""
    from gdn_kcp.layers import GatedDeltaNet

    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=32, head_dim=16, num_heads=1, num_v_heads=2, expand_v=1,
                          conv_bias=True).double()
    eager, compiled, ops = traced_aot_eager(lambda x: layer(x, cu_seqlens=CU_CAPPED)[0],
                                            [randn(1, 70, 32, seed=8)], list(layer.parameters()))
    programs = [op for op in ops if op.split(".")[1] not in BOUNDARY_OPS]
    assert programs and all("short_conv" in op for op in programs), ops  # the convolution stays its own op
    for i, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (i, float((a - b).abs().max()))


def test_one_traced_graph_serves_every_packing():
    """Capture once under the traced path: a capped ``cu_seqlens`` passed as an
    input, two packings of the same cap, one forward and one backward graph
    for both (aot_eager), each packing's outputs and gradients equal eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    T, H_qk, HV, K, V = 70, 1, 2, 16, 16
    graphs = {"fw": 0, "bw": 0}

    def counted(kind):
        def compiler(gm, example_inputs):
            graphs[kind] += 1
            return make_boxed_func(gm)
        return compiler

    def fn(q, k, v, g, b, cu):
        return chunk_gated_delta_rule(q, k, v, g, b, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0]

    inputs = [randn(1, T, H_qk, K, seed=3), randn(1, T, H_qk, K, seed=4), randn(1, T, HV, V, seed=5),
              -randn(1, T, HV, seed=6).abs(), randn(1, T, HV, seed=7).sigmoid()]

    def run(f, cu):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out = f(*leaves, cu)
        return [out, *torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum(), leaves)]

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True,
                             backend=aot_autograd(fw_compiler=counted("fw"), bw_compiler=counted("bw")))
    for cu in (CU_CAPPED, torch.tensor([0, 10, 25, 50, T])):
        eager = run(fn, cu)
        with gdn_kcp.trace_host_path():
            got = run(compiled, cu)
        for i, (a, b) in enumerate(zip(got, eager, strict=True)):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), (cu.tolist(), i, float((a - b).abs().max()))
    assert graphs == {"fw": 1, "bw": 1}, graphs


@pytest.mark.parametrize("exchange, R, boundary_mode, more", [
    # CI: the richest case of each exchange and schedule; the plainer ones in make test-extended
    ("a2a", 3, "saved", {"save_transfer": True, "segments": 2}), ("ring", 2, "replay", {}),
    ("a2a", 3, "saved", {"schedule": "overlap"}),
    *(pytest.param(*case, marks=pytest.mark.extended) for case in (
        ("a2a", 3, "saved", {}), ("a2a", 2, "replay", {}), ("ring", 3, "saved", {}),
        ("a2a", 2, "replay", {"schedule": "overlap"}))),
])
def test_ranks_trace_the_exchange(exchange, R, boundary_mode, more):
    """KCP under the traced host path, on gloo ranks: with the all-to-all
    exchange each rank's graphs hold its exchanges as ordered effects
    (``gdn_kcp::all_to_all``: two in the forward, two in the backward and
    two more with a replayed boundary, on every rank; also with the owners'
    M kept, save_transfer, and two segments per fragment) and no opaque
    gdn_kcp::fwd / bwd; with the ring each hop is an ordered
    ``gdn_kcp::send_recv`` (one at a chain's end, two on a middle rank,
    again in a replayed backward). With
    ``schedule="overlap"`` (3 ranks with a saved boundary, 2 with a replayed
    one) the backward's b2 is an ordered start and wait, and the graph's
    data orders them around the recomputed tape walk: the walk reads tables
    copied after the start, the wait takes the walk's h
    (``lowering_cases.wait_follows_the_walk_by_data``). Outputs and gradients
    equal eager on every rank."""
    from spawn import spawn_ranks

    spawn_ranks(R, traced_ranks, exchange, boundary_mode, more)


@pytest.mark.parametrize("R", [pytest.param(2, marks=pytest.mark.extended), 3])
def test_layer_traces_over_ranks(R):
    """FLA's layer under KCP inside ``trace_host_path``, compiled with aot_eager
    on 2 gloo ranks (a document across the boundary) and 3 (one rank holding
    a single token): every rank's outputs and gradients equal eager bit for
    bit; the graphs hold every exchange as an ordered effect, the halo's
    included, in order (the halo rounds, c1, c2; b1, b2, the halo
    gradients' rounds), and no gdn_kcp::fwd / bwd."""
    from spawn import spawn_ranks

    spawn_ranks(R, traced_layer_ranks, "aot_eager")


@pytest.mark.skipif(os.environ.get("GDN_KCP_LOWERING_INDUCTOR") != "1",
                    reason="set GDN_KCP_LOWERING_INDUCTOR=1 (make lowering-check): minutes of Inductor C++")
def test_inductor_overlaps_b2_with_the_walk():
    """``schedule="overlap"`` compiled by Inductor on 2 gloo ranks (replayed
    boundary): each rank's backward output code keeps the order the graph's
    data forces (b2 issued, the walk's tables copied, the recomputed tape
    walk's kernels, one writing the wait's ``after``, then the wait; no
    Inductor pass moves it); outputs and gradients equal eager within 1e-12.
    About 2.5 minutes on 2 cores with an empty Inductor cache (C++ for both
    graphs on both ranks): not CI, ``make lowering-check`` (in CI the same
    case under aot autograd, ``test_ranks_trace_the_exchange``, checks that
    data order in the graph)."""
    from spawn import spawn_ranks

    spawn_ranks(2, overlap_in_output_code)


@pytest.mark.skipif(os.environ.get("GDN_KCP_LOWERING_INDUCTOR") != "1",
                    reason="set GDN_KCP_LOWERING_INDUCTOR=1 (make lowering-check): minutes of Inductor C++")
def test_inductor_traces_the_layer_over_ranks():
    """The 2-rank case of ``test_layer_traces_over_ranks`` compiled by Inductor:
    outputs and gradients equal eager within 1e-12 (fp64), the output code
    calls every exchange, the halo's included, in the same order, and no
    gdn_kcp::fwd / bwd. About 4 minutes on 2 cores with an empty Inductor
    cache: not CI (``make lowering-check``)."""
    from spawn import spawn_ranks

    spawn_ranks(2, traced_layer_ranks, "inductor")

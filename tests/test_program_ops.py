"""Every program of the host path is its own op, ``gdn_kcp::<program>``
(``gdn_kcp/ops/programs.py``; docs/compile.md, "Lowering"): its schema is the
program's signature, it mutates exactly its ``*_out`` / ``*_acc`` buffers, and
``torch.library.opcheck`` passes on the arguments a traced forward + backward
really gave it (schema and mutations, the fake kernel, AOT dispatch with
static and dynamic shapes). Dynamo's graph of the FLA-style entry holds the
programs as named ops, and so does ``torch.export``'s, which saves, loads
and runs."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch
from gdn_inputs import make_inputs
from spawn import spawn_ranks
from torch.utils._python_dispatch import TorchDispatchMode

import gdn_kcp
from gdn_kcp import OptionsKcp, build_kcp_context, chunk_gated_delta_rule, gdn_kcp as run_gdn_kcp
from gdn_kcp.kernels import torch as torch_programs
from gdn_kcp.ops.programs import HOST_PROGRAMS, INDEX_FIELDS

EXCHANGE_PROGRAMS = ("summary_walk", "adjoint_summary")  # a fragment crosses a rank boundary: R > 1


class FirstCalls(TorchDispatchMode):
    """Keeps a copy of the arguments of each gdn_kcp op's first call."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, tuple] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "gdn_kcp" and func._opname not in self.calls:
            self.calls[func._opname] = (func, [x.clone() if isinstance(x, torch.Tensor) else x for x in args])
        return func(*args, **(kwargs or {}))


def record_traced_step(segments: int, T: int = 130, save_mode: str = "light", channel: bool = False
                       ) -> dict[str, tuple]:
    """One eager traced forward + backward (fp64, initial and final states,
    ``segments`` per long fragment, the in-kernel norm, ``save_mode``; KDA's,
    a gate per key channel, with ``channel``) of this rank's tokens,
    recording each program op's first arguments."""
    H_qk, HV, K, V = 1, 2, 16, 16
    ctx = build_kcp_context([0, 20, T])
    lo, hi = ctx.rank_ranges[ctx.rank]
    q, k, v, g, beta = make_inputs(hi - lo, H_qk, HV, K, V, seed=ctx.rank, l2=True)
    if channel:
        g = g[..., None] * torch.linspace(0.5, 1.5, K, dtype=g.dtype)
    h0 = torch.randn(len(ctx.start_docs), HV, K, V, dtype=torch.float64) if ctx.start_docs else None
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta, *([h0] if h0 is not None else []))]
    recorder = FirstCalls()
    with gdn_kcp.trace_host_path(), recorder:
        options = OptionsKcp(segments=segments, use_qk_l2norm=True, save_mode=save_mode)
        o, final_state = (gdn_kcp.kda_kcp if channel else run_gdn_kcp)(*leaves[:5], ctx, options=options,
                                                                       initial_state=h0, output_final_state=True)
        (o.square().sum() + final_state.square().sum()).backward()
    return recorder.calls


def check_opcheck(calls: dict[str, tuple], names) -> None:
    for name in names:
        op, args = calls[name]
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, (name, results)


@pytest.fixture(scope="module")
def one_rank_calls():
    inverse = record_traced_step(segments=2, save_mode="inverse")  # its backward runs w_u where light reruns prep
    full = record_traced_step(segments=2, save_mode="full")  # a forward that keeps its tapes: the output program
    kda = record_traced_step(segments=2, channel=True)  # a gate per key channel: the walks' decays
    return {**kda, **full, **inverse}


def test_every_program_is_an_op_with_its_signature():
    for name in HOST_PROGRAMS:
        schema = getattr(torch.ops.gdn_kcp, name).default._schema
        program = inspect.signature(getattr(torch_programs, name)).parameters
        expected = []
        for p in program.values():
            expected += [f"index_{field}" for field, _ in INDEX_FIELDS] if p.annotation == "ChunkIndex" else [p.name]
        assert [a.name for a in schema.arguments] == expected, name
        mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert mutated == {n for n in program if n.endswith(("_out", "_acc"))}, (name, mutated)
        assert not schema.returns, name


@pytest.mark.parametrize("name", sorted(set(HOST_PROGRAMS) - set(EXCHANGE_PROGRAMS)))
def test_opcheck_on_the_arguments_of_a_traced_step(one_rank_calls, name):
    check_opcheck(one_rank_calls, [name])


def opcheck_exchange_programs_on_rank(rank: int, R: int) -> None:
    calls = record_traced_step(segments=1)  # with segments the crossing fragments' summaries are folded
    sender = EXCHANGE_PROGRAMS[0] if rank == 0 else EXCHANGE_PROGRAMS[1]  # rank 0 sends a summary, rank 1 nu
    check_opcheck(calls, [sender])


def test_opcheck_the_exchange_programs_on_two_ranks():
    spawn_ranks(2, opcheck_exchange_programs_on_rank)


def test_dynamo_graph_holds_the_programs_as_ops():
    """The FLA-style entry compiled in the block (light save mode: the
    forward walks with the output, the backward runs prep and the tape walk again): Dynamo's graphs call the
    named program ops, and no opaque fwd / bwd."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    T = 70
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, 1, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, 2, 16, generator=gen, dtype=torch.float64)
    g, beta = -torch.rand(1, T, 2, dtype=torch.float64), torch.rand(1, T, 2, dtype=torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]

    def fn(*xs):
        return chunk_gated_delta_rule(*xs, cu_seqlens=torch.tensor([0, 30, T]), use_qk_l2norm_in_kernel=True)[0]

    torch._dynamo.reset()
    with gdn_kcp.trace_host_path():
        torch.compile(fn, backend=backend, fullgraph=True)(*leaves).sum().backward()
    called = Counter(str(node.target).removeprefix("gdn_kcp.").removesuffix(".default")
                     for gm in graphs for module in gm.modules() if isinstance(module, torch.fx.GraphModule)
                     for node in module.graph.nodes if str(node.target).startswith("gdn_kcp."))
    assert called == Counter({"prep": 2, "scores": 1, "walk_output": 1, "tape_walk": 1, "bwd_local_dv": 1,
                              "adjoint_walk": 1, "bwd_dqkwg": 1, "bwd_wy": 1, "bwd_gate_cumsum": 1, "bwd_qk_norm": 1,
                              "forward_boundary": 1, "replay_boundary": 1}), called  # ops.boundary


def test_export_keeps_the_program_ops_and_round_trips():
    """``torch.export`` in the block: the exported graph holds the forward's
    program ops by name (not the opaque fwd), survives save / load, and runs
    equal to eager."""
    import io

    class Entry(torch.nn.Module):
        def forward(self, q, k, v, g, beta):
            return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 30, 70]),
                                          use_qk_l2norm_in_kernel=True)[0]

    gen = torch.Generator().manual_seed(1)
    args = (torch.randn(1, 70, 1, 16, generator=gen), torch.randn(1, 70, 1, 16, generator=gen),
            torch.randn(1, 70, 2, 16, generator=gen), -torch.rand(1, 70, 2, generator=gen),
            torch.rand(1, 70, 2, generator=gen))
    with gdn_kcp.trace_host_path():
        exported = torch.export.export(Entry(), args)
    ops = [str(node.target) for node in exported.graph.nodes if str(node.target).startswith("gdn_kcp.")]
    assert ops == ["gdn_kcp.prep.default", "gdn_kcp.scores.default", "gdn_kcp.walk_output.default"], ops
    saved = io.BytesIO()
    torch.export.save(exported, saved)
    saved.seek(0)
    assert torch.equal(torch.export.load(saved).module()(*args), Entry()(*args))

"""Op-level checks shared by the single-rank tests and the 2-rank gloo workers:
opcheck of both ops, torch.compile(fullgraph=True) against eager, and
torch.utils.checkpoint."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from gdn_inputs import make_inputs, rel_rms
from gdn_layer import layer_and_input, loss_and_grads

import gdn_kcp.ops  # noqa: F401  (registers the ops)
from gdn_kcp import OptionsKcp, build_kcp_context
from gdn_kcp.ops.autograd import workspace_nbytes

BOUNDS = [0, 40, 40, 170, 200]  # on 2 ranks the 130-token document crosses the boundary
OPTION_SETS = [
    OptionsKcp(use_qk_l2norm=True),
    OptionsKcp(save_mode="inverse", use_qk_l2norm=True),  # the saved A and norms: fake outputs from the query
    OptionsKcp(save_mode="full", save_transfer=True),
    OptionsKcp(boundary_mode="replay", exchange="ring", graph="replay"),
]


def opcheck_both_ops(rank: int = 0, R: int = 1) -> None:
    ctx = build_kcp_context(BOUNDS)
    start, end = ctx.rank_ranges[ctx.rank]
    q, k, v, g, beta = [x[0, start:end].float() for x in make_inputs(BOUNDS[-1], 1, 2, 16, 8, l2=True)]
    T = end - start
    shapes = (1, 2, 16, 8)
    # the in-kernel gate and beta (g, beta raw; [2, HV] gate parameters) on the first option set
    gates = [(torch.tensor([[-0.5, -2.0], [0.3, -1.0]]), True, 2.0)] + [(None, False, 1.0)] * len(OPTION_SETS)
    for options, gate in zip([OPTION_SETS[0], *OPTION_SETS], gates):
        meta = ctx.meta
        with_states = R == 1  # initial and final states: one rank holds every document
        state0 = torch.randn(ctx.n_docs, 2, 16, 8) if with_states else None
        ws = torch.empty(workspace_nbytes(tuple(meta), *shapes, torch.float32, options.op_arg, "fwd"),
                         dtype=torch.uint8)
        args = (q, k, v, g, beta, state0, ws, ctx.index.chunk_table, ctx.index.frag_table, meta, ctx.group_name,
                options.op_arg, 0.25, ctx.n_docs if with_states else 0, *gate)
        out = torch.ops.gdn_kcp.fwd(*args)
        torch.library.opcheck(torch.ops.gdn_kcp.fwd.default, args)
        ws = torch.empty(workspace_nbytes(tuple(meta), *shapes, torch.float32, options.op_arg, "bwd"),
                         dtype=torch.uint8)
        d_final = torch.randn_like(out[1]) if with_states else None
        bargs = (torch.randn(T, 2, 8), d_final, q, k, v, g, beta, state0, list(out[2:]), ws,
                 ctx.index.chunk_table, ctx.index.frag_table, meta, ctx.group_name, options.op_arg, 0.25,
                 with_states, *gate)
        torch.library.opcheck(torch.ops.gdn_kcp.bwd.default, bargs)


def compiled_equals_eager(rank: int = 0, R: int = 1) -> None:
    ctx = build_kcp_context(BOUNDS)
    layer, x = layer_and_input(ctx)
    y_eager, g_eager = loss_and_grads(layer, layer, x)
    for dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
        y, grads = loss_and_grads(compiled, layer, x)
        # Inductor fuses and reorders the projections' reductions: fp32 rounding only.
        assert rel_rms(y, y_eager) < 1e-5, (rank, dynamic)
        for a, b in zip(grads, g_eager):
            assert rel_rms(a, b) < 1e-5, (rank, dynamic, rel_rms(a, b))


def checkpoint_equals_plain(rank: int = 0, R: int = 1) -> None:
    ctx = build_kcp_context(BOUNDS)
    layer, x = layer_and_input(ctx)
    y_plain, g_plain = loss_and_grads(layer, layer, x)
    y, grads = loss_and_grads(
        lambda inp: torch.utils.checkpoint.checkpoint(layer, inp, use_reentrant=False), layer, x
    )
    assert torch.equal(y, y_plain)
    for a, b in zip(grads, g_plain):
        assert torch.equal(a, b), rank


def all_op_checks(rank: int, R: int) -> None:
    opcheck_both_ops(rank, R)
    compiled_equals_eager(rank, R)
    checkpoint_equals_plain(rank, R)

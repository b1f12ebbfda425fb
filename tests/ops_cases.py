"""Op-level checks shared by the single-rank tests and the 2-rank gloo workers:
opcheck of both ops, torch.compile(fullgraph=True) against eager, and
torch.utils.checkpoint."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from dataclasses import replace

from gdn_inputs import channel_gates, make_inputs, rel_rms
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


def opcheck_both_ops(rank: int = 0, R: int = 1, kda: bool = False) -> None:
    """``kda``: a gate per key channel (g ``[T, HV, K]``, options with ``gate="channel"``)."""
    ctx = build_kcp_context(BOUNDS)
    start, end = ctx.rank_ranges[ctx.rank]
    inputs = make_inputs(BOUNDS[-1], 1, 2, 16, 8, l2=True)
    if kda:
        inputs[3] = channel_gates(inputs[3], 16, 0)
    q, k, v, g, beta = [x[0, start:end].float() for x in inputs]
    T = end - start
    shapes = (1, 2, 16, 8)
    # the in-kernel gate and beta (g, beta raw; [2, HV] gate parameters) on the first option set; KDA's gate is
    # computed ahead of the ops, its beta in them
    first = (None, True, 2.0) if kda else (torch.tensor([[-0.5, -2.0], [0.3, -1.0]]), True, 2.0)
    gates = [first] + [(None, False, 1.0)] * len(OPTION_SETS)
    for options, gate in zip([OPTION_SETS[0], *OPTION_SETS], gates):
        options = replace(options, gate="channel") if kda else options
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


def compiled_equals_eager(rank: int = 0, R: int = 1, kda: bool = False) -> None:
    ctx = build_kcp_context(BOUNDS)
    layer, x = layer_and_input(ctx, kda=kda)
    y_eager, g_eager = loss_and_grads(layer, layer, x)
    for dynamic in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
        y, grads = loss_and_grads(compiled, layer, x)
        # Inductor fuses and reorders the projections' reductions: fp32 rounding only.
        assert rel_rms(y, y_eager) < 1e-5, (rank, dynamic)
        for a, b in zip(grads, g_eager):
            assert rel_rms(a, b) < 1e-5, (rank, dynamic, rel_rms(a, b))


def checkpoint_equals_plain(rank: int = 0, R: int = 1, kda: bool = False) -> None:
    ctx = build_kcp_context(BOUNDS)
    layer, x = layer_and_input(ctx, kda=kda)
    y_plain, g_plain = loss_and_grads(layer, layer, x)
    y, grads = loss_and_grads(
        lambda inp: torch.utils.checkpoint.checkpoint(layer, inp, use_reentrant=False), layer, x
    )
    assert torch.equal(y, y_plain)
    for a, b in zip(grads, g_plain):
        assert torch.equal(a, b), rank


def all_op_checks(rank: int, R: int, kda: bool = False) -> None:
    opcheck_both_ops(rank, R, kda)
    compiled_equals_eager(rank, R, kda)
    checkpoint_equals_plain(rank, R, kda)

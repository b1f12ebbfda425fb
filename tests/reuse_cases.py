"""Three training steps on one reused WorkspaceKcp (2 gloo ranks, a document
crossing the boundary): what docs/bytes.md says about later steps."""

from __future__ import annotations

import torch
from gdn_inputs import make_inputs

from gdn_kcp import OptionsKcp, WorkspaceKcp, build_kcp_context, gdn_kcp, record_workspace

H_QK, HV, K, V = 1, 2, 16, 16


def three_steps(rank: int, R: int, graph: str) -> None:
    bounds = torch.tensor([0, 30, 170, 200])
    ctx = build_kcp_context(bounds)
    start, end = ctx.rank_ranges[rank]
    options = OptionsKcp(graph=graph, use_qk_l2norm=True)
    workspace = WorkspaceKcp(ctx, H_QK, HV, K, V, dtype=torch.float32, options=options)
    storage = workspace.storage.data_ptr()
    inputs = [x[:, start:end] for x in make_inputs(200, H_QK, HV, K, V, dtype=torch.float32, l2=True)]
    results = []
    with record_workspace() as record:
        for _ in range(3):
            leaves = [x.clone().requires_grad_() for x in inputs]
            o, _ = gdn_kcp(*leaves, ctx, options=options, workspace=workspace)
            grads = torch.autograd.grad(o.square().sum(), leaves)
            results.append([o.detach(), *grads])
    layout = workspace.layout
    assert workspace.storage.data_ptr() == storage
    assert workspace.nbytes == layout.bytes == max(layout.fwd.bytes, layout.bwd.bytes)
    for call in ("fwd", "bwd"):
        expected = getattr(layout, call)
        assert len(record.runs(call)) == 3
        for step in range(3):
            # Every step binds what the first did: nothing stays bound between calls.
            assert record.phases(call, step) == dict(expected.phases), (rank, call, step)
            assert record.pools(call, step) == {n: s.nbytes for n, s in expected.pools.items()}
            # Every pool sits at its layout offset in the one arena, every step.
            assert record.addresses(call, step) == {n: storage + s.offset for n, s in expected.pools.items()}
        if graph == "replay":
            assert record.peak(call) == sum(s.nbytes for s in expected.pools.values())
    for later in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(later, results[0]))
    fresh = [x.clone().requires_grad_() for x in inputs]
    o, _ = gdn_kcp(*fresh, ctx, options=options)
    grads = torch.autograd.grad(o.square().sum(), fresh)
    assert all(torch.equal(a, b) for a, b in zip([o.detach(), *grads], results[0]))

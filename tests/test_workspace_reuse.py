"""A reused workspace over three steps, eager and graph="replay"; a workspace
made for another call is refused."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs
from reuse_cases import three_steps
from spawn import spawn_ranks

from gdn_kcp import OptionsKcp, WorkspaceKcp, build_kcp_context, gdn_kcp


@pytest.mark.parametrize("graph", ["off", "replay"])
def test_three_steps_on_one_workspace(graph):
    spawn_ranks(2, three_steps, graph)


def test_workspace_for_another_call_is_refused():
    ctx = build_kcp_context(torch.tensor([0, 100]))
    q, k, v, g, beta = make_inputs(100, 1, 2, 16, 16, dtype=torch.float32)
    other = WorkspaceKcp(ctx, 1, 2, 16, 16, options=OptionsKcp(save_mode="full"))
    with pytest.raises(ValueError, match=r"workspace was made for another call \(options: "):
        gdn_kcp(q, k, v, g, beta, ctx, workspace=other)
    wide = WorkspaceKcp(ctx, 1, 2, 32, 16)
    with pytest.raises(ValueError, match=r"K: 32 vs 16"):
        gdn_kcp(q, k, v, g, beta, ctx, workspace=wide)
    with pytest.raises(TypeError, match=r"workspace must be a WorkspaceKcp or None, got Tensor"):
        gdn_kcp(q, k, v, g, beta, ctx, workspace=torch.empty(10))
    other_packing = build_kcp_context(torch.tensor([0, 30, 100]))
    with pytest.raises(ValueError, match=r"workspace was made for another call \(ctx.layout_key: "):
        gdn_kcp(q, k, v, g, beta, other_packing, workspace=WorkspaceKcp(ctx, 1, 2, 16, 16))


def test_a_workspace_serves_every_context_with_its_layout():
    """The workspace is keyed by the context's layout facts, not the object: a
    context rebuilt for the same packing (a new object each step) reuses it."""
    q, k, v, g, beta = make_inputs(100, 1, 2, 16, 16, dtype=torch.float32)
    ws = WorkspaceKcp(build_kcp_context(torch.tensor([0, 40, 100])), 1, 2, 16, 16)
    rebuilt = build_kcp_context([0, 40, 100])
    assert torch.equal(gdn_kcp(q, k, v, g, beta, rebuilt, workspace=ws)[0], gdn_kcp(q, k, v, g, beta, rebuilt)[0])

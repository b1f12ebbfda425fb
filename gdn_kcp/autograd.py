"""The autograd layer shared by :func:`chunk_gated_delta_rule` and :func:`gdn_kcp`:
binds the call's arena (the caller's workspace or one made for the call) and
keeps exactly the saved set that ``gdn_saved_layout_kcp`` names."""

from __future__ import annotations

import torch

from gdn_kcp.host import Buffers, Call, host_backward, host_forward
from gdn_kcp.queries.layout import gdn_saved_layout_kcp, gdn_workspace_layout_kcp
from gdn_kcp.workspace import Arena, WorkspaceKcp


def call_arena(call: Call, H_qk: int, dtype: torch.dtype, workspace: WorkspaceKcp | None, which: str,
               device: torch.device) -> Arena:
    """The arena of one call: the caller's workspace, or a fresh one of the
    call's own figure (``gdn_workspace_bytes_kcp(..., call=which)``)."""
    if workspace is not None:
        return workspace.arena(which)
    layout = gdn_workspace_layout_kcp(call.ctx, H_qk, call.HV, call.K, call.V, dtype=dtype, options=call.options)
    storage = torch.empty(getattr(layout, which).bytes, dtype=torch.uint8, device=device)
    return Arena(storage, getattr(layout, which), graph=call.options.graph == "replay")


def check_workspace(workspace: object, call: Call, H_qk: int, dtype: torch.dtype) -> None:
    if workspace is None:
        return
    if not isinstance(workspace, WorkspaceKcp):
        raise TypeError(f"workspace must be a WorkspaceKcp or None, got {type(workspace).__name__}")
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    wanted = (id(call.ctx), H_qk, call.HV, call.K, call.V, cdt, call.options)
    if workspace.key != wanted:
        names = ("ctx", "H_qk", "HV", "K", "V", "compute dtype", "options")
        diffs = [f"{n}: {a!r} vs {b!r}" for n, a, b in zip(names, workspace.key, wanted) if a != b]
        raise ValueError(f"workspace was made for another call ({'; '.join(diffs)})")


class GdnFunction(torch.autograd.Function):
    """Forward and explicit backward over the host path (no autograd through
    the forward). Saved: the inputs and the saved set of the options."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, call: Call, workspace, n_final_states):
        H_qk = q.shape[1]
        saved_layout = gdn_saved_layout_kcp(
            call.ctx, H_qk, call.HV, call.K, call.V, dtype=q.dtype, options=call.options
        )
        buffers = Buffers(call_arena(call, H_qk, q.dtype, workspace, "fwd", q.device), saved_layout, q.device,
                          saving=True)
        o, final_state = host_forward(
            q, k, v, g, beta, call, buffers, initial_state=initial_state, n_final_states=n_final_states
        )
        if set(buffers.saved) != set(saved_layout):
            raise RuntimeError(f"the forward saved {sorted(buffers.saved)}, its layout names {sorted(saved_layout)}")
        names = sorted(saved_layout)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, *(buffers.saved[n] for n in names))
        ctx.saved_names, ctx.saved_layout = names, saved_layout
        ctx.call, ctx.workspace = call, workspace
        return o, final_state

    @staticmethod
    def backward(ctx, do, d_final_state):
        q, k, v, g, beta, initial_state, *kept = ctx.saved_tensors
        call = ctx.call
        buffers = Buffers(
            call_arena(call, q.shape[1], q.dtype, ctx.workspace, "bwd", q.device), ctx.saved_layout, q.device,
            saving=False,
        )
        grads = host_backward(
            q, k, v, g, beta, do.contiguous(), call, buffers, dict(zip(ctx.saved_names, kept)),
            initial_state=initial_state, d_final_state=d_final_state,
            n_initial_states=initial_state.shape[0] if initial_state is not None else None,
        )
        d_initial_state = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            d_initial_state = grads.d_initial_state.to(initial_state.dtype)
        return grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, d_initial_state, None, None, None

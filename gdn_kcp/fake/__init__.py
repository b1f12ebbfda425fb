"""Fake kernels of ``gdn_kcp::fwd`` / ``gdn_kcp::bwd``: every saved tensor they
return comes from ``kernel_saved_layout``; outputs take the shapes of the
inputs they answer (o like v, gradients like their inputs). With these,
torch.compile, CUDA graphs and FakeTensor memory tracing see exactly the
tensors the real kernels return, and the workspace the caller allocated from
``gdn_workspace_bytes_kcp``."""

from __future__ import annotations

import torch

from gdn_kcp.context import context_from_meta
from gdn_kcp.ops import library
from gdn_kcp.options import options_from_str
from gdn_kcp.queries.layout import kernel_saved_layout
from gdn_kcp.dtypes import compute_dtype
from gdn_kcp.queries.shapes import SAVED_NAMES


@library.fwd.register_fake
def _fwd_fake(q, k, v, g, beta, initial_state, workspace, chunk_table, frag_table, meta, group_name, options,
              scale, n_final_states, gate_params, beta_sigmoid, beta_scale):
    ctx = context_from_meta(list(meta), chunk_table, frag_table, "")
    HV, K, V = v.shape[1], q.shape[2], v.shape[2]
    saved_layout = kernel_saved_layout(ctx, q.shape[1], HV, K, V, dtype=q.dtype, options=options_from_str(options))
    cdt = compute_dtype(q.dtype)
    saved = tuple(
        q.new_empty(saved_layout[name].shape, dtype=saved_layout[name].dtype) if name in saved_layout
        else q.new_empty(0, dtype=cdt)
        for name in SAVED_NAMES
    )
    return (torch.empty_like(v, dtype=q.dtype), q.new_empty(n_final_states, HV, K, V, dtype=cdt), *saved)


@library.bwd.register_fake
def _bwd_fake(do, d_final_state, q, k, v, g, beta, initial_state, saved, workspace, chunk_table, frag_table, meta,
              group_name, options, scale, needs_d_initial, gate_params, beta_sigmoid, beta_scale, tapes_ready=False):
    if needs_d_initial and initial_state is not None:
        d_initial = torch.empty_like(initial_state)
    else:
        d_initial = q.new_empty(0, dtype=compute_dtype(q.dtype))
    d_gate = torch.empty_like(gate_params) if gate_params is not None else q.new_empty(0, dtype=compute_dtype(q.dtype))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), d_initial, d_gate)

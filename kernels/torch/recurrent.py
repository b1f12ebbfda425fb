"""The token-by-token recurrence (decode and short prompts): one step per
token of each document, from its initial state, in the compute dtype:

    S_t = exp(g_t) S_{t-1}              (KDA: Diag(exp(g_t)) S_{t-1})
    u_t = beta_t (v_t - S_t^T k_t)      (beta_t a scalar, or per value channel)
    S_t = S_t + k_t u_t^T
    o_t = scale S_t^T q_t

with the in-kernel q / k L2 norm, gate and beta of the chunked programs
(:mod:`gdn_kcp.gates`). No product runs on tensor cores (each is a ``[K, V]``
matrix-vector product), so both twins compute it in fp32 (fp64 for fp64
inputs) from the inputs as stored. Batched over documents and heads; the
loop runs over the position inside a document.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ._chunks import L2NORM_EPS, put_rows
from .short_conv import conv_step


def _rows(x: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x[rows].to(dtype)


def _normed(x: torch.Tensor, on: bool) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS) if on else x


def recurrent(q, k, v, g, beta, gate_params, doc_bounds, initial_state, scale, *, o_out, state_out, use_qk_l2norm,
              beta_mode) -> None:
    """q, k ``[BT, H_qk, K]``; v ``[BT, HV, V]``; g, beta ``[BT, HV]`` (raw
    inputs under an in-kernel gate / beta sigmoid; KDA: g ``[BT, HV, K]``, a
    decay per key row of the state, and beta ``[BT, HV]`` or per value
    channel ``[BT, HV, V]``); gate_params ``[2, HV]``
    (``-exp(A_log)``, ``dt_bias``) or None; doc_bounds ``[N + 1]`` int64, the
    documents' token bounds; initial_state ``[N, HV, K, V]`` or None (zeros).
    ``beta_mode`` is ``(sigmoid, scale)``. Writes o_out ``[BT, HV, V]`` (its
    dtype) and the final states into state_out ``[N, HV, K, V]`` (the compute
    dtype; it may be initial_state itself)."""
    cdt = state_out.dtype
    state = torch.zeros_like(state_out) if initial_state is None else initial_state.to(cdt).clone()
    H_qk, HV = q.shape[1], v.shape[1]
    starts, lengths = doc_bounds[:-1], doc_bounds[1:] - doc_bounds[:-1]
    steps = int(lengths.max()) if lengths.numel() else 0
    sigmoid, beta_scale = beta_mode
    last = max(q.shape[0] - 1, 0)
    for p in range(steps):
        live = lengths > p
        rows = torch.where(live, starts + p, last)  # finished documents read a valid row and keep their state
        q_t = _normed(_rows(q, rows, cdt), use_qk_l2norm).repeat_interleave(HV // H_qk, dim=1)
        k_t = _normed(_rows(k, rows, cdt), use_qk_l2norm).repeat_interleave(HV // H_qk, dim=1)
        g_t, b_t = _rows(g, rows, cdt), _rows(beta, rows, cdt)
        if gate_params is not None:
            g_t = gate_params[0].to(cdt) * F.softplus(g_t + gate_params[1].to(cdt))
        b_t = beta_scale * (torch.sigmoid(b_t) if sigmoid else b_t)
        decayed = (torch.exp(g_t)[..., None] if g_t.dim() == 3 else torch.exp(g_t)[..., None, None]) * state
        residual = _rows(v, rows, cdt) - torch.einsum("nhk,nhkv->nhv", k_t, decayed)
        u_t = (b_t if b_t.dim() == 3 else b_t[..., None]) * residual
        stepped = decayed + k_t[..., None] * u_t[..., None, :]
        state.copy_(torch.where(live[:, None, None, None], stepped, state))
        o_t = scale * torch.einsum("nhk,nhkv->nhv", q_t, stepped)
        put_rows(o_out, rows, live, o_t)
    state_out.copy_(state)


def decode_step(qkv, conv_state, weight, bias, g, beta, gate_params, initial_state, scale, *, H_qk, o_out,
                state_out, conv_state_out, use_qk_l2norm, beta_mode) -> None:
    """One decode token per row, the short convolution and the recurrence in
    one program: qkv ``[N, D]`` (the raw q, k, v projections side by side,
    ``D = 2 H_qk K + HV V``); conv_state ``[N, D, W]`` (qkv's dtype), weight
    ``[D, W]``, bias ``[D]`` or None; g, beta ``[N, HV]``; the rest as
    :func:`recurrent`. Writes o_out ``[N, HV, V]``, state_out and
    conv_state_out (the advanced cache; not conv_state). The convolution's
    output stays in the compute dtype into the recurrence (no rounding to
    qkv's dtype between them, as in the Triton program)."""
    N, HV, K, V = state_out.shape
    y = torch.empty(qkv.shape, dtype=state_out.dtype, device=qkv.device)
    conv_step(qkv, conv_state, weight, bias, y_out=y, state_out=conv_state_out)
    q, k, v = y.split([H_qk * K, H_qk * K, HV * V], dim=1)
    recurrent(q.reshape(N, H_qk, K), k.reshape(N, H_qk, K), v.reshape(N, HV, V), g, beta, gate_params,
              torch.arange(N + 1, device=qkv.device), initial_state, scale, o_out=o_out, state_out=state_out,
              use_qk_l2norm=use_qk_l2norm, beta_mode=beta_mode)

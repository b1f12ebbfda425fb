"""The fp64 naive recurrence: the oracle every program and gradient is checked against.

Per value head, token by token (docs/design.md, "The recurrence"):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = scale S_t^T q_t

It is differentiable with autograd, so its gradients are the gradient oracle.
"""

from __future__ import annotations

import torch

from gdn_kcp.kernels.torch._chunks import L2NORM_EPS
from gdn_kcp.validate import qk_norm_flag


def naive_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool | None = None,
    cu_seqlens: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
    use_qk_l2norm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDN by its definition, in fp64, with the layouts of
    :func:`gdn_kcp.chunk_gated_delta_rule`.

    q, k: ``[B, T, H_qk, K]``; v: ``[B, T, HV, V]``; g, beta: ``[B, T, HV]``;
    cu_seqlens ``[N + 1]`` (B = 1) or None (B documents of T tokens);
    initial_state ``[N, HV, K, V]``; ``use_qk_l2norm_in_kernel`` (or its
    older name ``use_qk_l2norm``) normalises q and k. Returns o ``[B, T, HV, V]`` and, when asked,
    the final states ``[N, HV, K, V]``, both fp64 (``compute_dtype``: a
    benchmark may run the same loop in fp32; the oracle is fp64).

    Example::

        o, s = naive_recurrence(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 9]),
                                output_final_state=True)
    """
    def step(S, rows, t):
        k_t, beta_t = k[rows, t], beta[rows, t][..., None, None]
        erased = S - beta_t * k_t[..., :, None] * (k_t[..., None, :] @ S)
        return torch.exp(g[rows, t])[..., None, None] * erased + beta_t * k_t[..., :, None] * v[rows, t][..., None, :]

    q, k, v, g, beta, scale = _inputs(q, k, v, g, beta, scale, compute_dtype,
                                      bool(qk_norm_flag(use_qk_l2norm_in_kernel, use_qk_l2norm)[0]))
    return _walk(step, q, v, scale, initial_state, output_final_state, cu_seqlens)


def naive_kda_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA (docs/design.md, "KDA") by its definition, in fp64: per token, decay each key
    row of the state by its own gate, then the delta rule,

        S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,   o_t = scale S_t^T q_t

    with the layouts of :func:`gdn_kcp.chunk_kda`: g ``[B, T, HV, K]`` (the
    gate itself, after any in-kernel gate; :func:`gdn_kcp.kda_gates.kda_gate`
    computes that), beta ``[B, T, HV]``, the rest as :func:`naive_recurrence`.
    A gate of ``-inf`` zeroes its channel exactly.

    Example::

        o, s = naive_kda_recurrence(q, k, v, -torch.rand(1, 9, 4, 16), beta, output_final_state=True)
    """
    def step(S, rows, t):
        k_t, beta_t = k[rows, t], beta[rows, t][..., None, None]
        S = torch.exp(g[rows, t])[..., :, None] * S
        return S - beta_t * k_t[..., :, None] * (k_t[..., None, :] @ S) + beta_t * k_t[..., :, None] * v[rows, t][..., None, :]

    q, k, v, g, beta, scale = _inputs(q, k, v, g, beta, scale, compute_dtype, use_qk_l2norm_in_kernel)
    return _walk(step, q, v, scale, initial_state, output_final_state, cu_seqlens)


def _inputs(q, k, v, g, beta, scale, compute_dtype, use_qk_l2norm: bool):
    """The inputs in ``compute_dtype``, q and k normalised when asked and
    repeated per value head; the scale defaulted to ``K ** -0.5``."""
    H_qk, K, HV = q.shape[2], q.shape[3], v.shape[2]
    q, k, v, g, beta = (x.to(compute_dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + L2NORM_EPS)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + L2NORM_EPS)
    q = q.repeat_interleave(HV // H_qk, dim=2)
    k = k.repeat_interleave(HV // H_qk, dim=2)
    return q, k, v, g, beta, K**-0.5 if scale is None else scale


def _walk(step, q, v, scale, initial_state, output_final_state, cu_seqlens):
    """Walk every document token by token with ``step(S, rows, t)``: ``(o, final_state)``."""
    B, T, HV, K = q.shape
    # (batch rows, documents, first token, end): B documents of T tokens walk together
    if cu_seqlens is None:
        groups = [(list(range(B)), list(range(B)), 0, T)]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        groups = [([0], [n], bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]

    outputs, finals = [], []
    for rows, docs, start, end in groups:
        if initial_state is not None:
            S = initial_state[docs].to(q.dtype)
        else:
            S = q.new_zeros(len(docs), HV, K, v.shape[3])
        for t in range(start, end):
            S = step(S, rows, t)
            outputs.append(scale * (q[rows, t][..., None, :] @ S)[..., 0, :])
        finals.extend(S.unbind(0))
    if outputs and cu_seqlens is None:
        o = torch.stack(outputs, dim=1)
    elif outputs:
        o = torch.cat(outputs).view(B, T, HV, -1)
    else:
        o = v.new_zeros(B, T, HV, v.shape[3])
    final_state = torch.stack(finals) if output_final_state and finals else None
    if output_final_state and final_state is None:
        final_state = v.new_zeros(0, HV, K, v.shape[3])
    return o, final_state

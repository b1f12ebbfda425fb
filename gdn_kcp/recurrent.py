"""Decode: :func:`fused_recurrent_gated_delta_rule` (FLA-compatible) and the ops
a decode step of the layer runs.

``gdn_kcp::recurrent`` walks each document token by token from its initial
state (the torch program on the CPU, one Triton launch on CUDA:
``kernels/*/recurrent.py``), with the chunked path's in-kernel q / k norm,
gate and beta. ``gdn_kcp::conv_step`` advances the short convolution's cache
by one token per row (``kernels/*/short_conv.py``); ``gdn_kcp::decode_step``
runs both in one program (``kernels/*/recurrent.py``: the layer's decode step
with its convolution). All are forward only, as
FLA's recurrent kernel is: training runs the chunked path, whose backward
covers the same math (:func:`gdn_kcp.chunk_gated_delta_rule`). Their fakes
shape the outputs, so a decode step traces under ``torch.compile(fullgraph=True)``
(tested). Without ``cu_seqlens`` a call reads nothing back to the host and
copies nothing to the device, as a CUDA-graph capture needs (capture is not
tested: no GPU here).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from gdn_kcp.dtypes import compute_dtype
from gdn_kcp.fla_compat import check_cp_context, fla_keywords, states_v_first
from gdn_kcp.gates import gate_keywords
from gdn_kcp.host.programs import programs_for
from gdn_kcp.ops.autograd import check_triton_head_dims
from gdn_kcp.validate import check_flag, check_gdn_inputs

DEVICES = ("cpu", "cuda")


def _forward_only(name: str):
    def backward(ctx, *grads):
        raise NotImplementedError(f"gdn_kcp::{name} is forward only (decode), as flash-linear-attention's recurrent "
                                  f"kernel is: train with gdn_kcp.chunk_gated_delta_rule, which computes the same math")
    return backward


@torch.library.custom_op("gdn_kcp::recurrent", mutates_args=(), device_types=DEVICES)
def recurrent_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, gate_params: Optional[Tensor],
                 doc_bounds: Tensor, initial_state: Optional[Tensor], scale: float, use_qk_l2norm: bool,
                 beta_sigmoid: bool, beta_scale: float) -> tuple[Tensor, Tensor]:
    """q, k ``[BT, H_qk, K]``; v ``[BT, HV, V]``; g, beta ``[BT, HV]``;
    gate_params ``[2, HV]`` (compute dtype) or None; doc_bounds ``[N + 1]``
    int64 covering ``[0, BT]``; initial_state ``[N, HV, K, V]`` or None (zeros).
    Returns o ``[BT, HV, V]`` (q's dtype) and the final states ``[N, HV, K, V]``
    (compute dtype)."""
    N, HV, V = doc_bounds.shape[0] - 1, v.shape[1], v.shape[2]
    cdt = compute_dtype(q.dtype)
    state = q.new_empty(N, HV, q.shape[2], V, dtype=cdt)
    if initial_state is not None:
        initial_state = initial_state.to(cdt).contiguous()
    o = q.new_empty(q.shape[0], HV, V)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # the programs address rows as (t H + h) D
    programs_for(q.device).recurrent(q, k, v, g, beta, gate_params, doc_bounds, initial_state, scale, o_out=o,
                                     state_out=state, use_qk_l2norm=use_qk_l2norm, beta_mode=(beta_sigmoid, beta_scale))
    return o, state


@recurrent_op.register_fake
def _(q, k, v, g, beta, gate_params, doc_bounds, initial_state, scale, use_qk_l2norm, beta_sigmoid, beta_scale):
    HV, V = v.shape[1], v.shape[2]
    return (q.new_empty(q.shape[0], HV, V),
            q.new_empty(doc_bounds.shape[0] - 1, HV, q.shape[2], V, dtype=compute_dtype(q.dtype)))


recurrent_op.register_autograd(_forward_only("recurrent"))


@torch.library.custom_op("gdn_kcp::conv_step", mutates_args=(), device_types=DEVICES)
def conv_step_op(x: Tensor, state: Tensor, weight: Tensor, bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """x ``[N, D]`` (one token per row); state ``[N, D, W]`` (x's dtype);
    weight ``[D, W]``; bias ``[D]`` or None. Returns ``silu(conv)`` ``[N, D]``
    and the advanced state ``[N, D, W]``."""
    y, state_out = torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(state, memory_format=torch.contiguous_format)
    programs_for(x.device).conv_step(x.contiguous(), state.contiguous(), weight.contiguous(),
                                     None if bias is None else bias.contiguous(), y_out=y, state_out=state_out)
    return y, state_out


@conv_step_op.register_fake
def _(x, state, weight, bias):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(state, memory_format=torch.contiguous_format))


conv_step_op.register_autograd(_forward_only("conv_step"))


@torch.library.custom_op("gdn_kcp::decode_step", mutates_args=(), device_types=DEVICES)
def decode_step_op(qkv: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor], g: Tensor, beta: Tensor,
                   gate_params: Optional[Tensor], initial_state: Optional[Tensor], H_qk: int, K: int, V: int,
                   scale: float, use_qk_l2norm: bool, beta_sigmoid: bool, beta_scale: float
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """A layer's decode step in one program: the short convolution of the raw
    projections qkv ``[N, D]`` (one token per row; ``D = 2 H_qk K + HV V``)
    with its cache ``conv_state`` ``[N, D, W]`` (qkv's dtype), weight
    ``[D, W]``, bias ``[D]`` or None, then the recurrence as :func:`recurrent_op`
    on g, beta ``[N, HV]``. Returns o ``[N, HV, V]`` (qkv's dtype), the final
    states ``[N, HV, K, V]`` (compute dtype) and the advanced cache ``[N, D, W]``."""
    N, HV = qkv.shape[0], g.shape[1]
    state = qkv.new_empty(N, HV, K, V, dtype=compute_dtype(qkv.dtype))
    if initial_state is not None:
        initial_state = initial_state.to(state.dtype).contiguous()
    o = qkv.new_empty(N, HV, V)
    conv_out = torch.empty_like(conv_state, memory_format=torch.contiguous_format)
    programs_for(qkv.device).decode_step(
        qkv.contiguous(), conv_state.contiguous(), weight.contiguous(), None if bias is None else bias.contiguous(),
        g.contiguous(), beta.contiguous(), gate_params, initial_state, scale, H_qk=H_qk, o_out=o, state_out=state,
        conv_state_out=conv_out, use_qk_l2norm=use_qk_l2norm, beta_mode=(beta_sigmoid, beta_scale))
    return o, state, conv_out


@decode_step_op.register_fake
def _(qkv, conv_state, weight, bias, g, beta, gate_params, initial_state, H_qk, K, V, scale, use_qk_l2norm,
      beta_sigmoid, beta_scale):
    N, HV = qkv.shape[0], g.shape[1]
    return (qkv.new_empty(N, HV, V), qkv.new_empty(N, HV, K, V, dtype=compute_dtype(qkv.dtype)),
            torch.empty_like(conv_state, memory_format=torch.contiguous_format))


decode_step_op.register_autograd(_forward_only("decode_step"))


def fused_recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    gv: Tensor | None = None,
    beta: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cp_context: object = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Gated DeltaNet token by token: decode steps and short prompts.

    flash-linear-attention's signature and semantics (the arguments of
    :func:`gdn_kcp.chunk_gated_delta_rule`, in FLA's order for this function);
    the math, layouts and dtypes are the chunked function's, to rounding. ``g``
    defaults to no decay and ``beta`` to ones, as in FLA. ``gk`` / ``gv`` (FLA's
    per-key / per-value decays of other models) are not Gated DeltaNet's and
    raise ``ValueError``. Forward only, as FLA's: a backward through it raises
    ``NotImplementedError``; train with :func:`gdn_kcp.chunk_gated_delta_rule`.

    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``; the final
    state is fp32 (fp64 for fp64 inputs), V-first with ``state_v_first``.

    Example::

        state = None
        for t in range(4):  # one token per step, a batch of 2
            q, k = torch.randn(2, 1, 2, 64), torch.randn(2, 1, 2, 64)
            v, g, beta = torch.randn(2, 1, 4, 64), -torch.rand(2, 1, 4), torch.rand(2, 1, 4)
            o, state = fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=state,
                                                        output_final_state=True)
    """
    state_v_first = fla_keywords(state_v_first, kwargs, fn="fused_recurrent_gated_delta_rule")
    check_cp_context(cp_context)
    q, k, v, o_dtype = operands_of_one_dtype(q, k, v)
    for name, x in (("gk", gk), ("gv", gv)):
        if x is not None:
            raise ValueError(f"{name} (a per-channel decay) is not part of Gated DeltaNet: pass the per-head "
                             f"log decay g [B, T, HV]")
    if isinstance(v, Tensor) and v.dim() == 4:  # else check_gdn_inputs names v
        g = v.new_zeros(v.shape[:3]) if g is None and not use_gate_in_kernel else g
        beta = v.new_ones(v.shape[:3]) if beta is None else beta
    gate = gate_keywords(g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                         use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    dims, _ = check_gdn_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               cu_seqlens=cu_seqlens, state_v_first=state_v_first)
    check_flag("output_final_state", output_final_state)
    check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    if q.device.type == "cuda":
        check_triton_head_dims(dims.K, dims.V)
    if state_v_first:
        initial_state = states_v_first(initial_state)
    BT = dims.B * dims.T
    if cu_seqlens is None:  # B rows of T tokens, built on the device: no host-to-device copy in a decode step
        doc_bounds = torch.arange(dims.B + 1, dtype=torch.int64, device=q.device) * dims.T
    else:
        doc_bounds = cu_seqlens.to(q.device, torch.int64)
    cdt = compute_dtype(q.dtype)
    o, final_state = recurrent_op(
        q.reshape(BT, dims.H_qk, dims.K), k.reshape(BT, dims.H_qk, dims.K), v.reshape(BT, dims.HV, dims.V),
        g.reshape(BT, dims.HV), beta.reshape(BT, dims.HV), None if gate is None else gate.params(cdt), doc_bounds,
        initial_state, float(dims.K**-0.5 if scale is None else scale), use_qk_l2norm_in_kernel,
        False if gate is None else gate.beta_sigmoid, 1.0 if gate is None else gate.beta_scale)
    if not output_final_state:
        final_state = None
    elif state_v_first:
        final_state = states_v_first(final_state).contiguous()
    return o.view(dims.B, dims.T, dims.HV, dims.V).to(o_dtype), final_state


def operands_of_one_dtype(q: object, k: object, v: object) -> tuple[object, object, object, torch.dtype | None]:
    """``(q, k, v, o_dtype)``: FLA's fused recurrent kernel loads q, k and v
    each in its own dtype, computes in fp32 and returns o in v's dtype, so q
    and k in fp32 beside an fp16 v is a call it takes (its own tests make it).
    Such operands are promoted here to their common dtype (exactly: every
    fp16 / bf16 value is an fp32 value), and o goes back to v's dtype
    (``o_dtype``; q's, which is v's, when all three agree). Anything that is
    not three floating tensors is left to the checks, which name it."""
    operands = (q, k, v)
    if not all(isinstance(x, Tensor) and x.is_floating_point() for x in operands):
        return q, k, v, None
    if q.dtype == k.dtype == v.dtype:
        return q, k, v, v.dtype
    common = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(common), k.to(common), v.to(common), v.dtype

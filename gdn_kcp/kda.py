"""Kimi Delta Attention (KDA, docs/design.md): the gated delta rule with a gate
per key channel, on the same programs, host path, exchanges and byte queries
as GDN (``OptionsKcp.gate="channel"``).

:func:`chunk_kda` has flash-linear-attention's signature (``fla.ops.kda.chunk_kda``)
on one rank; :func:`kda_kcp` is :func:`gdn_kcp.gdn_kcp` for KDA, a packed
stream split over the ranks of a context at any token split. FLA's gate in
kernel,

    g = -exp(A_log) * softplus(g_raw + dt_bias)                      (A_log [HV], dt_bias [HV * K])
    g = lower_bound * sigmoid(exp(A_log) * (g_raw + dt_bias))          (with lower_bound; A_log optional)

is :func:`kda_gate` (fp32; fp64 for fp64 inputs). The softplus form runs in
the programs, as GDN's gate in kernel does: the ops take the raw g and
``[2, HV, K]`` parameters (``-exp(A_log)`` per head, ``dt_bias`` per channel),
compute the gate as they load g, and the backward returns the raw g's
gradient and the parameters' (``[T, HV, K]`` reductions), so no gate tensor
is written or saved: the ops keep the raw g, where a torch expression ahead
of them keeps three fp32 ``[T, HV, K]`` tensors per layer until the backward
(softplus's input and output, and the gate; with a bf16 g, 320 MiB more at
T = 8192, HV = 32, K = 128, counted with ``saved_tensors_hooks``; the
outputs bitwise the same). The lower-bound form is that torch expression
(autograd carries dg to g_raw, A_log and dt_bias), as is the gate of
:func:`fused_recurrent_kda`. The beta keywords run in the programs as for GDN. The programs are
exact at any gate (no exponent above 0), so ``safe_gate`` and ``lower_bound``
buy no speed here: they are accepted and checked as FLA checks them. The torch
programs run KDA on the CPU, the Triton programs on CUDA (a gate per key
channel in every program; checked against the torch programs under Triton's
interpreter, not yet run on a GPU); so does the decode step,
:func:`fused_recurrent_kda` (``recurrent_kernel[channel]``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from gdn_kcp.call_checks import resolve_options
from gdn_kcp.chunk import one_rank_call
from gdn_kcp.context import KcpContext
from gdn_kcp.kcp import gdn_kcp
from gdn_kcp.fla_compat import check_cp_context, check_cu_seqlens_cpu, fla_keywords, states_chunk_size
from gdn_kcp.fla_compat import states_v_first as swap_state_layout
from gdn_kcp.gates import InKernelGate, check_channel_gate_params, check_gate_flags, gate_keywords
from gdn_kcp.kernels.precision import accumulator_dtype
from gdn_kcp.options import OptionsKcp
from gdn_kcp.recurrent import recurrent_op
from gdn_kcp.workspace import WorkspaceKcp
from gdn_kcp.validate import check_flag, check_gdn_inputs, check_tensor


def kda_gate(g: torch.Tensor, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
             lower_bound: float | None = None) -> torch.Tensor:
    """FLA's KDA gate of the raw input ``g`` ``[..., HV, K]``, in fp32 (fp64 for
    fp64 inputs), differentiable in all three tensors:
    ``-exp(A_log) softplus(g + dt_bias)``, or with ``lower_bound``
    ``lower_bound sigmoid(exp(A_log) (g + dt_bias))`` (without A_log,
    ``lower_bound sigmoid(g + dt_bias)``). A_log: HV elements, dt_bias: HV * K
    (any shape, as FLA takes them: ``[HV]`` and ``[HV * K]`` usually).

    >>> kda_gate(torch.zeros(1, 2, 4), A_log=torch.zeros(2)).flatten()[:2]
    tensor([-0.6931, -0.6931])
    """
    cdt = accumulator_dtype(g.dtype)
    HV, K = g.shape[-2:]
    x = g.to(cdt)
    if dt_bias is not None:
        x = x + dt_bias.to(cdt).reshape(HV, K)
    if lower_bound is None:
        return -A_log.to(cdt).exp().reshape(HV, 1) * F.softplus(x)
    if A_log is not None:
        x = A_log.to(cdt).exp().reshape(HV, 1) * x
    return lower_bound * torch.sigmoid(x)


def check_kda_gate(g: torch.Tensor, *, A_log, dt_bias, lower_bound, use_gate_in_kernel: bool, safe_gate: bool,
                   use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> InKernelGate | None:
    """FLA's refusals of KDA's gate and beta keywords, as ValueErrors that name
    the argument; returns the beta mode the programs compute (None without one)."""
    check_gate_flags(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                     use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                     safe_gate=safe_gate)
    if lower_bound is not None:
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
            raise TypeError(f"lower_bound must be a float or None, got {type(lower_bound).__name__}")
        if not lower_bound < 0:
            raise ValueError(f"lower_bound must be negative (a bound on the log decay), got {lower_bound}")
    if use_gate_in_kernel:
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True needs A_log [HV] (or lower_bound, which makes A_log optional)")
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate=True with use_gate_in_kernel=True needs lower_bound (in [-5, 0), as in "
                             "flash-linear-attention)")
        if safe_gate and not -5 <= lower_bound < 0:
            raise ValueError(f"lower_bound must be in [-5, 0) with safe_gate=True and use_gate_in_kernel=True, "
                             f"got {lower_bound}")
        if isinstance(g, torch.Tensor) and g.dim() == 4:
            check_channel_gate_params(g, A_log, dt_bias)
    if not use_beta_sigmoid_in_kernel:
        return None
    return InKernelGate(None, None, True, 2.0 if allow_neg_eigval else 1.0)


def _gate_for_ops(g, A_log, dt_bias, lower_bound, use_gate_in_kernel: bool):
    """``(g, A_log, dt_bias, use_gate_in_kernel)`` as the ops take them: the
    softplus gate in kernel as given (the programs compute it), the lower-bound
    form as the torch expression :func:`kda_gate` ahead of them."""
    if use_gate_in_kernel and lower_bound is not None:
        return kda_gate(g, A_log, dt_bias, lower_bound), None, None, False
    return g, A_log, dt_bias, use_gate_in_kernel


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    cp_context: object = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    save_mode: str | None = None,
    reuse_recompute_tapes: bool | str | None = None,
    recompute_output: str = "auto",
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA on one rank, chunked (C = 64), with an explicit backward:
    flash-linear-attention's ``chunk_kda`` (same positional order and keywords).

    Args:
        q, k: ``[B, T, H_qk, K]``. v: ``[B, T, HV, V]``, ``HV % H_qk == 0``.
        g: ``[B, T, HV, K]``, the log decay per key channel (``<= 0``; ``-inf``
            resets that channel), or with ``use_gate_in_kernel`` the raw gate
            input of :func:`kda_gate` (``A_log`` ``[HV]`` and ``dt_bias``
            ``[HV * K]`` through the keywords, as FLA takes them).
        beta: ``[B, T, HV]`` (raw with ``use_beta_sigmoid_in_kernel``; doubled
            sigmoid with ``allow_neg_eigval``).
        scale, initial_state (``[N, HV, K, V]``, ``[N, HV, V, K]`` with
            ``state_v_first``), output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens, cu_seqlens_cpu: as :func:`gdn_kcp.chunk_gated_delta_rule`.
        safe_gate, lower_bound: checked as FLA checks them; the gate is exact
            here at any value, so safe_gate changes nothing.
        disable_recompute: keep every forward tape (``save_mode="full"``).
        save_mode, reuse_recompute_tapes, recompute_output: the call's
            ``OptionsKcp`` fields (not FLA's), as for
            :func:`gdn_kcp.chunk_gated_delta_rule`; ``save_mode`` defaults to
            ``"light"`` (``"full"`` with ``disable_recompute``, which no
            other save mode may contradict).
        return_intermediate_states: inference only (no gradient can be asked):
            also return ``h``, the state each chunk of ``chunk_size`` tokens
            starts from (:func:`gdn_kcp.chunk.chunk_states`: FLA's
            ``[B, NT, HV, K, V]`` in the input dtype; with ``cu_seqlens``
            ``[1, n, HV, K, V]``, n from the call's chunk cap, the real chunks
            first and zeros after).
        cp_context: refused: KCP is :func:`kda_kcp`.
        use_graph, max_num_seqs: accepted; a fixed-length ``cu_seqlens`` is
            always one graph here (``max_num_seqs``, when given, must be its
            document count).
        kwargs: ``A_log``, ``dt_bias``, ``chunk_size`` (32 or 64, as FLA
            takes it; the programs compute on 64-token chunks either way; it
            sets where the intermediate states are taken),
            ``transpose_state_layout``; anything else is a TypeError.

    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V] or None)``, and
    ``h`` after them with ``return_intermediate_states``.

    Example::

        g = -torch.rand(1, 100, 4, 64)
        o, s = chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=torch.tensor([0, 30, 100]))
    """
    kwargs = dict(kwargs)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    state_v_first = fla_keywords(state_v_first, kwargs, fn="chunk_kda")
    check_cp_context(cp_context, kcp_entry="kda_kcp")
    for name, flag in (("disable_recompute", disable_recompute), ("use_graph", use_graph)):
        check_flag(name, flag)
    states_every = states_chunk_size(return_intermediate_states, kwargs)
    check_kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
                   safe_gate=safe_gate, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval)
    host_bounds = check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens)
    dims, bounds = check_gdn_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                    cu_seqlens=cu_seqlens, cu_seqlens_host=host_bounds,
                                    state_v_first=state_v_first, gate="channel")
    if max_num_seqs is not None and (cu_seqlens is None or max_num_seqs != cu_seqlens.shape[0] - 1):
        raise ValueError(f"max_num_seqs = {max_num_seqs!r} must be the document count of cu_seqlens "
                         f"({None if cu_seqlens is None else cu_seqlens.shape[0] - 1}): pad cu_seqlens to it")
    if initial_state is not None and initial_state.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"initial_state must be float32 (as in flash-linear-attention), got {initial_state.dtype}")
    if state_v_first:
        initial_state = swap_state_layout(initial_state)
    check_flag("output_final_state", output_final_state)
    check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    g, A_log, dt_bias, use_gate_in_kernel = _gate_for_ops(g, A_log, dt_bias, lower_bound, use_gate_in_kernel)
    gate = gate_keywords(g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                         use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
                         per_channel=True)
    if disable_recompute and save_mode not in (None, "full"):
        raise ValueError(f"disable_recompute=True keeps every tape (save_mode='full'); it contradicts "
                         f"save_mode={save_mode!r}")
    if save_mode is None:
        save_mode = "full" if disable_recompute else "light"
    options = OptionsKcp(use_qk_l2norm=use_qk_l2norm_in_kernel, save_mode=save_mode,
                         reuse_recompute_tapes=reuse_recompute_tapes, recompute_output=recompute_output,
                         gate="channel")
    return one_rank_call(q, k, v, g, beta, dims, bounds, initial_state, cu_seqlens, options, scale,
                         output_final_state, state_v_first, gate, states_every)


def kda_kcp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ctx: KcpContext,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool | None = None,
    options: OptionsKcp | None = None,
    workspace: WorkspaceKcp | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
    lower_bound: float | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over a packed stream split across the ranks of ``ctx`` (KCP): every
    rank passes its own token range, as for :func:`gdn_kcp.gdn_kcp`, whose
    arguments, options, states and workspace these are, with g ``[1, T_r, HV, K]``
    (a gate per key channel) and the gate keywords of :func:`chunk_kda`.
    ``options.gate`` is set to ``"channel"`` (the ``kda_*`` byte queries size
    such a call); the exchanges carry the same ``(M, S)`` summaries as GDN's.

    Example::

        ctx = build_kcp_context(cu_seqlens_global)              # same on every rank
        start, end = ctx.rank_ranges[ctx.rank]
        o, _ = kda_kcp(q[:, start:end], k[:, start:end], v[:, start:end],
                       g[:, start:end], beta[:, start:end], ctx, use_qk_l2norm_in_kernel=True)
    """
    check_kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
                   safe_gate=False, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval)
    if options is not None and not isinstance(options, OptionsKcp):
        raise TypeError(f"options must be an OptionsKcp or None, got {type(options).__name__}")
    if use_gate_in_kernel and lower_bound is not None:  # kda_gate reads g's last two dims
        check_tensor("g", g, 4, "[1, T_r, HV, K]")
    g, A_log, dt_bias, use_gate_in_kernel = _gate_for_ops(g, A_log, dt_bias, lower_bound, use_gate_in_kernel)
    options = resolve_options(options, use_qk_l2norm_in_kernel, "use_qk_l2norm_in_kernel")
    return gdn_kcp(q, k, v, g, beta, ctx, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, options=replace(options, gate="channel"), workspace=workspace,
                   A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA token by token (decode and short prompts), forward only:
    flash-linear-attention's ``fused_recurrent_kda`` (same positional order and
    keywords; ``dt_bias`` ``[HV * K]`` as its kernel reads it). ``beta`` is
    ``[B, T, HV]`` or, per value channel, ``[B, T, HV, V]`` (FLA's head-wise
    beta). The math, layouts and dtypes are :func:`chunk_kda`'s, to rounding;
    a backward through it raises ``NotImplementedError`` (train with
    :func:`chunk_kda`).

    Example::

        o, state = fused_recurrent_kda(q, k, v, -torch.rand(2, 1, 4, 64), beta, initial_state=state,
                                       output_final_state=True)
    """
    state_v_first = fla_keywords(state_v_first, dict(kwargs), fn="fused_recurrent_kda")
    beta_mode = check_kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                               use_gate_in_kernel=use_gate_in_kernel, safe_gate=False,
                               use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                               allow_neg_eigval=allow_neg_eigval)
    per_value_beta = isinstance(beta, torch.Tensor) and isinstance(v, torch.Tensor) and beta.dim() == v.dim() == 4
    if per_value_beta and beta.shape != v.shape:
        raise ValueError(f"a per-channel beta must have v's shape [B, T, HV, V] = {tuple(v.shape)}, "
                         f"got {tuple(beta.shape)}")
    dims, _ = check_gdn_inputs(q, k, v, g, beta[..., 0] if per_value_beta else beta, scale=scale,
                               initial_state=initial_state, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                               gate="channel")
    check_flag("output_final_state", output_final_state)
    check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    if state_v_first:
        initial_state = swap_state_layout(initial_state)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound)
    BT = dims.B * dims.T
    if cu_seqlens is None:
        doc_bounds = torch.arange(dims.B + 1, dtype=torch.int64, device=q.device) * dims.T
    else:
        doc_bounds = cu_seqlens.to(q.device, torch.int64)
    beta_shape = (BT, dims.HV, dims.V) if per_value_beta else (BT, dims.HV)
    o, final_state = recurrent_op(
        q.reshape(BT, dims.H_qk, dims.K), k.reshape(BT, dims.H_qk, dims.K), v.reshape(BT, dims.HV, dims.V),
        g.reshape(BT, dims.HV, dims.K), beta.reshape(beta_shape), None, doc_bounds, initial_state,
        float(dims.K**-0.5 if scale is None else scale), use_qk_l2norm_in_kernel,
        beta_mode is not None, 1.0 if beta_mode is None else beta_mode.beta_scale)
    if not output_final_state:
        final_state = None
    elif state_v_first:
        final_state = swap_state_layout(final_state).contiguous()
    return o.view(dims.B, dims.T, dims.HV, dims.V), final_state

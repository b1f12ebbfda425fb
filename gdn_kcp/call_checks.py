"""The checks of a :func:`gdn_kcp.gdn_kcp` call's arguments, in one place: the
call runs them, and so does the collective rank check
(:mod:`gdn_kcp.rank_check`) before any rank can raise on its own."""

from __future__ import annotations

from dataclasses import replace

from gdn_kcp.context import KcpContext
from gdn_kcp.gates import InKernelGate, gate_keywords
from gdn_kcp.ops import check_workspace
from gdn_kcp.options import OptionsKcp
from gdn_kcp.validate import GdnDims, check_flag, check_gdn_inputs, qk_norm_flag


def resolve_options(options: object, use_qk_l2norm: bool | None, name: str = "use_qk_l2norm") -> OptionsKcp:
    """``options`` with the q/k norm switch given as ``name`` (checked) folded in."""
    if options is not None and not isinstance(options, OptionsKcp):
        raise TypeError(f"options must be an OptionsKcp or None, got {type(options).__name__}")
    if use_qk_l2norm is None:
        return options or OptionsKcp()
    if not isinstance(use_qk_l2norm, bool):
        raise TypeError(f"{name} must be a bool or None, got {type(use_qk_l2norm).__name__}")
    if options is not None and use_qk_l2norm != options.use_qk_l2norm:
        raise ValueError(f"{name}={use_qk_l2norm} disagrees with options.use_qk_l2norm={options.use_qk_l2norm}")
    return replace(options or OptionsKcp(), use_qk_l2norm=use_qk_l2norm)


def check_kcp_inputs(q, k, v, g, beta, ctx, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_qk_l2norm, options, workspace, gate_kwargs: dict
                     ) -> tuple[OptionsKcp, GdnDims, InKernelGate | None]:
    """Every check of a :func:`gdn_kcp` call's arguments; returns the resolved
    options, the sizes and the in-kernel gate (``gate_kwargs``: FLA's gate and
    beta keywords, :func:`gdn_kcp.gates.gate_keywords`)."""
    if not isinstance(ctx, KcpContext):
        raise TypeError(f"ctx must be a KcpContext (from build_kcp_context), got {type(ctx).__name__}")
    flag, flag_name = qk_norm_flag(use_qk_l2norm_in_kernel, use_qk_l2norm)
    options = resolve_options(options, flag, flag_name)
    gate = gate_keywords(g, beta, per_channel=options.gate == "channel", **gate_kwargs)
    check_flag("output_final_state", output_final_state)
    dims, _ = check_gdn_inputs(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=None,
                               initial_rows=(ctx.n_start_docs, "ctx.n_start_docs"), gate=options.gate)
    if dims.B != 1:
        raise ValueError(f"gdn_kcp takes one packed row per rank (B = 1), got B = {dims.B}")
    if dims.T != ctx.n_tokens:
        raise ValueError(
            f"q holds T = {dims.T} tokens but rank {ctx.rank} of the context holds "
            f"{ctx.n_tokens} (rank_ranges[{ctx.rank}] = {ctx.rank_ranges[ctx.rank]})"
        )
    check_workspace(workspace, ctx, dims.H_qk, dims.HV, dims.K, dims.V, q.dtype, options)
    return options, dims, gate

"""Single-rank GDN: :func:`chunk_gated_delta_rule`, FLA-compatible."""

from __future__ import annotations

import torch

from gdn_kcp.context import capped_context, context_from_split, device_sms
from gdn_kcp.fla_compat import (
    check_chunk_indices,
    check_cp_context,
    check_cu_seqlens_cpu,
    states_chunk_size,
    fla_keywords,
    states_v_first,
)
from gdn_kcp.gates import gate_keywords
from gdn_kcp.ops import apply_gdn, apply_gdn_states
from gdn_kcp.options import OptionsKcp
from gdn_kcp.validate import check_flag, check_gdn_inputs


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    chunk_indices: torch.Tensor | None = None,
    cp_context: object = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
    save_mode: str = "light",
    reuse_recompute_tapes: bool | str | None = None,
    recompute_output: str = "auto",
    return_intermediate_states: bool = False,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Gated DeltaNet on one rank, chunked (C = 64), with an explicit backward.

    flash-linear-attention's signature: the same positional order and keywords
    (:mod:`gdn_kcp.fla_compat` has the call forms that are not math).

    Args:
        q, k: ``[B, T, H_qk, K]``.
        v: ``[B, T, HV, V]``, ``HV % H_qk == 0`` (value head i reads key head
            ``i // (HV // H_qk)``).
        g: ``[B, T, HV]``, log decay (``<= 0``). beta: ``[B, T, HV]``.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, one per document (``[N, HV, V, K]``
            with ``state_v_first``).
        output_final_state: also return the final states ``[N, HV, K, V]``
            (``[N, HV, V, K]`` with ``state_v_first``).
        use_qk_l2norm_in_kernel: L2-normalise q and k per token and head.
        use_beta_sigmoid_in_kernel, allow_neg_eigval, A_log, dt_bias,
            use_gate_in_kernel: FLA's gate and beta keywords
            (:mod:`gdn_kcp.gates`): with ``use_gate_in_kernel`` g is the raw
            gate input and ``g = -exp(A_log) softplus(g + dt_bias)``; with
            ``use_beta_sigmoid_in_kernel`` ``beta = sigmoid(beta)``, and
            ``allow_neg_eigval`` (which needs it, as in FLA) doubles it.
        state_v_first: states in FLA's V-first layout (the deprecated
            keyword ``transpose_state_layout`` is taken with FLA's warning).
        cu_seqlens: ``[N + 1]`` int32/int64 document bounds of a packed batch
            (B = 1); without it the B rows are N = B documents.
        cu_seqlens_cpu: a host copy of ``cu_seqlens``: the eager checks read
            it instead (no device sync); it must equal ``cu_seqlens``.
        chunk_indices: FLA's precomputed ``[NT, 2]`` chunk table; the kernels
            cut their own chunks, so it is only checked against ``cu_seqlens``.
        cp_context: FLA's context parallelism: refused (use :func:`gdn_kcp.gdn_kcp`).
        save_mode: ``OptionsKcp.save_mode`` of the call (not FLA's): ``"light"``
            saves nothing beyond the inputs, ``"inverse"`` keeps A and the q/k
            norms as FLA does (a shorter backward), ``"full"`` every tape.
        reuse_recompute_tapes, recompute_output: the call's
            ``OptionsKcp`` fields of the same names (not FLA's): under a
            non-reentrant ``torch.utils.checkpoint`` the recompute writes the
            tapes the backward binds, and skips the output nothing reads
            (docs/api.md, "Activation checkpointing").
        return_intermediate_states: inference only (no gradient can be asked):
            also return ``h``, the state each chunk of ``chunk_size`` tokens
            starts from (:func:`chunk_states`), as FLA's ``chunk_kda`` does.
        kwargs: ``chunk_size`` (16, 32 or 64, as FLA takes it; the programs
            compute on 64-token chunks whichever is asked, which changes
            nothing but rounding; it sets where the intermediate states are
            taken), ``transpose_state_layout``,
            ``head_first`` (raises ``DeprecationWarning``, as FLA does). Any
            other keyword is a ``TypeError`` (FLA ignores it).

    Returns ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state
    fp32 (fp64 for fp64 inputs) or None; with ``return_intermediate_states``
    ``(o, final_state, h)``. Computation is in fp32 (fp64 for fp64
    inputs). It is the one-rank case of :func:`gdn_kcp` (same host path, save
    plan and workspace layout, default options but those it names).

    With ``cu_seqlens`` the chunk index is built on its device at the caps of
    its length (a capped context, ``max_docs = N``), so under
    ``torch.compile(fullgraph=True)`` one graph serves every packing of a
    fixed-length ``cu_seqlens``: pad it with trailing repeats of T (zero-length
    documents, whose initial states pass to their final states unchanged).
    Eager calls read ``cu_seqlens`` (or ``cu_seqlens_cpu``) on the host once
    to check it, like FLA; traced calls, and FakeTensors, check its values
    with device-side asserts instead.

    Example::

        q = torch.randn(1, 100, 2, 64); k = torch.randn(1, 100, 2, 64)
        v = torch.randn(1, 100, 4, 64)
        g = -torch.rand(1, 100, 4); beta = torch.rand(1, 100, 4)
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                      cu_seqlens=torch.tensor([0, 30, 100]))
    """
    state_v_first = fla_keywords(state_v_first, kwargs)
    states_every = states_chunk_size(return_intermediate_states, kwargs)
    check_cp_context(cp_context)
    gate = gate_keywords(g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                         use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    host_bounds = check_cu_seqlens_cpu(cu_seqlens_cpu, cu_seqlens)
    dims, bounds = check_gdn_inputs(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
        cu_seqlens_host=host_bounds, state_v_first=state_v_first,
    )
    if state_v_first:
        initial_state = states_v_first(initial_state)
    check_chunk_indices(chunk_indices, cu_seqlens)
    check_flag("output_final_state", output_final_state)
    check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    options = OptionsKcp(use_qk_l2norm=use_qk_l2norm_in_kernel, save_mode=save_mode,
                         reuse_recompute_tapes=reuse_recompute_tapes, recompute_output=recompute_output)
    return one_rank_call(q, k, v, g, beta, dims, bounds, initial_state, cu_seqlens, options, scale,
                         output_final_state, state_v_first, gate, states_every)


def one_rank_call(q, k, v, g, beta, dims, bounds, initial_state, cu_seqlens, options: OptionsKcp,
                  scale: float | None, output_final_state: bool, state_v_first: bool, gate,
                  states_every: int | None = None):
    """The checked FLA-layout call on one rank (GDN, or KDA with
    ``options.gate == "channel"``): the context of its documents, the ops,
    and FLA's output layouts. ``bounds``: the host-read document bounds (or
    None, traced); ``initial_state`` already in our ``[N, HV, K, V]`` layout.
    With ``states_every`` (a chunk size), ``(o, final_state, h)``: the states
    at the starts of chunks of that many tokens (:func:`chunk_states`)."""
    BT = dims.B * dims.T
    n_sms = device_sms(q.device)  # the segment plan fills the device
    if cu_seqlens is None:
        ctx = context_from_split(bounds, [(0, BT)], 0, device=q.device, n_sms=n_sms)
    else:
        ctx = capped_context(cu_seqlens.to(q.device), [(0, BT)], 0, n_sms=n_sms)
    gate_dims = (dims.HV, dims.K) if options.gate == "channel" else (dims.HV,)
    tensors = (q.reshape(BT, dims.H_qk, dims.K), k.reshape(BT, dims.H_qk, dims.K), v.reshape(BT, dims.HV, dims.V),
               g.reshape(BT, *gate_dims), beta.reshape(BT, dims.HV), initial_state, ctx, options,
               float(dims.K**-0.5 if scale is None else scale), dims.N if output_final_state else 0)
    if states_every is not None:
        o, final_state, h = apply_gdn_states(*tensors, gate, states_every)
    else:
        o, final_state = apply_gdn(*tensors, None, gate)
    if not output_final_state:
        final_state = None
    elif state_v_first:
        final_state = states_v_first(final_state).contiguous()  # FLA's layout, as FLA returns it
    o = o.view(dims.B, dims.T, dims.HV, dims.V)
    if states_every is None:
        return o, final_state
    return o, final_state, chunk_states(h, None if cu_seqlens is None else 1, dims, states_every, state_v_first)


def chunk_states(h: torch.Tensor, rows: int | None, dims, chunk_size: int, state_v_first: bool) -> torch.Tensor:
    """The ops' states at chunk starts (``[n, HV, K, V]``, the real ones
    first) in FLA's layout of ``return_intermediate_states`` (V and K swapped
    with ``state_v_first``).

    Without ``cu_seqlens`` (``rows`` None) the B rows are documents of T
    tokens, each of ``NT = ceil(T / chunk_size)`` chunks: FLA's
    ``[B, NT, HV, K, V]`` exactly. With ``cu_seqlens`` it is
    ``[1, n, HV, K, V]``, n the call's capped context's chunk cap times
    ``64 / chunk_size`` (the same for every packing of a fixed-length
    ``cu_seqlens``, so one graph serves them): the first
    ``sum(ceil(len_i / chunk_size))`` rows are FLA's, document after document,
    the rest zeros."""
    if rows is None:
        n_chunks = -(-dims.T // chunk_size)
        h = h[:dims.B * n_chunks].view(dims.B, n_chunks, *h.shape[1:])
    else:
        h = h.view(rows, h.shape[0] // rows, *h.shape[1:])
    return states_v_first(h).contiguous() if state_v_first else h

"""``gdn_kcp::fwd`` and ``gdn_kcp::bwd``: opaque torch.library custom ops.

Each takes the workspace as a mutated argument (uint8, at least the call's
figure), the context as its two int32 index tables plus ``meta`` ints
(:attr:`KcpContext.meta`), the process group by name, and the options as a
string. The kernels run the host path: over the torch programs on the CPU, over the
Triton programs on CUDA (:mod:`gdn_kcp.host.programs`). Every tensor must be
contiguous (the programs address rows as ``(t * H + h) * D``); the autograd
layer makes them so. Fake kernels live in :mod:`gdn_kcp.fake`.

:func:`forward_body` and :func:`backward_body` are the ops' bodies; under
``torch.compile`` the autograd layer calls them directly with
``workspace=None`` (each pool its own ``torch.empty``, :class:`Pools`), so
Dynamo traces the host path and Inductor sees every program and pool.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from gdn_kcp.context import context_from_meta
from gdn_kcp.host import Buffers, Call, host_backward, host_forward
from gdn_kcp.options import kept_tape_options, options_from_str, overlaps_b2, save_plan
from gdn_kcp.queries.layout import (CallLayout, gdn_workspace_layout_kcp, kernel_saved_layout,
                                    tapes_fit_before_backward)
from gdn_kcp.dtypes import compute_dtype
from gdn_kcp.queries.shapes import SAVED_NAMES, TAPES
from gdn_kcp.workspace import Arena, Pools

DEVICES = ("cpu", "cuda")


def check_contiguous(**tensors: Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tuple(tensor.stride())}")


def call_layouts(meta: tuple, H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype, options: str,
                 which: str) -> tuple[dict, CallLayout]:
    """The saved layout and the ``which`` call's layout."""
    ctx = context_from_meta(list(meta), None, None, "")
    opts = options_from_str(options)
    return (kernel_saved_layout(ctx, H_qk, HV, K, V, dtype=dtype, options=opts),
            getattr(gdn_workspace_layout_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=opts), which))


@torch.compiler.assume_constant_result
def traced_layouts(meta: tuple, H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype, options: str,
                   which: str) -> tuple[tuple, tuple]:
    """:func:`call_layouts` as constants of a traced graph: ``(name, shape,
    dtype)`` of every saved tensor and every pool (Dynamo calls the queries
    instead of tracing their Python, and takes tuples of plain values)."""
    saved, layout = call_layouts(meta, H_qk, HV, K, V, dtype, options, which)
    return (tuple((name, tuple(spec.shape), spec.dtype) for name, spec in saved.items()),
            tuple((name, tuple(spec.shape), spec.dtype) for name, spec in layout.pools.items()))


class TensorSpec(NamedTuple):
    """A pool or saved tensor of a traced call: what :class:`Pools` and
    :class:`Buffers` read of a spec."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def op_call(q: Tensor, v: Tensor, chunk_table, frag_table, meta, group_name, options, scale,
            gate_params: Tensor | None, beta_sigmoid: bool, beta_scale: float, **flags) -> Call:
    """The :class:`Call` an op's arguments describe (``flags``: ``as_ops``, ``tapes_ready``)."""
    ctx = context_from_meta(list(meta), chunk_table, frag_table, group_name)
    return Call(ctx, options_from_str(options), ctx.index, v.shape[1], q.shape[2], v.shape[2], scale,
                gate_params=gate_params, beta_sigmoid=beta_sigmoid, beta_scale=beta_scale, **flags)


def forward_returns(q: Tensor, call: Call, o: Tensor, final_state: Tensor | None, buffers: Buffers) -> tuple:
    """What :func:`fwd` returns: o, the final states (empty when not asked)
    and one tensor per name of ``SAVED_NAMES`` (empty where none was saved)."""
    cdt = compute_dtype(q.dtype)
    if final_state is None:
        final_state = q.new_empty(0, call.HV, call.K, call.V, dtype=cdt)
    return (o, final_state, *(buffers.saved.get(name, q.new_empty(0, dtype=cdt)) for name in SAVED_NAMES))


def op_setup(q: Tensor, v: Tensor, workspace: Tensor | None, chunk_table, frag_table, meta, group_name, options,
             scale, which: str, gate_params: Tensor | None, beta_sigmoid: bool, beta_scale: float,
             tapes_ready: bool = False) -> tuple[Call, dict, Buffers]:
    """The call, its saved layout and its buffers (the ``which`` call's arena
    over ``workspace``; with None, :class:`Pools`), rebuilt from the op's arguments."""
    call = op_call(q, v, chunk_table, frag_table, meta, group_name, options, scale, gate_params, beta_sigmoid,
                   beta_scale, as_ops=workspace is None, tapes_ready=tapes_ready)
    dims = (tuple(meta), q.shape[1], call.HV, call.K, call.V, q.dtype, options, which)
    if workspace is None:
        saved, pools = traced_layouts(*dims)
        saved_layout = {name: TensorSpec(shape, dtype) for name, shape, dtype in saved}
        arena = Pools(which, {name: TensorSpec(shape, dtype) for name, shape, dtype in pools}, q.device,
                      graph=call.options.graph == "replay")
    else:
        saved_layout, layout = call_layouts(*dims)
        arena = Arena(workspace, layout, graph=call.options.graph == "replay")
    return call, saved_layout, Buffers(arena, saved_layout, q.device, saving=which == "fwd")


@torch.library.custom_op("gdn_kcp::fwd", mutates_args=("workspace",), device_types=DEVICES)
def fwd(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor], workspace: Tensor,
    chunk_table: Tensor, frag_table: Tensor, meta: list[int], group_name: str, options: str, scale: float,
    n_final_states: int, gate_params: Optional[Tensor], beta_sigmoid: bool, beta_scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One rank's forward. q, k ``[T, H_qk, K]``; v ``[T, HV, V]``; g, beta
    ``[T, HV]``; initial_state ``[N, HV, K, V]`` or None; gate_params ``[2, HV]``
    (compute dtype: ``-exp(A_log)``, ``dt_bias``; g is then the raw gate input)
    or None; beta_sigmoid / beta_scale: beta is ``beta_scale * sigmoid(beta)``
    (or ``beta_scale * beta``) inside the programs. Returns o
    ``[T, HV, V]``, the final states ``[n_final_states, HV, K, V]`` and one
    tensor per name of ``SAVED_NAMES`` (empty when the options keep none)."""
    return forward_body(q, k, v, g, beta, initial_state, workspace, chunk_table, frag_table, meta, group_name,
                        options, scale, n_final_states, gate_params, beta_sigmoid, beta_scale)


def forward_body(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
    workspace: Tensor | None, chunk_table: Tensor, frag_table: Tensor, meta: list[int], group_name: str,
    options: str, scale: float, n_final_states: int, gate_params: Tensor | None, beta_sigmoid: bool,
    beta_scale: float,
) -> tuple[Tensor, ...]:
    """:func:`fwd`'s body; ``workspace`` None: each pool its own tensor."""
    check_contiguous(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    call, saved_layout, buffers = op_setup(q, v, workspace, chunk_table, frag_table, meta, group_name, options,
                                           scale, "fwd", gate_params, beta_sigmoid, beta_scale)
    o, final_state = host_forward(
        q, k, v, g, beta, call, buffers, initial_state=initial_state, n_final_states=n_final_states or None
    )
    if set(buffers.saved) != set(saved_layout):
        raise RuntimeError(f"the forward saved {sorted(buffers.saved)}, its layout names {sorted(saved_layout)}")
    return forward_returns(q, call, o, final_state, buffers)


@torch.library.custom_op("gdn_kcp::bwd", mutates_args=("workspace",), device_types=DEVICES)
def bwd(
    do: Tensor, d_final_state: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Optional[Tensor], saved: list[Tensor], workspace: Tensor, chunk_table: Tensor,
    frag_table: Tensor, meta: list[int], group_name: str, options: str, scale: float, needs_d_initial: bool,
    gate_params: Optional[Tensor], beta_sigmoid: bool, beta_scale: float, tapes_ready: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One rank's backward: ``(dq, dk, dv, dg, dbeta, d_initial_state,
    d_gate_params)``; d_initial_state is empty unless ``needs_d_initial``,
    d_gate_params ``[2, HV]`` empty without gate_params (dg and dbeta are then
    the gradients of the raw inputs). ``saved`` is what :func:`fwd` returned
    after o and the final states, in ``SAVED_NAMES`` order. ``tapes_ready``:
    ``workspace`` already holds the tapes in their pools (:func:`recompute`
    wrote them): the backward launches neither prep nor the tape walk."""
    return backward_body(do, d_final_state, q, k, v, g, beta, initial_state, saved, workspace, chunk_table,
                         frag_table, meta, group_name, options, scale, needs_d_initial, gate_params, beta_sigmoid,
                         beta_scale, tapes_ready)


def backward_body(
    do: Tensor, d_final_state: Tensor | None, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    initial_state: Tensor | None, saved: list[Tensor], workspace: Tensor | None, chunk_table: Tensor,
    frag_table: Tensor, meta: list[int], group_name: str, options: str, scale: float, needs_d_initial: bool,
    gate_params: Tensor | None, beta_sigmoid: bool, beta_scale: float, tapes_ready: bool = False,
) -> tuple[Tensor, ...]:
    """:func:`bwd`'s body; ``workspace`` None: each pool its own tensor."""
    check_contiguous(do=do, d_final_state=d_final_state, q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    if tapes_ready and workspace is None:
        raise ValueError("tapes_ready=True reads the tapes from the workspace's pools: pass that workspace")
    call, saved_layout, buffers = op_setup(q, v, workspace, chunk_table, frag_table, meta, group_name, options,
                                           scale, "bwd", gate_params, beta_sigmoid, beta_scale, tapes_ready)
    kept = {name: tensor for name, tensor in zip(SAVED_NAMES, saved) if name in saved_layout}
    grads = host_backward(
        q, k, v, g, beta, do, call, buffers, kept,
        initial_state=initial_state, d_final_state=d_final_state,
        n_initial_states=initial_state.shape[0] if initial_state is not None and needs_d_initial else None,
    )
    d_initial = grads.d_initial_state
    if d_initial is None:
        d_initial = q.new_empty(0, dtype=compute_dtype(q.dtype))
    else:
        d_initial = d_initial.to(initial_state.dtype)
    d_gate = grads.d_gate_params if grads.d_gate_params is not None else q.new_empty(0, dtype=compute_dtype(q.dtype))
    return grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, d_initial, d_gate


@torch.library.custom_op("gdn_kcp::recompute", mutates_args=("tapes_into",), device_types=DEVICES)
def recompute(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor], chunk_table: Tensor,
    frag_table: Tensor, meta: list[int], group_name: str, options: str, scale: float, n_final_states: int,
    gate_params: Optional[Tensor], beta_sigmoid: bool, beta_scale: float, keep_tapes: bool, skip_output: bool,
    tapes_into: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """torch's recompute of a checkpointed call, eager (:mod:`gdn_kcp.checkpointing`):
    :func:`fwd` with the host path's ``keep_tapes`` / ``skip_output``, each
    pool its own tensor (the call's pools and, with ``keep_tapes``, those of a
    ``save_mode="full"`` forward). Returns o (with ``skip_output`` one element
    read at every index: torch discards it), the final states and one tensor
    per name of ``SAVED_NAMES``: what the call's options save and, with
    ``keep_tapes``, what :func:`gdn_kcp.options.kept_tape_options` saves
    (:func:`saved_names` splits them). With ``tapes_into`` (the workspace of
    the call's backward, uint8) the tapes go into their pools there instead,
    where :func:`bwd` with ``tapes_ready`` binds them (none is returned)."""
    check_contiguous(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    call = op_call(q, v, chunk_table, frag_table, meta, group_name, options, scale, gate_params, beta_sigmoid,
                   beta_scale)
    opts = call.options
    dims = (tuple(meta), q.shape[1], call.HV, call.K, call.V, q.dtype)
    saved_layout, layout = call_layouts(*dims, options, "fwd")
    pools, kept_layout, into = dict(layout.pools), {}, {}
    if keep_tapes:
        kept_layout, kept_fwd = call_layouts(*dims, kept_tape_options(opts).op_arg, "fwd")
        pools.update(kept_fwd.pools)
    if keep_tapes and tapes_into is not None:
        backward = Arena(tapes_into, call_layouts(*dims, options, "bwd")[1], graph=opts.graph == "replay",
                         recorded=False)
        into = {name: backward.bind(name) for name in TAPES if name in backward.pools}
        kept_layout = {}
    buffers = Buffers(Pools("fwd", pools, q.device), {**kept_layout, **saved_layout}, q.device, saving=True,
                      into=into)
    o, final_state = host_forward(q, k, v, g, beta, call, buffers, initial_state=initial_state,
                                  n_final_states=n_final_states or None, keep_tapes=keep_tapes,
                                  skip_output=skip_output)
    if o is None:  # one zero read at every index: torch discards it (not left uninitialised, so every run agrees)
        o = q.new_zeros(1).expand(q.shape[0], call.HV, call.V)
    return forward_returns(q, call, o, final_state, buffers)


@recompute.register_fake
def _recompute_fake(q, k, v, g, beta, initial_state, chunk_table, frag_table, meta, group_name, options, scale,
                    n_final_states, gate_params, beta_sigmoid, beta_scale, keep_tapes, skip_output, tapes_into):
    ctx, opts = context_from_meta(list(meta), chunk_table, frag_table, ""), options_from_str(options)
    dims = (ctx, q.shape[1], v.shape[1], q.shape[2], v.shape[2])  # as _fwd_fake reads them (SymInts traced)
    layout = kernel_saved_layout(*dims, dtype=q.dtype, options=opts)
    if keep_tapes and tapes_into is None:
        layout.update(kernel_saved_layout(*dims, dtype=q.dtype, options=kept_tape_options(opts)))
    cdt = compute_dtype(q.dtype)
    o = q.new_zeros(1).expand(q.shape[0], v.shape[1], v.shape[2]) if skip_output else torch.empty_like(
        v, dtype=q.dtype)
    return (o, q.new_empty(n_final_states, v.shape[1], q.shape[2], v.shape[2], dtype=cdt),
            *(q.new_empty(layout[name].shape, dtype=layout[name].dtype) if name in layout
              else q.new_empty(0, dtype=cdt) for name in SAVED_NAMES))


def tapes_into_workspace(meta: tuple, H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype, options: str) -> bool:
    """Whether a checkpoint's recompute may write the tapes into the pools of
    the call's backward workspace (:func:`recompute`'s ``tapes_into``): the
    layout lets them be written first (:func:`tapes_fit_before_backward`), and
    on several ranks the backward neither replays the boundary exchange nor
    overlaps b2, so that every rank, whichever form it takes, runs the same
    collectives (the kept tensors' backward, ``save_mode="full"``'s, replays no c1/c2)."""
    opts = options_from_str(options)
    if meta[0] > 1 and (save_plan(opts).replays_boundary or overlaps_b2(opts)):
        return False
    return tapes_fit_before_backward(call_layouts(meta, H_qk, HV, K, V, dtype, options, "bwd")[1])


def saved_names(meta: tuple, H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype, options: str) -> frozenset:
    """The names of ``SAVED_NAMES`` the ``options`` save (the rest come back empty)."""
    return frozenset(call_layouts(meta, H_qk, HV, K, V, dtype, options, "fwd")[0])

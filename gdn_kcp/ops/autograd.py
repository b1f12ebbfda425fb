"""The autograd layer over ``gdn_kcp::fwd`` / ``gdn_kcp::bwd``.

By default (eager and compiled) it allocates each call's workspace with
``torch.empty`` of the queried bytes, unless the caller holds a
:class:`WorkspaceKcp`, and saves exactly what the forward op returns for the
backward. Inside :func:`trace_host_path` (no held workspace) it runs the ops' bodies instead of the opaque ops: each
pool is its own ``torch.empty`` and every program its own op
(:mod:`gdn_kcp.ops.programs`); under ``torch.compile`` Dynamo traces that
host path and Inductor plans and fuses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch

from gdn_kcp.context import KcpContext, context_from_meta
from gdn_kcp.gates import InKernelGate
from gdn_kcp.host.programs import load_programs
from gdn_kcp.kernels.chunk_index import CHUNK_SIZE
from gdn_kcp.checkpointing import Probe, hand_over, probe
from gdn_kcp.options import OptionsKcp, kept_tape_options, options_from_str
from gdn_kcp.queries.layout import gdn_workspace_bytes_kcp
from gdn_kcp.dtypes import compute_dtype
from gdn_kcp.exchange.ordered import ORDERED
from gdn_kcp.workspace import WorkspaceKcp

from gdn_kcp.queries.shapes import SAVED_NAMES

from .boundary import forward_boundary, lower_boundaries_away, replay_boundary
from .chunk_states import sub_chunk_states
from .library import backward_body, forward_body, saved_names, tapes_into_workspace  # importing registers the ops


@torch.compiler.assume_constant_result
def workspace_nbytes(meta: tuple, H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype, options: str,
                     call: str) -> int:
    """``gdn_workspace_bytes_kcp(..., call=call)`` from what the ops take: a
    constant of the traced graph."""
    ctx = context_from_meta(list(meta), None, None, "")
    return gdn_workspace_bytes_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=options_from_str(options), call=call)


def check_workspace(workspace: object, ctx: KcpContext, H_qk: int, HV: int, K: int, V: int, dtype: torch.dtype,
                    options: OptionsKcp) -> None:
    if workspace is None:
        return
    if not isinstance(workspace, WorkspaceKcp):
        raise TypeError(f"workspace must be a WorkspaceKcp or None, got {type(workspace).__name__}")
    wanted = (ctx.layout_key, H_qk, HV, K, V, dtype, options.op_arg)
    held = (*workspace.key[:-1], workspace.key[-1].op_arg)  # the recompute options change no byte: not compared
    if held != wanted:
        names = ("ctx.layout_key", "H_qk", "HV", "K", "V", "dtype", "options")
        diffs = [f"{n}: {a!r} vs {b!r}" for n, a, b in zip(names, held, wanted) if a != b]
        raise ValueError(f"workspace was made for another call ({'; '.join(diffs)})")


def call_workspace(workspace, meta: tuple, q, v, options: str, which: str):
    """The caller's workspace, or one of the ``which`` call's queried bytes."""
    if workspace is not None:
        return workspace
    nbytes = workspace_nbytes(meta, q.shape[1], v.shape[1], q.shape[2], v.shape[2], q.dtype, options, which)
    return torch.empty(nbytes, dtype=torch.uint8, device=q.device)


TRACE_HOST_PATH = False
"""Set by :func:`trace_host_path`; read when Dynamo traces a call."""


@contextlib.contextmanager
def trace_host_path(enabled: bool = True) -> Iterator[None]:
    """Within the block, ``torch.compile`` traces the host path of the calls it
    compiles (no held workspace; one rank or KCP, either exchange) instead of keeping the opaque ops: every program (its
    ``gdn_kcp::<program>`` op) and pool is in the graph, for Inductor to plan
    and fuse. Eager calls in the block run the same decomposition (a pool per
    buffer, an op per program), so a FakeTensor ``MemTracker`` trace sees
    the traced path's memory.
    Off by default: on the CPU, Inductor generates C++ for every program
    (about 75 s to compile a forward and backward at T = 70 on 2 cores,
    against seconds for the opaque ops). Dynamo guards the switch: calls
    inside the block run the traced graph (its backward traced with it), a
    call outside compiles or reuses the opaque one.

    A compiled forward in the block hands its backward the inputs, the index
    tables and the saved layout (``gdn_saved_layout_kcp``), no more: the saved
    set and the backward's reads pass through opaque boundaries
    (:mod:`gdn_kcp.ops.boundary`), and AOT autograd's joint-graph CSE is off
    for the graphs compiled in the block (``torch._functorch.config.cse``),
    since it merges the backward's constants (zeros, masks) with the
    forward's and the partitioner then keeps them. The rest of a model
    compiled in the block loses that CSE pass too; Inductor's own fusion and
    its kernels' CSE are unaffected.

    Example::

        with gdn_kcp.trace_host_path():
            o, _ = torch.compile(chunk_gated_delta_rule, fullgraph=True)(q, k, v, g, beta, cu_seqlens=cu)
    """
    global TRACE_HOST_PATH
    for device_type in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
        load_programs(device_type)  # Dynamo cannot trace an import
    lower_boundaries_away()
    previous, TRACE_HOST_PATH = TRACE_HOST_PATH, bool(enabled)
    try:
        with joint_cse_off() if enabled else contextlib.nullcontext():
            yield
    finally:
        TRACE_HOST_PATH = previous


def joint_cse_off() -> contextlib.AbstractContextManager:
    """AOT autograd's joint-graph CSE off (read when a graph is partitioned,
    which happens when it compiles). With it on, the light backward's own
    zeros and masks (``aten.full``, ``iota`` chains: no input, so equal to the
    forward's) are merged into the forward's, and Inductor's partitioner keeps
    the merged ones as activations because the backward materialises them:
    353,280 B at the shape of :mod:`gdn_kcp.ops.boundary`, A's zeroed blocks
    the largest (327,680), where the saved layout says 0."""
    import torch._functorch.config as functorch_config

    return functorch_config.patch(cse=False)


def traces_host_path(meta: tuple, workspace) -> bool:
    """True when the call runs the ops' bodies over the per-program ops
    (:mod:`gdn_kcp.ops.programs`) with a pool per buffer: inside
    :func:`trace_host_path` (compiled, where Dynamo traces the host path, or
    eager, e.g. a MemTracker trace of it), with no caller-held workspace
    (whose bytes the opaque op carves), on one rank or over KCP ranks when
    the exchanges are ordered effects (each all-to-all a
    ``gdn_kcp::all_to_all``, each hop of the ring a ``gdn_kcp::send_recv``:
    :mod:`gdn_kcp.exchange.ordered`)."""
    return TRACE_HOST_PATH and workspace is None and (meta[0] == 1 or ORDERED)


class GdnFunction(torch.autograd.Function):
    """Forward and backward ops; the backward is explicit (no autograd through
    the forward)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, workspace, chunk_table, frag_table, meta: tuple,
                group_name: str, options: str, scale: float, n_final_states: int, gate_params, beta_mode: tuple,
                checkpoint: Probe | None):
        args = (q, k, v, g, beta, initial_state)
        tables = (chunk_table, frag_table, list(meta), group_name, options, scale, n_final_states, gate_params)
        if checkpoint is not None and (checkpoint.keep_tapes or checkpoint.skip_output):
            # the region's last saver keeps its tapes in the pools of its backward's workspace, allocated now
            into = None
            if checkpoint.tapes_in_workspace:
                if tapes_into_workspace(meta, q.shape[1], v.shape[1], q.shape[2], v.shape[2], q.dtype, options):
                    into = call_workspace(checkpoint.node.workspace, meta, q, v, options, "bwd")
                else:
                    checkpoint.record.tapes_in_workspace = False
                    checkpoint.record.reasons.append(
                        "the tapes are kept as tensors: the backward's pools before them share their bytes, or "
                        "its exchanges would differ across ranks")
            o, final_state, *both = torch.ops.gdn_kcp.recompute(*args, *tables, *beta_mode, checkpoint.keep_tapes,
                                                                checkpoint.skip_output, into)
            saved = split_saved(both, meta, q, v, options)
            if into is not None:
                hand_over(checkpoint.node, ("workspace", into))
            elif checkpoint.keep_tapes:
                kept = split_saved(both, meta, q, v, kept_tape_options(options_from_str(options)).op_arg)
                hand_over(checkpoint.node, ("tapes", kept))
                checkpoint.record.kept_bytes = sum(x.nbytes for x in kept if not any(x is y for y in saved))
        elif traces_host_path(meta, workspace):
            o, final_state, *saved = forward_body(*args, None, *tables, *beta_mode)
            if torch.compiler.is_compiling() and any(ctx.needs_input_grad):  # o, the final states and the saved
                # layout as one node (ops.boundary); an export or a no-grad graph has no backward to hand them to
                o, final_state, *saved = forward_boundary([o, final_state, *saved])
        else:
            o, final_state, *saved = torch.ops.gdn_kcp.fwd(
                *args, call_workspace(workspace, meta, q, v, options, "fwd"), *tables, *beta_mode)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, gate_params, chunk_table, frag_table, *saved)
        ctx.args = (meta, group_name, options, scale, n_final_states, beta_mode)
        ctx.workspace = workspace
        ctx.kept_tapes = None
        if checkpoint is not None:
            checkpoint.register(ctx)
        ctx.mark_non_differentiable(*([] if n_final_states else [final_state]))
        return o, final_state

    @staticmethod
    def backward(ctx, do, d_final_state):
        # the unpack runs torch's recompute under a checkpoint, which may hand this node its tapes
        q, k, v, g, beta, initial_state, gate_params, chunk_table, frag_table, *saved = ctx.saved_tensors
        meta, group_name, options, scale, n_final_states, beta_mode = ctx.args
        workspace, tapes_ready = ctx.workspace, False
        kind, kept = ctx.kept_tapes or (None, None)
        ctx.kept_tapes = None
        if kind == "workspace":  # the tapes in their pools: bind them there, launch neither prep nor the walk
            workspace, tapes_ready = kept, True
        elif kind == "tapes":  # the tapes as tensors: the backward of save_mode="full"
            saved = list(kept)
            options = kept_tape_options(options_from_str(options)).op_arg
            if workspace is not None and workspace.numel() < workspace_nbytes(
                    meta, q.shape[1], v.shape[1], q.shape[2], v.shape[2], q.dtype, options, "bwd"):
                workspace = None
        needs_d_initial = initial_state is not None and ctx.needs_input_grad[5]
        do, d_final_state = do.contiguous(), d_final_state.contiguous() if n_final_states else None
        traced = traces_host_path(meta, workspace)
        if traced and torch.compiler.is_compiling():  # replay from the gradients on, never the forward's nodes
            after = [x for x in (do, d_final_state) if x is not None]  # (ops.boundary)
            q, k, v, g, beta, initial_state, gate_params, chunk_table, frag_table, *saved = through_boundary(
                [q, k, v, g, beta, initial_state, gate_params, chunk_table, frag_table, *saved], after)
        tables = (chunk_table, frag_table, list(meta), group_name, options, scale, needs_d_initial, gate_params,
                  *beta_mode)
        if traced:
            dq, dk, dv, dg, dbeta, d_initial, d_gate = backward_body(
                do, d_final_state, q, k, v, g, beta, initial_state, saved, None, *tables)
        else:
            dq, dk, dv, dg, dbeta, d_initial, d_gate = torch.ops.gdn_kcp.bwd(
                do, d_final_state, q, k, v, g, beta, initial_state, saved,
                call_workspace(workspace, meta, q, v, options, "bwd"), *tables, tapes_ready)
        return (dq, dk, dv, dg, dbeta, d_initial if needs_d_initial else None,
                None, None, None, None, None, None, None, None, d_gate if gate_params is not None else None, None,
                None)


def through_boundary(tensors: list, after: list) -> list:
    """``tensors`` through ``gdn_kcp::replay_boundary`` (one op over those
    that are not None), None left as it is."""
    picked = [i for i, x in enumerate(tensors) if x is not None]
    out = list(tensors)
    for i, x in zip(picked, replay_boundary([tensors[i] for i in picked], after)):
        out[i] = x
    return out


def split_saved(tensors: list, meta: tuple, q, v, options: str) -> list:
    """Of the ``SAVED_NAMES`` tensors ``gdn_kcp::recompute`` returns, those ``options`` save (the rest empty)."""
    names = saved_names(meta, q.shape[1], v.shape[1], q.shape[2], v.shape[2], q.dtype, options)
    empty = q.new_empty(0, dtype=compute_dtype(q.dtype))  # as gdn_kcp::fwd returns a name it does not save
    return [x if name in names else empty for name, x in zip(SAVED_NAMES, tensors)]


def checkpoint_probe(inputs: tuple, saved_inputs: tuple, options: OptionsKcp) -> Probe | None:
    """The probe of :mod:`gdn_kcp.checkpointing` for an eager call (None when
    traced: no frame, no record). ``saved_inputs``: what
    :meth:`GdnFunction.forward` saves before the ``SAVED_NAMES`` tensors."""
    if torch.compiler.is_compiling():
        return None
    return probe(inputs, sum(x is not None for x in saved_inputs) + len(SAVED_NAMES), options)


MAX_K_TRITON, MAX_V_TRITON = 256, 512
"""The head dims the Triton programs are checked at: FLA's layer defaults
(head_dim 256, expand_v 2). Every program tiles V (value tiles of 8 to 128)
and walks hold the state as two ``[K / 2, BV]`` halves; at K = 256 the
backward's walks spill up to 508 B per thread (sm_90, triton 3.9, compiled as
a launch specialises the head dims; README's table; up to 344 under 3.6)."""


def check_triton_head_dims(K: int, V: int) -> None:
    """``ValueError`` naming K and V beyond the sizes the Triton programs are checked at."""
    if K > MAX_K_TRITON or V > MAX_V_TRITON:
        raise ValueError(f"the CUDA programs take K <= {MAX_K_TRITON} and V <= {MAX_V_TRITON} (compiled and "
                         f"checked there), got K = {K}, V = {V}")


def _op_inputs(q, k, v, g, beta, initial_state, ctx: KcpContext, workspace: WorkspaceKcp | None,
               gate: InKernelGate | None):
    """What the ops take of a call: the tensors contiguous (in traced code: the
    programs address rows as ``(t * H + h) * D``), the index of ``q``'s
    device, the gate parameters in the compute dtype."""
    index = ctx.index_for(q.device)
    if index.chunk_table.device != q.device:
        raise ValueError(
            f"the context's index is on {index.chunk_table.device} but q is on {q.device}: "
            f"build the context with build_kcp_context(..., device={str(q.device)!r})"
        )
    if workspace is not None and workspace.storage.device != q.device:
        raise ValueError(f"workspace is on {workspace.storage.device} but q is on {q.device}")
    if q.device.type == "cuda":
        check_triton_head_dims(q.shape[2], v.shape[2])
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    gate_params = None if gate is None else gate.params(compute_dtype(q.dtype))
    return (q, k, v, g, beta, initial_state), index, gate_params


def apply_gdn(q, k, v, g, beta, initial_state, ctx: KcpContext, options: OptionsKcp, scale: float,
              n_final_states: int, workspace: WorkspaceKcp | None, gate: InKernelGate | None = None):
    """Run the ops on token-layout tensors for rank ``ctx.rank``: ``(o, final_state)``.
    ``gate``: the gate and beta computed in the programs (:mod:`gdn_kcp.gates`)."""
    (q, k, v, g, beta, initial_state), index, gate_params = _op_inputs(q, k, v, g, beta, initial_state, ctx,
                                                                       workspace, gate)
    return GdnFunction.apply(
        q, k, v, g, beta, initial_state, None if workspace is None else workspace.storage,
        index.chunk_table, index.frag_table, tuple(ctx.meta), ctx.group_name, options.op_arg, scale,
        n_final_states, gate_params, (False, 1.0) if gate is None else gate.beta_mode,
        checkpoint_probe((q, k, v, g, beta, initial_state, gate_params),
                         (q, k, v, g, beta, initial_state, gate_params, index.chunk_table, index.frag_table), options),
    )


def apply_gdn_states(q, k, v, g, beta, initial_state, ctx: KcpContext, options: OptionsKcp, scale: float,
                     n_final_states: int, gate: InKernelGate | None = None, chunk_size: int = CHUNK_SIZE):
    """Inference: :func:`apply_gdn`'s ``(o, final_state)`` and the state each
    ``chunk_size``-token chunk of every document starts from, a document's
    first chunk holding its initial state (or zeros): ``[NC * 64 /
    chunk_size, HV, K, V]`` (``NC = ctx.index.n_chunks``) in the input dtype,
    document after document, the real chunks first and zeros after
    (:func:`gdn_kcp.gdn_intermediate_states_layout_kcp` counts the rows). At
    64 tokens that is the forward op's tape ``h`` at ``save_mode="full"``
    (the op's fake returns the query's size), at 16 or 32 the chunk form cut
    inside each chunk from its tapes (:mod:`.chunk_states`). The call
    records no backward, so it is refused where a gradient could be asked of it."""
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)):
        raise ValueError("return_intermediate_states=True is an inference form (as in flash-linear-attention): "
                         "call it under torch.inference_mode() or torch.no_grad(), or with inputs that need no "
                         "gradient")
    options = replace(options, save_mode="full")
    (q, k, v, g, beta, initial_state), index, gate_params = _op_inputs(q, k, v, g, beta, initial_state, ctx, None,
                                                                       gate)
    meta, op_options = tuple(ctx.meta), options.op_arg
    o, final_state, *saved = torch.ops.gdn_kcp.fwd(
        q, k, v, g, beta, initial_state, call_workspace(None, meta, q, v, op_options, "fwd"), index.chunk_table,
        index.frag_table, list(meta), ctx.group_name, op_options, scale, n_final_states, gate_params,
        *((False, 1.0) if gate is None else gate.beta_mode))
    tapes = dict(zip(SAVED_NAMES, saved))
    real = (index.chunk_len > 0).view(-1, 1, 1, 1)  # a capped index's sentinel chunks: no state, zeros
    h = torch.where(real, tapes["h"], tapes["h"].new_zeros(()))
    if chunk_size != CHUNK_SIZE:
        h = sub_chunk_states(h, k, tapes["k_rstd"] if options.use_qk_l2norm else None, tapes["v_new"], g,
                             gate_params, index, chunk_size)
    return o, final_state, h

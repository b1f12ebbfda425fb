"""Workspace and saved-set layouts: bytes per pool, per phase and per call.

A call's figure is its largest phase: the most bytes bound at once. Pools are
placed in one arena at fixed offsets (aligned to ``ALIGN`` bytes) so that pools
bound at the same time never overlap and the arena is exactly the call's
figure; the host path binds every pool at its offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

import torch

from gdn_kcp.context import KcpContext
from gdn_kcp.dtypes import buffer_dtype, check_input_dtype, compute_dtype
from gdn_kcp.kernels.chunk_index import CHUNK_SIZE
from gdn_kcp.options import OptionsKcp

from .schedule import backward_events, forward_events
from .shapes import TAPES, Dims, conv_halo_shape, numel, pool_shapes, saved_shapes

ALIGN = 256
"""Pool offsets are multiples of 256 bytes: every pool starts on a boundary
that vector loads and the Hopper bulk-copy engine (16 B) accept."""


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype`` (no alignment)."""
    return numel(shape) * dtype.itemsize


@dataclass(frozen=True)
class PoolSpec:
    """A pool: its tensor ``shape`` / ``dtype``, its ``nbytes`` in the arena
    (the tensor's bytes rounded up to ALIGN) and its ``offset``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    offset: int


@dataclass(frozen=True)
class CallLayout:
    """One call (``"fwd"`` or ``"bwd"``): its pools, the peak bytes bound in
    each named phase, and its figure ``bytes`` (the largest phase)."""

    call: str
    pools: Mapping[str, PoolSpec]
    phases: Mapping[str, int]
    bytes: int
    graph: bool
    events: tuple[tuple[str, str], ...] = field(repr=False)

    @property
    def tensor_bytes(self) -> int:
        """The peak of the phases with each pool at its tensor's bytes (no
        alignment): what the traced host path holds when each pool is its own
        tensor (:class:`gdn_kcp.workspace.Pools`), at most :attr:`bytes`."""
        sizes = {name: tensor_nbytes(spec.shape, spec.dtype) for name, spec in self.pools.items()}
        return max(phase_peaks(self.events, sizes, self.graph).values(), default=0)


@dataclass(frozen=True)
class WorkspaceLayout:
    """Both calls; ``bytes`` is what a caller-held workspace needs (the larger
    call). ``pool_bytes`` gives each pool's bytes (the larger of its two calls)."""

    fwd: CallLayout
    bwd: CallLayout
    bytes: int

    @property
    def phases(self) -> dict[str, int]:
        return {**self.fwd.phases, **self.bwd.phases}

    @property
    def pool_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for call in (self.fwd, self.bwd):
            for name, spec in call.pools.items():
                out[name] = max(out.get(name, 0), spec.nbytes)
        return out


def phase_peaks(events, sizes: Mapping[str, int], graph: bool) -> dict[str, int]:
    """Peak bytes bound in each phase of an event list (shared by the query and
    the recording workspace). Under graph replay nothing is released, and a pool
    bound again (the replayed forward's ring_send, say) is the same bytes."""
    live, phase, bound, peaks = 0, None, {}, {}
    for kind, name in events:
        if kind == "phase":
            phase = name
            peaks[phase] = live
        elif kind == "bind":
            if name in bound:
                if graph:
                    continue
                raise RuntimeError(f"pool {name!r} bound twice")
            bound[name] = sizes[name]
            live += sizes[name]
            peaks[phase] = max(peaks[phase], live)
        elif not graph:
            live -= bound.pop(name)
    return peaks


def _lifetimes(events, graph: bool) -> dict[str, tuple[int, int]]:
    open_at, spans = {}, {}
    for i, (kind, name) in enumerate(events):
        if kind == "bind":
            open_at.setdefault(name, i)
        elif kind == "release" and not graph:
            spans[name] = (open_at.pop(name), i)
    for name, start in open_at.items():
        spans[name] = (start, len(events))
    return spans


def _overlaps(offset: int, size: int, busy: list[tuple[int, int]]) -> bool:
    return any(offset < hi and lo < offset + size for lo, hi in busy)


def _search(names, spans, sizes, target: int, budget: int) -> dict[str, int] | None:
    """Depth-first placement of ``names`` (in bind order) inside ``target``
    bytes: each pool tries the bottom, the top, and the edges of the pools it
    meets. None when no placement is found within ``budget`` tries."""
    placed: dict[str, int] = {}
    tries = [0]

    def conflicts(name):
        start, end = spans[name]
        return [(placed[o], placed[o] + sizes[o]) for o in placed if spans[o][0] < end and start < spans[o][1]]

    def place(i: int) -> bool:
        if i == len(names):
            return True
        name, size = names[i], sizes[names[i]]
        busy = conflicts(name)
        candidates = {0, target - size} | {hi for _, hi in busy} | {lo - size for lo, _ in busy}
        for offset in sorted(c for c in candidates if 0 <= c <= target - size):
            tries[0] += 1
            if tries[0] > budget:
                return False
            if not _overlaps(offset, size, busy):
                placed[name] = offset
                if place(i + 1):
                    return True
                del placed[name]
        return False

    return dict(placed) if place(0) else None


def _first_fit(names, spans, sizes) -> dict[str, int]:
    """Each pool at the lowest offset free of the pools bound with it."""
    placed: dict[str, int] = {}
    for name in names:
        start, end = spans[name]
        busy = sorted(
            (placed[o], placed[o] + sizes[o]) for o in placed if spans[o][0] < end and start < spans[o][1]
        )
        offset = 0
        for lo, hi in busy:
            if offset + sizes[name] <= lo:
                break
            offset = max(offset, hi)
        placed[name] = offset
    return placed


def place_pools(events, sizes: Mapping[str, int], graph: bool, target: int) -> dict[str, int]:
    """Offsets for every bound pool with no overlap between pools bound at the
    same time, inside ``target`` bytes (the largest phase, a lower bound) when a
    bounded search finds such a placement, else first fit in bind order."""
    spans = _lifetimes(events, graph)
    names = [n for n in spans if sizes[n] > 0]
    span = {n: spans[n][1] - spans[n][0] for n in names}
    # Big and long-lived pools constrain the most, so they go first; on the
    # backward of a middle rank this finds the tight placement within ~30
    # tries where bind order needs over a million.
    orders = [
        sorted(names, key=lambda n: (-sizes[n], spans[n][0])),
        sorted(names, key=lambda n: (-sizes[n] * span[n], spans[n][0])),
        sorted(names, key=lambda n: (-span[n], spans[n][0])),
    ]
    offsets = None
    for order in orders:
        offsets = _search(order, spans, sizes, target, budget=20_000)
        if offsets is not None:
            break
    if offsets is None:
        offsets = _first_fit(sorted(names, key=lambda n: spans[n][0]), spans, sizes)
    offsets.update({n: 0 for n in spans if sizes[n] == 0})
    return offsets


def _dtype(name: str, d: Dims) -> torch.dtype:
    """Pool or saved tensor ``name``'s dtype in a call of ``d`` (KDA's: ``options.gate == "channel"``)."""
    return buffer_dtype(name, d.dtype, channel=d.options.gate == "channel")


def _call_layout(call: str, events, d: Dims) -> CallLayout:
    shapes = pool_shapes(d)
    bound = {name for kind, name in events if kind == "bind"}
    dtypes = {name: _dtype(name, d) for name in bound}
    sizes = {name: align(tensor_nbytes(shapes[name], dtypes[name])) for name in bound}
    graph = d.options.graph == "replay"
    phases = phase_peaks(events, sizes, graph)
    figure = max(phases.values(), default=0)
    offsets = place_pools(events, sizes, graph, figure)
    extent = max((offsets[n] + sizes[n] for n in bound), default=0)
    pools = {
        name: PoolSpec(shape=shapes[name], dtype=dtypes[name], nbytes=sizes[name], offset=offsets[name])
        for name in bound
    }
    return CallLayout(
        call=call, pools=MappingProxyType(pools), phases=MappingProxyType(phases), bytes=max(figure, extent),
        graph=graph, events=tuple(events),
    )


def _dims(ctx, H_qk, HV, K, V, dtype, options) -> Dims:
    if not isinstance(ctx, KcpContext):
        raise TypeError(f"ctx must be a KcpContext, got {type(ctx).__name__}")
    for name, value in (("H_qk", H_qk), ("HV", HV), ("K", K), ("V", V)):
        # SymInts come from fake kernels traced with dynamic shapes
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if HV % H_qk:
        raise ValueError(f"HV = {HV} must be a multiple of H_qk = {H_qk}")
    if options is not None and not isinstance(options, OptionsKcp):
        raise TypeError(f"options must be an OptionsKcp or None, got {type(options).__name__}")
    return Dims(ctx, H_qk, HV, K, V, check_input_dtype(dtype), options or OptionsKcp())


_LAYOUTS: dict[tuple, WorkspaceLayout] = {}
"""Layouts already computed, keyed by the context's host facts, shapes, compute
dtype and options: pure Python values, no tensors."""


def gdn_workspace_layout_kcp(
    ctx: KcpContext,
    H_qk: int,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float32,
    options: OptionsKcp | None = None,
) -> WorkspaceLayout:
    """Bytes per pool and per phase of one forward and one backward on this rank.

    ``dtype`` is the input dtype: the pools of ``gdn_kcp.dtypes.INPUT_DTYPE_BUFFERS``
    (the tapes A, w, v_new, h; the backward's dh, dv_new, dq_heads, dk_heads,
    dw) are stored in it, every other pool in the compute dtype (fp32, or fp64
    for fp64 inputs; :func:`gdn_kcp.dtypes.buffer_dtype`). Example::

        layout = gdn_workspace_layout_kcp(ctx, 16, 48, 128, 128, dtype=torch.bfloat16)
        layout.fwd.phases["fwd.phase.walk"], layout.bwd.bytes, layout.bytes
    """
    d = _dims(ctx, H_qk, HV, K, V, dtype, options)
    key = (ctx.layout_key, H_qk, HV, K, V, d.dtype, d.options)
    layout = _LAYOUTS.get(key)
    if layout is None:
        fwd = _call_layout("fwd", forward_events(d), d)
        bwd = _call_layout("bwd", backward_events(d), d)
        layout = WorkspaceLayout(fwd=fwd, bwd=bwd, bytes=max(fwd.bytes, bwd.bytes))
        if len(_LAYOUTS) >= 1024:
            _LAYOUTS.clear()
        _LAYOUTS[key] = layout
    return layout


def gdn_workspace_bytes_kcp(
    ctx: KcpContext,
    H_qk: int,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float32,
    options: OptionsKcp | None = None,
    call: str | None = None,
) -> int:
    """Bytes of a workspace for the forward and backward (``call=None``), or for
    one of them (``call="fwd"`` / ``"bwd"``): the largest phase."""
    layout = gdn_workspace_layout_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=options)
    if call is None:
        return layout.bytes
    if call not in ("fwd", "bwd"):
        raise ValueError(f"call must be None, 'fwd' or 'bwd', got {call!r}")
    return getattr(layout, call).bytes


@dataclass(frozen=True)
class SavedSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def gdn_saved_layout_kcp(
    ctx: KcpContext,
    H_qk: int,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float32,
    options: OptionsKcp | None = None,
) -> dict[str, SavedSpec]:
    """Every tensor the forward keeps for the backward besides its inputs:
    name -> shape, dtype (:func:`gdn_kcp.dtypes.buffer_dtype`), bytes (exact,
    no alignment). With
    ``options.with_conv`` it ends with ``conv_halo`` (input dtype), which the
    layer's short convolution keeps rather than the ``gdn_kcp`` call."""
    saved = kernel_saved_layout(ctx, H_qk, HV, K, V, dtype=dtype, options=options)
    halo = conv_halo_shape(ctx, H_qk, HV, K, V, options)
    if halo is not None:
        saved["conv_halo"] = SavedSpec(shape=halo, dtype=dtype, nbytes=tensor_nbytes(halo, dtype))
    return saved


def kernel_saved_layout(ctx, H_qk, HV, K, V, *, dtype=torch.float32, options=None) -> dict[str, SavedSpec]:
    """What the ``gdn_kcp`` call itself keeps: :func:`gdn_saved_layout_kcp`
    without the layer's ``conv_halo``."""
    d = _dims(ctx, H_qk, HV, K, V, dtype, options)
    return {
        name: SavedSpec(shape=shape, dtype=dtype, nbytes=tensor_nbytes(shape, dtype))
        for name, shape in saved_shapes(d).items() for dtype in (_dtype(name, d),)
    }


def gdn_saved_bytes_kcp(
    ctx: KcpContext,
    H_qk: int,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float32,
    options: OptionsKcp | None = None,
) -> int:
    """Total bytes of :func:`gdn_saved_layout_kcp`."""
    saved = gdn_saved_layout_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=options)
    return sum(spec.nbytes for spec in saved.values())


def gdn_state_layout_kcp(
    ctx: KcpContext, HV: int, K: int, V: int, *, dtype: torch.dtype = torch.float32
) -> dict[str, SavedSpec]:
    """This rank's states in :func:`gdn_kcp`: ``"initial_state"``
    ``[ctx.n_start_docs, HV, K, V]`` (the documents that start on the rank; its
    gradient has the same shape) and ``"final_state"``
    ``[ctx.n_end_docs, HV, K, V]`` (those that end on it), both in the compute
    dtype of ``dtype`` inputs (the dtype the final states come back in)."""
    state = compute_dtype(_dims(ctx, 1, HV, K, V, dtype, None).dtype)
    shapes = {"initial_state": (ctx.n_start_docs, HV, K, V), "final_state": (ctx.n_end_docs, HV, K, V)}
    return {name: SavedSpec(shape=shape, dtype=state, nbytes=tensor_nbytes(shape, state))
            for name, shape in shapes.items()}


def gdn_intermediate_states_layout_kcp(
    ctx: KcpContext, HV: int, K: int, V: int, *, dtype: torch.dtype = torch.float32, chunk_size: int = CHUNK_SIZE
) -> SavedSpec:
    """What ``return_intermediate_states=True`` returns besides o and the final
    states: the state each chunk of ``chunk_size`` tokens (64, 32 or 16) of
    every document starts from, ``[rows, HV, K, V]`` in the tape dtype of
    ``dtype`` inputs (the input dtype; fp64 for fp64). On an exact context
    (one rank without ``cu_seqlens``) rows is the real count,
    ``sum(ceil(len_f / chunk_size))`` over its fragments; on a capped one
    (``cu_seqlens``) the chunk cap ``ctx.index.n_chunks * 64 / chunk_size``,
    the real states first. At 64 tokens this is the tape ``h`` of the
    ``save_mode="full"`` forward that call runs."""
    if type(chunk_size) is not int or chunk_size <= 0 or CHUNK_SIZE % chunk_size:
        raise ValueError(f"chunk_size must divide {CHUNK_SIZE}, got {chunk_size!r}")
    h = kernel_saved_layout(ctx, 1, HV, K, V, dtype=dtype, options=OptionsKcp(save_mode="full"))["h"]
    if ctx.capped:
        rows = ctx.index.n_chunks * (CHUNK_SIZE // chunk_size)
    elif ctx.frag_tokens is not None:
        rows = sum(-(-length // chunk_size) for length in ctx.frag_tokens)
    else:
        raise ValueError("this exact context holds no host fragment lengths (rebuilt from an op's meta): ask the "
                         "query of the context the call was made with")
    shape = (rows, *h.shape[1:])
    return SavedSpec(shape=shape, dtype=h.dtype, nbytes=tensor_nbytes(shape, h.dtype))


def _deterministic(options: OptionsKcp | None) -> OptionsKcp:
    return replace(options or OptionsKcp(), deterministic=True)


def gdn_det_workspace_layout_kcp(ctx, H_qk, HV, K, V, *, dtype=torch.float32, options=None) -> WorkspaceLayout:
    """:func:`gdn_workspace_layout_kcp` of the deterministic twin
    (``deterministic=True``). The torch programs reduce in a fixed order without
    atomics either way, so today the figures are the same."""
    return gdn_workspace_layout_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=_deterministic(options))


def gdn_det_workspace_bytes_kcp(ctx, H_qk, HV, K, V, *, dtype=torch.float32, options=None, call=None) -> int:
    """:func:`gdn_workspace_bytes_kcp` of the deterministic twin."""
    return gdn_workspace_bytes_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=_deterministic(options), call=call)


def gdn_det_saved_layout_kcp(ctx, H_qk, HV, K, V, *, dtype=torch.float32, options=None) -> dict[str, SavedSpec]:
    """:func:`gdn_saved_layout_kcp` of the deterministic twin."""
    return gdn_saved_layout_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=_deterministic(options))


def gdn_det_saved_bytes_kcp(ctx, H_qk, HV, K, V, *, dtype=torch.float32, options=None) -> int:
    """:func:`gdn_saved_bytes_kcp` of the deterministic twin."""
    return gdn_saved_bytes_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=_deterministic(options))


def tapes_fit_before_backward(layout: CallLayout) -> bool:
    """Whether a backward's tape pools can be written before the backward
    starts (a checkpoint's recompute writing them into the backward's
    workspace, :mod:`gdn_kcp.checkpointing`): no pool the backward binds
    before a tape's own bind shares that tape's bytes. The placement lets
    such pools share them (a pool released before the tape is bound), which
    it does when the backward replays the boundary exchange or overlaps b2
    (its summary, c1/c2 or b1 buffers before h)."""
    first: dict[str, int] = {}
    for i, (kind, name) in enumerate(layout.events):
        if kind == "bind":
            first.setdefault(name, i)
    pools = layout.pools
    for tape in (t for t in TAPES if t in pools):  # those the backward recomputes (inverse saves A, norms)
        lo, hi = pools[tape].offset, pools[tape].offset + pools[tape].nbytes
        for name, i in first.items():
            if name in TAPES or i >= first[tape] or not pools[name].nbytes:
                continue
            if pools[name].offset < hi and lo < pools[name].offset + pools[name].nbytes:
                return False
    return True


@dataclass(frozen=True)
class CheckpointBytes:
    """What a checkpointed call whose recompute keeps its tapes
    (``OptionsKcp.reuse_recompute_tapes``, docs/api.md "Activation checkpointing") binds.

    kept_tapes: the figure ``bwd.kept_tapes``, the bytes of the tapes the
        recompute hands the backward beyond the call's saved set (held from
        the recompute until the call's backward ends; with a later saver in
        the region, through that saver's backward too).
    backward: the layout of the backward that binds them (a ``save_mode="full"``
        backward: no prep, no tape walk); ``backward_transient`` is its figure.
    """

    kept_tapes: int
    backward: CallLayout

    @property
    def backward_transient(self) -> int:
        return self.backward.bytes


def gdn_checkpoint_bytes_kcp(
    ctx: KcpContext, H_qk: int, HV: int, K: int, V: int, *, dtype: torch.dtype = torch.float32,
    options: OptionsKcp | None = None,
) -> CheckpointBytes:
    """The bytes of a call whose checkpoint recompute keeps the tapes (:class:`CheckpointBytes`):
    ``kept_tapes`` 0 under ``save_mode="full"``, which saves them itself. Example::

        ck = gdn_checkpoint_bytes_kcp(ctx, 16, 32, 128, 128, dtype=torch.bfloat16)
        ck.kept_tapes, ck.backward_transient
    """
    from gdn_kcp.options import kept_tape_options

    options = options or OptionsKcp()
    kept = kept_tape_options(options)
    saved = kernel_saved_layout(ctx, H_qk, HV, K, V, dtype=dtype, options=options)
    tapes = kernel_saved_layout(ctx, H_qk, HV, K, V, dtype=dtype, options=kept)
    return CheckpointBytes(
        kept_tapes=sum(spec.nbytes for name, spec in tapes.items() if name not in saved),
        backward=gdn_workspace_layout_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=kept).bwd,
    )

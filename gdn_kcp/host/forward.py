"""Forward: prep (#1), [summary walk, exchange c1/c2], tape walk (#2), output (#5);
a forward that keeps no tape (save_mode light or inverse) at K <= 128 runs the
scores and the walk with the output (the tape walk and the output in one walk)
instead (:func:`gdn_kcp.options.walks_with_output`).

Every buffer comes from the call's arena (a pool named in the layout) or, when
the save plan keeps it for the backward, is a saved tensor sized by
``gdn_saved_layout_kcp``. The pool order here is what
:mod:`gdn_kcp.queries.schedule` models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_kcp.context import KcpContext
from gdn_kcp.dtypes import compute_dtype
from gdn_kcp.exchange import forward_a2a, forward_ring
from gdn_kcp.kernels import ChunkIndex
from gdn_kcp.options import OptionsKcp, save_plan, walks_with_output
from gdn_kcp.queries.layout import SavedSpec
from gdn_kcp.queries.shapes import TAPES, norm_tapes
from gdn_kcp.workspace import Arena, Pools, adopted_view

from gdn_kcp.plan import segments_for

from .programs import programs_for
from gdn_kcp.ops.programs import PROGRAM_OPS
from .segments import Segments, compose_starts, fold_summary, run_segment_summaries, state_decays


@dataclass
class ForwardTapes:
    """What the forward programs write and the backward programs read.

    A ``[T, HV, C]`` (None in a forward that keeps no tape),
    w ``[T, HV, K]``, v_new ``[T, HV, V]`` (holds u until the tape walk),
    q_rstd / k_rstd ``[T, H_qk]`` (None without the L2 norm), h ``[NC, HV, K, V]``.
    """

    A: torch.Tensor | None
    w: torch.Tensor
    v_new: torch.Tensor
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None
    h: torch.Tensor | None = None


class Buffers:
    """Hands out each named buffer of a call: a saved tensor when the saved
    layout names it, else a pool of the arena."""

    def __init__(
        self, arena: Arena, saved_layout: dict[str, SavedSpec], device: torch.device, *, saving: bool,
        into: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """``into``: tensors that named buffers are written into instead (a
        checkpoint's recompute writing the tapes into the backward's pools);
        they outlive the call, as saved tensors do."""
        self.arena, self.saved_layout, self.device, self.saving = arena, saved_layout, device, saving
        self.into = into or {}
        self.saved: dict[str, torch.Tensor] = {}
        self.after: list[torch.Tensor] = []
        """Traced: what the next exchange runs after (:meth:`follow`, :meth:`exchanged`)."""

    def follow(self, *work: torch.Tensor | None) -> None:
        """The next exchange runs after ``work`` (outputs of the local
        programs before it; None: none), as it does eagerly."""
        self.after.extend(x for x in work if x is not None)

    def exchanged(self, received: torch.Tensor) -> None:
        """An exchange returned ``received``: the next one runs after it."""
        self.after = [received]

    def keeps(self, name: str) -> bool:
        """True when the forward saves ``name`` (in the backward: when it was
        saved), or writes it into a tensor of :attr:`into`."""
        return name in self.saved_layout or name in self.into

    def new_saved(self, name: str) -> torch.Tensor:
        if not self.saving:
            raise RuntimeError(f"the backward cannot save {name!r}")
        spec = self.saved_layout[name]
        self.saved[name] = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
        return self.saved[name]

    def take(self, name: str) -> torch.Tensor:
        if name in self.into:
            return self.into[name]
        return self.new_saved(name) if self.keeps(name) else self.arena.bind(name)

    def spec(self, name: str):
        """The shape and dtype :meth:`take` would give ``name``."""
        return self.saved_layout[name] if self.keeps(name) else self.arena.pools[name]

    def adopt(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`take` on the traced path for what an exchange returned:
        ``tensor`` itself becomes the saved tensor or the pool
        (:meth:`gdn_kcp.workspace.Pools.adopt`), in ``name``'s shape."""
        if not self.keeps(name):
            return self.arena.adopt(name, tensor)
        if not self.saving:
            raise RuntimeError(f"the backward cannot save {name!r}")
        self.saved[name] = adopted_view(f"saved {name!r}", self.saved_layout[name], tensor)
        return self.saved[name]

    def drop(self, *names: str) -> None:
        self.arena.release(*(name for name in names if not self.keeps(name)))


@dataclass
class Call:
    """One call's fixed facts: the rank's context, options, chunk index, heads."""

    ctx: KcpContext
    options: OptionsKcp
    index: ChunkIndex
    HV: int
    K: int
    V: int
    scale: float
    gate_params: torch.Tensor | None = None
    beta_sigmoid: bool = False
    beta_scale: float = 1.0
    as_ops: bool = False
    """Run each program as its ``gdn_kcp::<program>`` op (the traced host
    path, :mod:`gdn_kcp.ops.programs`) rather than calling it directly."""
    tapes_ready: bool = False
    """A backward whose pools already hold the tapes (a checkpoint's recompute
    wrote them there, :mod:`gdn_kcp.checkpointing`): prep, W/U and the tape
    walk bind their pools and launch nothing."""

    @property
    def gate(self) -> dict:
        """The keyword every program that reads g takes: with ``gate_params``
        ``[2, HV]`` (``-exp(A_log)``, ``dt_bias``), g is the raw input and each
        program computes the gate as it loads it (:mod:`gdn_kcp.gates`)."""
        return {"gate_params": self.gate_params}

    @property
    def beta(self) -> dict:
        """The beta keywords of prep and the WY backward (in-kernel sigmoid, scale)."""
        return {"beta_sigmoid": self.beta_sigmoid, "beta_scale": self.beta_scale}

    @property
    def programs(self):
        """The program backend for the tensors of this call (see :mod:`.programs`),
        or the programs' ops when :attr:`as_ops`."""
        if self.as_ops:
            return PROGRAM_OPS
        return programs_for(self.index.chunk_table.device)

    @property
    def norms(self) -> tuple[str, ...]:
        return norm_tapes(self.options)

    @property
    def P(self) -> int:
        """Segments per long fragment (:func:`gdn_kcp.plan.segments_for`)."""
        return segments_for(self.ctx, self.HV, self.K, self.V, self.options.segments)


def run_prep(q, k, v, g, beta, call: Call, buffers: Buffers, *, with_A: bool) -> ForwardTapes:
    """Program #1 into tapes from ``buffers`` (h is bound later by the walk).
    Prep always writes A (its W and U launch reads it back); without
    ``with_A`` A is released as soon as prep returns."""
    take = buffers.take
    tapes = ForwardTapes(
        A=take("A"), w=take("w"), v_new=take("v_new"),
        q_rstd=take("q_rstd") if call.norms else None, k_rstd=take("k_rstd") if call.norms else None,
    )
    if not call.tapes_ready:
        call.programs.prep(
            q, k, v, g, beta, call.index,
            A_out=tapes.A, w_out=tapes.w, u_out=tapes.v_new,
            q_rstd_out=tapes.q_rstd, k_rstd_out=tapes.k_rstd, **call.gate, **call.beta,
        )
    if not with_A:
        buffers.drop("A")
        tapes.A = None
    return tapes


def run_channel_decays(q, k, g, call: Call, tapes: ForwardTapes, buffers: Buffers, *, with_q: bool,
                       q_norm: bool) -> dict[str, torch.Tensor]:
    """KDA (a gate per key channel): binds the walks' decays and forms them
    once a chunk (``channel_decays``; q's with ``with_q``, normalised with
    ``q_norm``, raw for the adjoint walk). Returns the walks' keywords (none
    for a scalar gate); the caller releases them (``arena.release(*decays)``)."""
    if call.options.gate != "channel":
        return {}
    arena = buffers.arena
    decays = dict(k_decayed=arena.bind("k_decayed"), chunk_decay=arena.bind("chunk_decay"))
    if with_q:
        decays["q_decayed"] = arena.bind("q_decayed")
    call.programs.channel_decays(
        q if with_q else None, k, g, call.index, q_rstd=tapes.q_rstd if with_q and q_norm else None,
        k_rstd=tapes.k_rstd, k_decayed_out=decays["k_decayed"], q_decayed_out=decays.get("q_decayed"),
        chunk_decay_out=decays["chunk_decay"], **call.gate,
    )
    return decays


def run_tape_walk(k, g, call: Call, tapes: ForwardTapes, buffers: Buffers, *, initial_state, s_in, final_state_out,
                  seg: Segments | None, index: ChunkIndex | None = None, decays: dict | None = None):
    """Program #2: binds h; rewrites the u in ``tapes.v_new`` as v_new. With
    segments it walks the segmented index from the carry plane (phase 3).
    ``index``: that index, when the caller passes it (fenced, see
    :class:`gdn_kcp.exchange.a2a.InFlight`); ``decays``: KDA's
    (:func:`run_channel_decays`)."""
    tapes.h = buffers.take("h")
    if call.tapes_ready:
        return
    call.programs.tape_walk(
        k, tapes.w, tapes.v_new, g, walk_index(call, seg) if index is None else index,
        k_rstd=tapes.k_rstd, initial_state=initial_state, s_in=walk_start(call, s_in),
        h_out=tapes.h, v_new_out=tapes.v_new, final_state_out=final_state_out,
        carry_in=seg.start if seg else None, **call.gate, **state_decays(decays),
    )


def walk_index(call: Call, seg: Segments | None) -> ChunkIndex:
    """The index a walk runs over: the segmented one (phase 3) with segments."""
    return seg.tables.walk if seg else call.index


def walk_start(call: Call, s_in: torch.Tensor | None) -> torch.Tensor | None:
    """The crossing-in fragment's start state as a walk reads it (its HV heads
    of what arrived, which a2a pads), or None."""
    return s_in[:, : call.HV] if s_in is not None and call.ctx.n_in else None


def o_in_u_pool(q: torch.Tensor, tapes: ForwardTapes, buffers: Buffers) -> bool:
    """Whether the walk with the output writes o over U in its pool: on the
    traced path (a pool there is a tensor of its own, handed over as the
    output: :meth:`gdn_kcp.workspace.Pools.hand_over`), when the pool has
    o's dtype. Each walk program reads a chunk's U tile before it writes o
    there, and programs own disjoint tiles, so in place is exact; Inductor
    then needs no buffer for o beside the pools (eagerly the arena's pools
    outlive the call, so o is a tensor of its own)."""
    return isinstance(buffers.arena, Pools) and not buffers.keeps("v_new") and tapes.v_new.dtype == q.dtype


def run_walk_output(q, k, g, call: Call, tapes: ForwardTapes, buffers: Buffers, *, initial_state, s_in,
                    final_state_out, seg: Segments | None, decays: dict) -> torch.Tensor:
    """The forward that keeps no tape: binds the scores, then walks the states
    and writes o in the same walk (no h, no v_new). Returns o."""
    scores = buffers.take("scores")
    call.programs.scores(q, k, g, call.index, q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd, scores_out=scores,
                         **call.gate)
    o = tapes.v_new if o_in_u_pool(q, tapes, buffers) else torch.empty_like(tapes.v_new, dtype=q.dtype)
    call.programs.walk_output(
        q, k, tapes.w, tapes.v_new, g, scores, walk_index(call, seg),
        scale=call.scale, q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd, initial_state=initial_state,
        s_in=walk_start(call, s_in), o_out=o, final_state_out=final_state_out,
        carry_in=seg.start if seg else None, **call.gate, **decays,
    )
    return o


def run_forward_exchange(k, g, call: Call, tapes: ForwardTapes, buffers: Buffers, *, initial_state,
                         phase_call: str, seg: Segments | None, decays: dict | None = None):
    """Summary walk of the crossing-out fragment (with segments: the fold of
    its segments' summaries; KDA: on ``decays``, :func:`run_channel_decays`'
    where formed), then c1/c2 (or the ring).
    Returns ``(s_in, summary, kept_m)``: the arrived start state, the summary
    still bound when a replayed backward needs its M for b1, and the owner's
    kept M slices (save_transfer)."""
    ctx, HV, K, V = call.ctx, call.HV, call.K, call.V
    buffers.arena.phase(f"{phase_call}.phase.summary")
    summary = None
    if ctx.n_out and seg is not None:
        summary = buffers.arena.bind("summary")
        fold_summary(call, seg, summary, initial_state=initial_state)
    elif ctx.n_out:
        summary = buffers.arena.bind("summary")
        call.programs.summary_walk(
            k, tapes.w, tapes.v_new, g, call.index, k_rstd=tapes.k_rstd, initial_state=initial_state,
            summary_out=summary, **call.gate, **state_decays(decays),
        )
    buffers.follow(tapes.v_new, summary)
    exchange = forward_a2a if call.options.exchange == "a2a" else forward_ring
    return exchange(ctx, buffers, summary, phase_call=phase_call, HV=HV, K=K, V=V, options=call.options)


def host_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    call: Call,
    buffers: Buffers,
    *,
    initial_state: torch.Tensor | None = None,
    n_final_states: int | None = None,
    keep_tapes: bool = False,
    skip_output: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Forward on token-layout tensors (q, k ``[T, H_qk, K]``, v ``[T, HV, V]``,
    g, beta ``[T, HV]``). Returns o ``[T, HV, V]`` (q's dtype) and the final
    states ``[n_final_states, HV, K, V]`` (compute dtype) when asked; the saved
    tensors are left in ``buffers.saved``.

    torch's recompute under a checkpoint (:mod:`gdn_kcp.checkpointing`):
    ``keep_tapes`` also writes the tapes a ``save_mode="full"`` forward keeps
    (``buffers``' saved layout names them): the o path the options choose,
    then the tape walk where that path has none. ``skip_output`` launches no
    output program and returns o None: with ``keep_tapes`` the tape walk
    alone, without it no walk at all (what the saves need, prep and the
    exchanges, still runs, so every rank's exchanges match; no program at
    all when the saves need none)."""
    keeps_tapes = save_plan(call.options).keeps_tapes or keep_tapes
    fused = walks_with_output(call.options, call.K) and not skip_output
    tape_walk = keeps_tapes or not (fused or skip_output)
    arena = buffers.arena
    final_state = None
    if n_final_states is not None:
        final_state = torch.zeros(n_final_states, call.HV, call.K, call.V, dtype=compute_dtype(q.dtype),
                                  device=q.device)
    if skip_output and not (keep_tapes or call.ctx.exchanges or any(map(buffers.keeps, TAPES))):
        arena.close()  # nothing to save that a program writes: the recompute launches none
        return None, final_state
    arena.phase("fwd.phase.prep")
    tapes = run_prep(q, k, v, g, beta, call, buffers, with_A=keeps_tapes)
    walks = fused or tape_walk
    # KDA: the decays before the first program that walks chunks (the segments' summaries or the walk)
    decays = run_channel_decays(q, k, g, call, tapes, buffers, with_q=fused, q_norm=True) if walks else {}
    seg = run_segment_summaries(k, g, call, tapes, buffers, phase_call="fwd", decays=decays)
    s_in = None
    if call.ctx.exchanges:
        s_in, _, _ = run_forward_exchange(k, g, call, tapes, buffers, initial_state=initial_state,
                                          phase_call="fwd", seg=seg, decays=decays)
    if seg is not None and walks:
        compose_starts(call, seg, buffers, phase_call="fwd", initial_state=initial_state, s_in=s_in,
                       final_state_out=final_state)
    elif seg is not None:
        arena.release("seg_summary")
    arena.phase("fwd.phase.walk")
    walk = dict(initial_state=initial_state, s_in=s_in, seg=seg, decays=decays)
    o = None
    if fused:
        o = run_walk_output(q, k, g, call, tapes, buffers, final_state_out=final_state, **walk)
    if tape_walk:
        run_tape_walk(k, g, call, tapes, buffers, final_state_out=None if fused else final_state, **walk)
    arena.release(*decays)
    if s_in is not None:
        buffers.drop("s_in")
    if seg is not None:
        arena.release(*(("seg_start", "seg_index") if walks else ("seg_index",)))
    buffers.drop("w")
    arena.phase("fwd.phase.output")
    if not (fused or skip_output):
        o = torch.empty_like(v, dtype=q.dtype)
        call.programs.output(
            q, k, g, tapes.h, tapes.v_new, call.index,
            scale=call.scale, q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd, o_out=o, **call.gate,
        )
    if o is tapes.v_new:  # the traced walk wrote o over U (o_in_u_pool)
        buffers.arena.hand_over("v_new")
    else:
        buffers.drop("v_new")
    buffers.drop(*(["scores"] if fused else []), *(["h"] if tape_walk else []), *call.norms)
    arena.close()
    return o, final_state

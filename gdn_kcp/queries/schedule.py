"""The modelled pool schedule of one forward and one backward: which pool each
call binds and releases, in order, at which named phase.

This is the query's model of the host path (``gdn_kcp/host``); the arena tests
run the real host path under a recording workspace and require the two to give
the same bytes at every phase, call and pool, at tolerance 0.
"""

from __future__ import annotations

from gdn_kcp.options import overlaps_b2, save_plan, walks_with_output

from .shapes import Dims, norm_tapes, pooled


class Events(list):
    """``("phase" | "bind" | "release", name)`` in call order."""

    def phase(self, name: str) -> None:
        self.append(("phase", name))

    def bind(self, *names: str) -> None:
        self.extend(("bind", name) for name in names)

    def release(self, *names: str) -> None:
        self.extend(("release", name) for name in names)


def _s_in_is_pool(d: Dims, call: str) -> bool:
    return not (call == "fwd" and save_plan(d.options).keeps_s_in)


def _forward_exchange(ev: Events, d: Dims, call: str) -> None:
    """Summary walk and c1/c2 (ring: c1 only); ``call`` is "fwd", or "bwd" when
    the backward replays the boundary."""
    keep_m_for_b1 = call == "bwd" and d.mid and not d.options.save_transfer
    ev.phase(f"{call}.phase.summary")
    if d.n_out:
        ev.bind("summary")
    ev.phase(f"{call}.phase.c1")
    if d.a2a:
        ev.bind("c1_send")
        if d.n_out and not keep_m_for_b1:
            ev.release("summary")
        ev.bind("c1_recv")
        ev.release("c1_send")
        ev.phase(f"{call}.phase.c2")
        ev.bind("c2_send")
        if call == "bwd" and d.options.save_transfer:
            ev.bind("kept_m")
        ev.release("c1_recv")
        if _s_in_is_pool(d, call):
            ev.bind("s_in")
        ev.release("c2_send")
    else:
        if d.n_in and _s_in_is_pool(d, call):
            ev.bind("s_in")
        if d.mid:
            ev.bind("ring_send")
            ev.release("ring_send")
        if d.n_out and not keep_m_for_b1:
            ev.release("summary")


def _backward_exchange(ev: Events, d: Dims, overlapped=None) -> None:
    """Adjoint summary and b1/b2 (ring: b1 only). ``overlapped``: the events
    of the work b2 runs under (``schedule="overlap"``), between its issue and
    its wait (which releases b2's send pool)."""
    held_summary = save_plan(d.options).replays_boundary and d.mid and not d.options.save_transfer
    ev.phase("bwd.phase.nu")
    if d.n_in:
        ev.bind("nu")
    ev.phase("bwd.phase.b1")
    if d.a2a:
        ev.bind("b1_send")
        if d.n_in:
            ev.release("nu")
        if held_summary:
            ev.release("summary")
        ev.bind("b1_recv")
        ev.release("b1_send")
        ev.phase("bwd.phase.b2")
        ev.bind("b2_send")
        ev.release("b1_recv")
        if save_plan(d.options).replays_boundary and d.options.save_transfer:
            ev.release("kept_m")
        ev.bind("lam")
        if overlapped is not None:
            overlapped()
        ev.release("b2_send")
    else:
        if d.n_out:
            ev.bind("lam")
        if d.mid:
            ev.bind("ring_send")
            ev.release("ring_send")
        if d.n_in:
            ev.release("nu")
        if held_summary:
            ev.release("summary")


def channel_decays(d: Dims, *, with_q: bool) -> tuple[str, ...]:
    """KDA's walk decays (``host.forward.run_channel_decays``): K's and the
    chunks' decays, and Q's ``with_q``; none for a scalar gate."""
    if d.options.gate != "channel":
        return ()
    return ("k_decayed", "chunk_decay") + (("q_decayed",) if with_q else ())


def forward_events(d: Dims) -> Events:
    ev = Events()
    o = d.options
    ev.phase("fwd.phase.prep")
    ev.bind(*pooled(o, "A", "w", "v_new", *norm_tapes(o)))
    ev.release(*pooled(o, "A"))  # prep's W, U launch reads it back; nothing after prep does
    decays = channel_decays(d, with_q=walks_with_output(o, d.K))  # to the walk, from the segments' summaries
    ev.bind(*decays)
    _segment_summaries(ev, d, "fwd")
    if d.ctx.exchanges:
        _forward_exchange(ev, d, "fwd")
    _compose_starts(ev, d, "fwd")
    # the walk: the tape walk into h when the tapes are kept, else the scores and the walk with the output
    walked = ("scores",) if walks_with_output(o, d.K) else pooled(o, "h")
    ev.phase("fwd.phase.walk")
    ev.bind(*walked)
    ev.release(*decays)
    if d.ctx.exchanges and _s_in_is_pool(d, "fwd") and (d.a2a or d.n_in):
        ev.release("s_in")
    if d.segmented:
        ev.release("seg_start", "seg_index")
    ev.release(*pooled(o, "w"))
    ev.phase("fwd.phase.output")
    ev.release(*pooled(o, "v_new"), *walked, *pooled(o, *norm_tapes(o)))
    return ev


def _segment_summaries(ev: Events, d: Dims, call: str) -> None:
    """Segments, phase 1: the tables and every summary row's ``[S | M]``."""
    if d.segmented:
        ev.phase(f"{call}.phase.segments")
        ev.bind("seg_index", "seg_summary")


def _compose_starts(ev: Events, d: Dims, call: str) -> None:
    """Segments, phase 2: the carry plane of start states (the forward's M is
    done with; the backward keeps it for the adjoint composition)."""
    if d.segmented:
        ev.phase(f"{call}.phase.compose")
        ev.bind("seg_start")
        if call == "fwd":
            ev.release("seg_summary")


def backward_events(d: Dims) -> Events:
    ev = Events()
    o = d.options
    plan = save_plan(o)
    overlap = d.ctx.exchanges and overlaps_b2(o)

    decays = channel_decays(d, with_q=True)  # the segments' summaries', the tape walk's and the adjoint walk's

    def recompute_walk() -> None:
        ev.phase("bwd.phase.walk")
        ev.bind("h")
        if d.ctx.exchanges and plan.replays_boundary and (d.a2a or d.n_in):
            ev.release("s_in")
        if d.segmented:
            ev.release("seg_start")

    if not plan.keeps_tapes:
        ev.phase("bwd.phase.prep")  # "inverse": W and U from the saved A
        ev.bind(*pooled(o, "A", "w", "v_new", *norm_tapes(o)), *decays)
        _segment_summaries(ev, d, "bwd")
        if d.ctx.exchanges and plan.replays_boundary:
            _forward_exchange(ev, d, "bwd")
        _compose_starts(ev, d, "bwd")
        if not overlap:
            recompute_walk()
    else:
        _segment_summaries(ev, d, "bwd")
    ev.phase("bwd.phase.local_dv")
    ev.bind("dv_new")
    if d.segmented:
        ev.phase("bwd.phase.segment_nu")
        ev.bind("seg_nu")
    if d.ctx.exchanges:
        _backward_exchange(ev, d, recompute_walk if overlap else None)
    if d.segmented:
        ev.phase("bwd.phase.compose_adjoint")
        ev.bind("seg_end")
        ev.release("seg_nu", "seg_summary")
    ev.phase("bwd.phase.adjoint_walk")
    ev.bind("dh")
    if plan.keeps_tapes:
        ev.bind(*decays)
    if d.ctx.exchanges and (d.a2a or d.n_out):
        ev.release("lam")
    if d.segmented:
        ev.release("seg_end", "seg_index")
    ev.release(*decays)
    ev.release(*pooled(o, "w"))
    ev.phase("bwd.phase.dqkwg")
    ev.bind("dq_heads", "dk_heads", "dw", "dgcum")
    ev.release("dh")
    ev.release(*pooled(o, "h", "v_new"))
    ev.phase("bwd.phase.wy")
    ev.release("dw", "dv_new")
    ev.release(*pooled(o, "A"))
    ev.phase("bwd.phase.grads")
    ev.release("dgcum", "dq_heads", "dk_heads")
    ev.release(*pooled(o, *norm_tapes(o)))
    return ev

"""The shape of every workspace pool and every saved tensor: the single source
of sizes. Symbols (all per rank, from the context): T tokens, NC chunks,
C = 64, HV / H_qk heads, K, V head dims, s_owner = ceil(HV / R),
s_pad = R s_owner, n_in / n_out / mid (crossing flags), n_mid (middle ranks of
the group); a2a payload sizes from :mod:`gdn_kcp.queries.comm`. Each pool and
saved tensor has the dtype :func:`gdn_kcp.dtypes.buffer_dtype` gives it: the
input dtype for the buffers of ``gdn_kcp.dtypes.INPUT_DTYPE_BUFFERS`` (the tapes
A, w, v_new, h; the forward's scores; the backward's dh, dv_new, dq_heads, dk_heads, dw), the compute
dtype (fp32; fp64 for fp64 inputs) for everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_kcp.context import KcpContext
from gdn_kcp.kernels import CHUNK_SIZE
from gdn_kcp.options import OptionsKcp, save_plan

from gdn_kcp.kernels.segments import table_elements
from gdn_kcp.plan import segments_for

from .comm import a2a_split_elements, conv_channels

TAPES = ("A", "w", "v_new", "q_rstd", "k_rstd", "h")
"""The forward tapes; save_mode="full" saves them, "inverse" A and the norms,
"light" none (the backward recomputes what is not saved)."""

SAVED_NAMES = (*TAPES, "s_in", "m", "owner_m")
"""Every tensor a forward may save, in the order the forward op returns them
(the ones an option set does not save come back empty)."""


def conv_halo_shape(ctx: KcpContext, H_qk: int, HV: int, K: int, V: int,
                    options: OptionsKcp | None) -> tuple[int, int] | None:
    """``(conv_size - 1, 2 H_qk K + HV V)``: the halo rows the layer's short
    convolution keeps (``options.with_conv``, on more than one rank), else None."""
    if options is None or not options.with_conv or ctx.R == 1 or options.conv_size == 1:
        return None
    return options.conv_size - 1, conv_channels(H_qk, HV, K, V)


def norm_tapes(options: OptionsKcp) -> tuple[str, ...]:
    """The q/k reciprocal-norm tapes a call with these options writes."""
    return ("q_rstd", "k_rstd") if options.use_qk_l2norm else ()


def saved_tapes(options: OptionsKcp) -> tuple[str, ...]:
    """The forward tapes a call with these options saves for its backward."""
    plan = save_plan(options)
    if plan.keeps_tapes:
        kept = TAPES
    elif plan.keeps_inverse:
        kept = ("A", "q_rstd", "k_rstd")
    else:
        return ()
    return tuple(name for name in kept if name not in ("q_rstd", "k_rstd") or name in norm_tapes(options))


def pooled(options: OptionsKcp, *names: str) -> tuple[str, ...]:
    """``names`` less the tapes these options save (those are saved tensors, not pools)."""
    kept = saved_tapes(options)
    return tuple(name for name in names if name not in kept)


@dataclass(frozen=True)
class Dims:
    """The sizes a layout is a function of."""

    ctx: KcpContext
    H_qk: int
    HV: int
    K: int
    V: int
    dtype: torch.dtype  # input dtype
    options: OptionsKcp

    @property
    def T(self) -> int:
        return self.ctx.n_tokens

    @property
    def NC(self) -> int:
        return self.ctx.index.n_chunks

    @property
    def n_in(self) -> int:
        return self.ctx.n_in

    @property
    def n_out(self) -> int:
        return self.ctx.n_out

    @property
    def mid(self) -> int:
        return self.ctx.rank_middle[self.ctx.rank]

    @property
    def n_mid(self) -> int:
        return sum(self.ctx.rank_middle)

    @property
    def a2a(self) -> bool:
        return self.options.exchange == "a2a"

    @property
    def P(self) -> int:
        """Segments per long fragment (the option, or the plan)."""
        return segments_for(self.ctx, self.HV, self.K, self.V, self.options.segments)

    @property
    def n_sum(self) -> int:
        """Summary rows at P segments (0 without segments)."""
        return self.ctx.summary_rows(self.P)

    @property
    def segmented(self) -> bool:
        return self.P > 1

    @property
    def state_heads(self) -> int:
        """Heads of a boundary state as it arrives: padded under a2a."""
        return self.ctx.padded_heads(self.HV) if self.a2a else self.HV


def pool_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Shape of every pool a call may bind (a call binds a subset)."""
    T, NC, HV, H_qk, K, V = d.T, d.NC, d.HV, d.H_qk, d.K, d.V
    shapes = {
        # tapes: prep (#1) and the tape walk (#2); v_new holds u until the walk
        "A": (T, HV, CHUNK_SIZE),
        "w": (T, HV, K),
        "v_new": (T, HV, V),
        "q_rstd": (T, H_qk),
        "k_rstd": (T, H_qk),
        "h": (NC, HV, K, V),
        # a forward that keeps no tape at K <= 128: the chunks' scores for the walk with the output, in place of h
        "scores": (T, HV, CHUNK_SIZE),
        # backward scratch; dv_new holds the local dv until the adjoint walk
        "dv_new": (T, HV, V),
        "dh": (NC, HV, K, V),
        "dq_heads": (T, HV, K),
        "dk_heads": (T, HV, K),
        "dw": (T, HV, K),
        "dgcum": (T, HV, K) if d.options.gate == "channel" else (T, HV),
        # staging: [S_loc | M] of the crossing-out fragment, nu of the crossing-in one
        "summary": (d.n_out, HV, K, V + d.mid * K),
        "nu": (d.n_in, HV, K, V),
        # boundary states as they arrive: S_in (c2 / ring c1) and lambda_end (b2 / ring b1)
        "s_in": (d.n_in, d.state_heads, K, V),
        "lam": (d.n_out, d.state_heads, K, V),
        # ring: a middle rank's folded state / adjoint on its way on
        "ring_send": (d.mid, HV, K, V),
        # save_transfer under a replayed boundary: the owner's M slices, c1 to b1
        "kept_m": (d.n_mid, d.ctx.owner_heads(HV), K, K),
    }
    if d.options.gate == "channel":  # KDA: the walks' decays, formed once a chunk (kernels channel_decays)
        shapes["k_decayed"] = (T, HV, K)
        shapes["q_decayed"] = (T, HV, K)
        shapes["chunk_decay"] = (NC, HV, K)
    if d.segmented:  # intra-rank segments (kernels/segments.py): tables, phase-1 summaries, carry planes
        n_sum = d.n_sum
        shapes["seg_index"] = (table_elements(d.ctx.index.n_frag, n_sum),)
        shapes["seg_summary"] = (n_sum, HV, K, V + K)
        shapes["seg_start"] = (n_sum, HV, K, V)
        shapes["seg_nu"] = (n_sum, HV, K, V)
        shapes["seg_end"] = (n_sum, HV, K, V)
    st = d.options.save_transfer
    for name in ("c1", "c2", "b1", "b2"):
        sends, recvs = a2a_split_elements(d.ctx, name, HV, K, V, save_transfer=st)
        shapes[f"{name}_send"] = (sum(sends),)
        if name in ("c1", "b1"):
            shapes[f"{name}_recv"] = (sum(recvs),)
    return shapes


def saved_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor the forward keeps for the backward (besides its
    inputs, which the caller holds anyway)."""
    plan = save_plan(d.options)
    pools = pool_shapes(d)
    saved: dict[str, tuple[int, ...]] = {}
    for name in saved_tapes(d.options):
        saved[name] = pools[name]
    if d.ctx.exchanges:
        if plan.keeps_s_in and (d.a2a or d.n_in):  # a2a always receives c2, if only 0 bytes
            saved["s_in"] = pools["s_in"]
        if plan.keeps_m:
            saved["m"] = (d.mid, d.HV, d.K, d.K)
        if plan.keeps_owner_m:
            saved["owner_m"] = pools["kept_m"]
    return saved


def numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out

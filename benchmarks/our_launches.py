"""Our launches as the roofline (benchmarks/roofline.py) counts them: every
Triton launch of one GDN forward and backward (``gdn_kcp.host``'s programs,
each at its ``compile_specs`` configuration) under a save mode and a number
of intra-rank segments, and of one KDA forward and backward (the
``[channel]`` programs), with the FLOPs and bytes each program moves at a
shape (:class:`launch_model.Shape`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from gdn_kcp.cost_model import H200, Launch, Work, walk
from gdn_kcp.kernels.torch.prep import INVERSE_BLOCK
from gdn_kcp.kernels.triton._common import heads_per_program, walk_block
from gdn_kcp.kernels.triton.adjoint_summary import adjoint_value_block
from gdn_kcp.kernels.triton.bwd_qk_norm import BT_NORM
from gdn_kcp.kernels.triton.compose_segments import BV_COMPOSE
from gdn_kcp.kernels.triton.output import BV_OUTPUT
from gdn_kcp.kernels.triton.scores import SUB_ROWS
from gdn_kcp.kernels.triton.wy_inverse import SUBSTITUTION_BLOCK

from gdn_kcp import OptionsKcp, build_kcp_context
from gdn_kcp.options import walks_with_output
from gdn_kcp.plan import plan_segments, segments_for
from gdn_kcp.queries import gdn_workspace_layout_kcp
import kda_counts  # benchmarks/kda_counts.py: KDA's elementwise work, both sides
from launch_model import BF16, F32, SOLVE_OPS, Shape


def shape_of(ctx, H_qk: int, HV: int, K: int, V: int) -> Shape:
    """The model's shape for a one-rank context: its tokens, chunks, documents
    and the chunks of its longest document."""
    return Shape(T=ctx.n_tokens, H=H_qk, HV=HV, K=K, V=V, NC=ctx.index.n_chunks, fragments=ctx.index.n_frag,
                 longest=ctx.index.max_frag_chunks)


def full_shape() -> tuple[Shape, object, OptionsKcp]:
    """The full shape on a one-rank context of one document, and the options."""
    shape = Shape()
    ctx = build_kcp_context([0, shape.T], n_sms=H200.sms)
    return shape_of(ctx, shape.H, shape.HV, shape.K, shape.V), ctx, OptionsKcp(use_qk_l2norm=True)


def pool_element_sizes(ctx, s: Shape, options: OptionsKcp, dtype=torch.bfloat16) -> dict[str, int]:
    """Bytes per element of every pool a forward or backward binds (the layout's dtypes)."""
    layout = gdn_workspace_layout_kcp(ctx, s.H, s.HV, s.K, s.V, dtype=dtype, options=options)
    return {name: spec.dtype.itemsize for call in (layout.fwd, layout.bwd) for name, spec in call.pools.items()}


# ---------------------------------------------------------------- ours

FORWARD_PROGRAMS = {True: ("prep", "scores", "walk_output"), False: ("prep", "tape_walk", "output")}
BACKWARD_PROGRAMS = ("bwd_local_dv", "adjoint_walk", "bwd_dqkwg", "bwd_wy", "bwd_gate_cumsum", "bwd_qk_norm")
"""The programs of one forward, by whether it walks with the output
(``gdn_kcp.options.walks_with_output``: it keeps no tape, K <= 128), and of
one backward after what it recomputes, on one rank (host/forward.py,
host/backward.py; tests/test_roofline.py checks them)."""

RECOMPUTED = {"light": ("prep", "tape_walk"), "inverse": ("w_u", "tape_walk"), "full": ()}
"""What the backward runs again before its own programs, per save mode."""

SEGMENT_PHASES = {"walk_output": ("segment_summary", "compose_segments"),
                  "tape_walk": ("segment_summary", "compose_segments"),
                  "adjoint_walk": ("adjoint_segment_summary", "compose_adjoints")}
"""With intra-rank segments (P > 1), what runs before each walk: phase 1 (every
segment's summary) and phase 2 (their composition into each segment's start
state or end adjoint; host/segments.py). The forward's phases run right
after prep, before the scores; a backward that keeps its tapes runs phase 1
alone (M only, for the adjoints' composition) before everything."""


def our_programs(save_mode: str = "light", K: int = 128, segmented: bool = False,
                 channel: bool = False) -> dict[str, tuple[str, ...]]:
    """The programs of one forward and one backward under ``save_mode`` at key
    head ``K``, with intra-rank segments when ``segmented``, with a gate per
    key channel (KDA) when ``channel``: then ``channel_decays`` runs right
    after prep (or W, U) in each direction, before the segments' summaries
    and the walks, or, in a backward that recomputes nothing, right before
    the adjoint walk (its segments' summaries form their own decays)."""
    fused = walks_with_output(OptionsKcp(save_mode=save_mode), K)
    fwd, bwd = FORWARD_PROGRAMS[fused], RECOMPUTED[save_mode] + BACKWARD_PROGRAMS
    if segmented:
        def with_phases(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(x for name in names for x in (*SEGMENT_PHASES.get(name, ()), name))

        walk = next(name for name in fwd if name in SEGMENT_PHASES)  # the forward's phases run right after prep
        fwd = (fwd[0], *SEGMENT_PHASES[walk], *fwd[1:])
        bwd = with_phases(bwd) if RECOMPUTED[save_mode] else ("segment_summary", *with_phases(bwd))
    if channel:  # right after prep (or W, U), or before the adjoint walk where the backward recomputes nothing
        fwd = (fwd[0], "channel_decays", *fwd[1:])
        at = 1 if RECOMPUTED[save_mode] else bwd.index("adjoint_walk")
        bwd = (*bwd[:at], "channel_decays", *bwd[at:])
    return {"fwd": fwd, "bwd": bwd}


def norm_launches(phase: str, s: Shape, e: Mapping[str, int]) -> list[Launch]:
    """The q and k norms' launches (``l2_rstd_kernel``, one program per chunk and key head)."""
    norm = Launch(phase, "l2_rstd_kernel", -(-s.T // s.C) * s.H,
                  Work(fp32=2 * s.C * s.K, bytes=s.C * s.K * BF16 + s.C * e["q_rstd"]))
    return [norm, norm]


def norm_backward_launches(phase: str, s: Shape, e: Mapping[str, int], variant: str = "") -> list[Launch]:
    """dq's and dk's GVA sums and norm backwards (``bwd_qk_norm_kernel``, BT_NORM rows of a key head a
    program; ``variant``: ``"[channel]"`` for KDA's, whose per-value-head dq and dk are fp32)."""
    work = Work(bytes=BT_NORM * (s.HV // s.H * s.K * e["dq_heads"] + e["q_rstd"] + 2 * s.K * BF16))
    return [Launch(phase, "bwd_qk_norm_kernel" + variant, -(-s.T // BT_NORM) * s.H, work)] * 2


INVERSE_STEPS = SUBSTITUTION_BLOCK - 1
"""The WY inverse's serial steps: the half blocks' substitution, every block at once."""


def inverse_work(C: int) -> tuple[Work, Work]:
    """The WY inverse of one chunk from its L (either gate): the tensor-core
    merges at 16 and 32 rows, the substitution and the exact merge at 8 (fp32);
    and one substitution step."""
    SB = SUBSTITUTION_BLOCK

    def merges(*blocks: int) -> int:  # pairs x two products, merging blocks of each size
        return sum(C // (2 * b) * 2 * (2 * b**3) for b in blocks)

    step = Work(fp32=SOLVE_OPS * C * SB)
    return Work(bf16=merges(INVERSE_BLOCK, 2 * INVERSE_BLOCK), fp32=INVERSE_STEPS * step.fp32 + merges(SB)), step


def our_launches(s: Shape, e: Mapping[str, int], save_mode: str = "light", P: int = 1,
                 programs: Mapping[str, Sequence[str]] | None = None) -> list[Launch]:
    """Every Triton launch of :func:`our_programs` under ``save_mode`` with P
    intra-rank segments per fragment (the plan's: :func:`plan_p`); ``e``:
    bytes per element of each pool (and saved tape). ``programs``: other
    program names per phase instead (a checkpointed step's, counted)."""
    C, K, V, HV, H, NC = s.C, s.K, s.V, s.HV, s.H, s.NC
    BW = walk_block(V)  # the walks' value tile
    NW, G, n = -(-V // BW), HV // H, BF16
    F, steps = s.fragments * P, -(-s.chunks_per_fragment // P)  # walks: a program per segment, ceil(n / P) steps
    qk = 2 * C * K * n + 2 * C * e["q_rstd"]  # q and k rows of a chunk, with their norms

    def prep(phase: str) -> list[Launch]:
        solve, step = inverse_work(C)
        inverse = solve + Work(bf16=2 * C * C * K,  # L
                               bytes=C * K * n + C * e["k_rstd"] + 2 * C * n + C * C * e["A"])
        return [*norm_launches(phase, s, e), Launch(phase, "wy_inverse_kernel", NC * HV, inverse, INVERSE_STEPS, step),
                *w_u(phase)]

    def w_u(phase: str) -> list[Launch]:
        work = Work(bf16=2 * C * C * K + 2 * C * C * V,
                    bytes=C * C * e["A"] + C * K * n + C * e["k_rstd"] + 2 * C * n + C * V * n
                    + C * K * e["w"] + C * V * e["v_new"])
        return [Launch(phase, "prep_kernel", NC * HV, work)]

    def tape_walk(phase: str) -> list[Launch]:
        step = Work(bf16=2 * (2 * C * K * BW), bytes=C * K * n + C * e["k_rstd"] + C * n + C * K * e["w"]
                    + 2 * C * BW * e["v_new"] + K * BW * e["h"])
        return [walk(phase, "tape_walk_kernel", F * HV * NW, steps, step)]

    def segment_summary(phase: str) -> list[Launch]:  # [S | M] of every segment (M alone where tapes are kept)
        width = K if phase == "bwd" and save_mode == "full" else V + K
        SB = walk_block(V + K)
        step = Work(bf16=2 * (2 * C * K * SB), bytes=C * K * n + C * e["k_rstd"] + C * n + C * K * e["w"]
                    + C * SB * e["v_new"])
        return [walk(phase, "segment_summary_kernel", F * HV * -(-width // SB), steps, step)]

    def compose(kernel: str, phase: str) -> list[Launch]:  # P exact fp32 steps of [K, K] x [K, 16] per program
        BV = min(BV_COMPOSE, V)
        step = Work(fp32=2 * K * K * BV, bytes=(K * K + 2 * K * BV) * F32)
        return [walk(phase, kernel, s.fragments * HV * -(-V // BV), P, step)]

    def adjoint_segment_summary(phase: str) -> list[Launch]:  # the adjoint walk's step, nothing stored
        BA = adjoint_value_block(K, V, channel=False)  # its launcher's value tile (64), not the walks' (32)
        step = Work(bf16=4 * (2 * C * K * BA),
                    bytes=qk + C * n + C * K * e["w"] + C * BA * n + C * BA * e["dv_new"])
        return [walk(phase, "adjoint_segment_summary_kernel", F * HV * -(-V // BA), steps, step)]

    def output(phase: str) -> list[Launch]:  # one program per chunk and head walks the value tiles
        work = Work(bf16=2 * C * C * K + 2 * C * K * V + 2 * C * C * V,
                    bytes=qk + C * n + K * V * e["h"] + C * V * e["v_new"] + C * V * n)
        return [Launch(phase, "output_kernel", NC * HV, work)]

    def scores(phase: str) -> list[Launch]:  # Q K^T per chunk and key head, decayed per value head
        work = Work(bf16=2 * C * C * K, bytes=qk + G * (C * n + C * C * e["scores"]))
        return [Launch(phase, "scores_kernel", NC * H, work)]

    def walk_output(phase: str) -> list[Launch]:  # the tape walk's step, then diag(gamma) Q S and P Vn into o
        step = Work(bf16=3 * (2 * C * K * BW) + 2 * C * C * BW,
                    bytes=qk + C * n + C * K * e["w"] + C * BW * e["v_new"] + C * C * e["scores"] + C * BW * n)
        return [walk(phase, "walk_output_kernel", F * HV * NW, steps, step)]

    def bwd_local_dv(phase: str) -> list[Launch]:  # a program per chunk and head, or pair of a key head's heads
        pair = heads_per_program(H, HV)
        work = Work(bf16=2 * C * C * K + pair * 2 * C * C * V,
                    bytes=qk + pair * (C * n + C * V * n + C * V * e["dv_new"]))
        return [Launch(phase, "bwd_local_dv_kernel" if pair > 1 else "bwd_local_dv_kernel[one head]", NC * HV // pair,
                       work)]

    def adjoint_walk(phase: str) -> list[Launch]:  # K dS, W^T dVn and the pull Q^T (c dO) in two bf16 terms
        step = Work(bf16=4 * (2 * C * K * BW), bytes=qk + C * n + C * K * e["w"] + C * BW * n
                    + 2 * C * BW * e["dv_new"] + K * BW * e["dh"])
        return [walk(phase, "adjoint_walk_kernel", F * HV * NW, steps, step)]

    def bwd_dqkwg(phase: str) -> list[Launch]:
        # dO Vn^T; the state terms of dq, dk, dw; Q K^T (its own pass over q and k: dG's score terms are
        # the sums of one matrix dP * P); the score terms of dq, dk
        work = Work(bf16=2 * C * C * V + 3 * (2 * C * K * V) + 3 * (2 * C * C * K),
                    bytes=C * n + C * V * (n + e["v_new"] + e["dv_new"]) + K * V * (e["h"] + e["dh"]) + qk
                    + C * K * (e["dq_heads"] + e["dk_heads"] + e["dw"]) + C * e["dgcum"])
        return [Launch(phase, "bwd_dqkwg_kernel", NC * HV, work)]

    def bwd_wy(phase: str) -> list[Launch]:
        # dA from dW and dU; A^T dW and A^T dU; A^T dA A^T; K K^T (its own pass over k: dL * L as one
        # matrix) and (diag(beta) dL + its transpose) K
        work = Work(bf16=2 * C * C * (4 * K + 2 * V + 2 * C),
                    bytes=2 * C * n + C * C * e["A"] + C * K * n + C * e["k_rstd"] + C * K * e["dw"] + C * V * n
                    + C * V * e["dv_new"] + 2 * C * K * e["dk_heads"] + 2 * C * e["dgcum"] + C * V * n + C * n)
        return [Launch(phase, "bwd_wy_kernel", NC * HV, work)]

    def bwd_gate_cumsum(phase: str) -> list[Launch]:
        return [Launch(phase, "bwd_gate_cumsum_kernel", NC * HV, Work(bytes=C * e["dgcum"] + C * n))]

    by_name = {"prep": prep, "w_u": w_u, "tape_walk": tape_walk, "output": output, "scores": scores,
                "walk_output": walk_output, "bwd_local_dv": bwd_local_dv,
                "adjoint_walk": adjoint_walk, "bwd_dqkwg": bwd_dqkwg, "bwd_wy": bwd_wy,
                "bwd_gate_cumsum": bwd_gate_cumsum, "bwd_qk_norm": lambda phase: norm_backward_launches(phase, s, e),
                "segment_summary": segment_summary, "adjoint_segment_summary": adjoint_segment_summary,
                "compose_segments": lambda phase: compose("compose_segments_kernel", phase),
                "compose_adjoints": lambda phase: compose("compose_adjoints_kernel", phase)}
    phases = our_programs(save_mode, K, P > 1) if programs is None else programs
    return [launch for phase, names in phases.items() for name in names for launch in by_name[name](phase)]


# ---------------------------------------------------------------- ours, KDA

def our_kda_counts(s: Shape) -> dict[str, kda_counts.Count]:
    """Our KDA programs' elementwise work a chunk and value head at shape ``s``
    (:func:`kda_counts.our_kda_counts`)."""
    solve, _ = inverse_work(s.C)
    return kda_counts.our_kda_counts(s.C, s.K, s.V, walk_block(s.V), BV_OUTPUT, solve.fp32 - kda_merge_flops(s.C) / 2)


def kda_merge_flops(C: int) -> float:
    """The WY inverse's exact 8-row merges (fp32 FMAs, counted in FLOPs in
    :func:`inverse_work`)."""
    SB = SUBSTITUTION_BLOCK
    return C // (2 * SB) * 2 * (2 * SB**3)


def dyadic_products(C: int, K: int) -> int:
    """The tensor-core FLOPs of one formation of KDA's intra-chunk pairs over
    K: the dyadic levels of half width ``SUB_ROWS`` and more, each ``C / 2h``
    products of ``[h, K] x [K, h]`` (at C = 64: one of 32 and two of 16, 3,072
    K FLOPs, against the 24,576 K of three masked ``[64, 64]`` products)."""
    flops, h = 0, C // 2
    while h >= SUB_ROWS:
        flops += C // (2 * h) * 2 * h * h * K
        h //= 2
    return flops


def our_kda_launches(s: Shape, e: Mapping[str, int], save_mode: str = "light", P: int = 1,
                     counts: Mapping[str, kda_counts.Count] | None = None) -> list[Launch]:
    """Every Triton launch of one KDA forward and backward (``chunk_kda``'s host
    path, a gate per key channel, the programs of :func:`our_programs`, each
    at its ``[channel]`` configuration) under ``save_mode``, with P intra-rank
    segments per fragment. The intra-chunk products go through dyadic
    anchors (``kernels/triton/channel.py``): the pairs across sub-chunks as
    products of exactly those pairs under tf32
    (``kernels.precision.channel_mode``, :func:`dyadic_products`), the pairs
    inside each sub-chunk of ``SUB`` rows elementwise, exact for any gate. Every program's elementwise
    work is :func:`our_kda_counts`' (``counts``: others, e.g. with no pair
    work), in issue slots priced at the fp32 peak (``kda_counts``)."""
    C, K, V, HV, NC = s.C, s.K, s.V, s.HV, s.NC
    BW, n = walk_block(V), BF16
    NW = -(-V // BW)
    F, steps = s.fragments * P, -(-s.chunks_per_fragment // P)
    count = our_kda_counts(s) if counts is None else counts
    qk = 2 * C * K * n + 2 * C * e["q_rstd"]
    g = C * K * n  # a chunk's gates, one per key channel
    anchored = dyadic_products(C, K)  # the pairs across sub-chunks, on tensor cores

    def elementwise(kernel: str, share: int = 1) -> Work:  # a program's share of its kernel's work a chunk
        return Work(fp32=count[kernel].flops / share)

    def own_decays(phase: str) -> bool:  # the segments' summaries of a backward that recomputes nothing
        return phase == "bwd" and save_mode == "full"

    def summary_work(kernel: str, phase: str) -> Work:  # kda_counts' "[channel, own decays]" where they form them
        return elementwise(kernel.replace("[channel]", "[channel, own decays]") if own_decays(phase) else kernel)

    def wy_inverse(phase: str) -> list[Launch]:
        solve, step = inverse_work(C)
        kernel = "channel_wy_inverse_kernel"
        work = Work(tf32=anchored, bf16=solve.bf16, bytes=C * K * n + C * e["k_rstd"] + C * n + g + C * C * e["A"]) \
            + elementwise(kernel)
        return [Launch(phase, kernel, NC * HV, work, INVERSE_STEPS, Work(fp32=step.fp32 * kda_counts.FLOP_PER_SLOT))]

    def w_u(phase: str) -> list[Launch]:
        work = Work(bf16=2 * C * C * K + 2 * C * C * V,
                    bytes=C * C * e["A"] + C * K * n + C * e["k_rstd"] + C * n + g + C * V * n
                    + C * K * e["w"] + C * V * e["v_new"]) + elementwise("prep_kernel[channel]")
        return [Launch(phase, "prep_kernel[channel]", NC * HV, work)]

    decayed = C * K * e["k_decayed"] + K * e["chunk_decay"]  # a chunk of K's decayed rows and its decay

    def channel_decays(phase: str) -> list[Launch]:  # once a chunk: K's and Q's decays, as the walks read them
        kernel = "channel_decays_kernel"
        work = Work(bytes=qk + g + decayed + C * K * e["q_decayed"]) + elementwise(kernel)
        return [Launch(phase, kernel, NC * HV, work)]

    def tape_walk(phase: str) -> list[Launch]:
        kernel = "tape_walk_kernel[channel]"
        step = Work(bf16=2 * (2 * C * K * BW),
                    bytes=decayed + C * K * e["w"] + 2 * C * BW * e["v_new"] + K * BW * e["h"]) \
            + elementwise(kernel, NW)
        return [walk(phase, kernel, F * HV * NW, steps, step)]

    def segment_summary(phase: str) -> list[Launch]:  # [S | M] of every segment (M alone where tapes are kept)
        kernel = "segment_summary_kernel[channel]"
        width = K if phase == "bwd" and save_mode == "full" else V + K
        SB = walk_block(V + K)
        reads = C * K * n + C * e["k_rstd"] + g if own_decays(phase) else decayed  # K and its decays
        step = Work(bf16=2 * (2 * C * K * SB), bytes=reads + C * K * e["w"] + C * SB * e["v_new"]) \
            + summary_work(kernel, phase)
        return [walk(phase, kernel, F * HV * -(-width // SB), steps, step)]

    def compose(kernel: str, phase: str) -> list[Launch]:  # P exact fp32 steps of [K, K] x [K, 16] per program
        BV = min(BV_COMPOSE, V)
        step = Work(fp32=2 * K * K * BV, bytes=(K * K + 2 * K * BV) * F32)
        return [walk(phase, kernel, s.fragments * HV * -(-V // BV), P, step)]

    def adjoint_segment_summary(phase: str) -> list[Launch]:  # the adjoint walk's step, nothing stored
        kernel = "adjoint_segment_summary_kernel[channel]"
        BA = adjoint_value_block(K, V, channel=True)
        reads = qk + g if own_decays(phase) else decayed + C * K * e["q_decayed"] + C * e["q_rstd"]
        step = Work(bf16=4 * (2 * C * K * BA), bytes=reads + C * K * e["w"] + C * BA * n + C * BA * e["dv_new"]) \
            + summary_work(kernel, phase)
        return [walk(phase, kernel, F * HV * -(-V // BA), steps, step)]

    def scores(phase: str) -> list[Launch]:  # one program per chunk and value head (its own gates)
        work = Work(tf32=anchored, bytes=qk + g + C * C * e["scores"]) + elementwise("channel_scores_kernel")
        return [Launch(phase, "channel_scores_kernel", NC * HV, work)]

    def walk_output(phase: str) -> list[Launch]:  # q and the state's rows decay per channel
        kernel = "walk_output_kernel[channel]"
        step = Work(bf16=3 * (2 * C * K * BW) + 2 * C * C * BW,
                    bytes=decayed + C * K * e["q_decayed"] + C * K * e["w"] + C * BW * e["v_new"]
                    + C * C * e["scores"] + C * BW * n) + elementwise(kernel, NW)
        return [walk(phase, kernel, F * HV * NW, steps, step)]

    def output(phase: str) -> list[Launch]:
        work = Work(tf32=anchored, bf16=2 * C * K * V + 2 * C * C * V,
                    bytes=qk + g + K * V * e["h"] + C * V * e["v_new"] + C * V * n) \
            + elementwise("output_kernel[channel]")
        return [Launch(phase, "output_kernel[channel]", NC * HV, work)]

    def bwd_local_dv(phase: str) -> list[Launch]:
        work = Work(tf32=anchored, bf16=2 * C * C * V, bytes=qk + g + C * V * n + C * V * e["dv_new"]) \
            + elementwise("bwd_local_dv_kernel[channel]")
        return [Launch(phase, "bwd_local_dv_kernel[channel]", NC * HV, work)]

    def adjoint_walk(phase: str) -> list[Launch]:
        kernel = "adjoint_walk_kernel[channel]"
        step = Work(bf16=4 * (2 * C * K * BW),
                    bytes=decayed + C * K * e["q_decayed"] + C * e["q_rstd"] + C * K * e["w"] + C * BW * n
                    + 2 * C * BW * e["dv_new"] + K * BW * e["dh"]) + elementwise(kernel, NW)
        return [walk(phase, kernel, F * HV * NW, steps, step)]

    def bwd_dqkwg(phase: str) -> list[Launch]:  # dO Vn^T, the state terms, the score terms by channel_pulls
        work = Work(tf32=2 * anchored, bf16=2 * C * C * V + 3 * (2 * C * K * V),
                    bytes=g + C * V * (n + e["v_new"] + e["dv_new"]) + K * V * (e["h"] + e["dh"]) + qk
                    + C * K * (e["dq_heads"] + e["dk_heads"] + e["dw"] + e["dgcum"])) \
            + elementwise("bwd_dqkwg_kernel[channel]")
        return [Launch(phase, "bwd_dqkwg_kernel[channel]", NC * HV, work)]

    def bwd_wy(phase: str) -> list[Launch]:
        # the value pass (A^T dU, dU (beta V)^T), dW (beta exp(G) K)^T, A^T dA A^T, A^T dW; dL's pulls
        work = Work(tf32=2 * anchored, bf16=2 * C * C * (2 * K + 2 * V + 2 * C),
                    bytes=C * n + g + C * C * e["A"] + C * K * n + C * e["k_rstd"] + C * K * e["dw"]
                    + C * V * n + C * V * e["dv_new"] + 2 * C * K * e["dk_heads"] + 2 * C * K * e["dgcum"]
                    + C * V * n + C * n) + elementwise("bwd_wy_kernel[channel]")
        return [Launch(phase, "bwd_wy_kernel[channel]", NC * HV, work)]

    def bwd_gate_cumsum(phase: str) -> list[Launch]:
        kernel = "bwd_gate_cumsum_channel_kernel"
        return [Launch(phase, kernel, NC * HV, Work(bytes=C * K * (e["dgcum"] + n)) + elementwise(kernel))]

    by_name = {"prep": lambda phase: [*norm_launches(phase, s, e), *wy_inverse(phase), *w_u(phase)], "w_u": w_u,
               "channel_decays": channel_decays,
               "tape_walk": tape_walk, "output": output, "scores": scores, "walk_output": walk_output,
               "bwd_local_dv": bwd_local_dv, "adjoint_walk": adjoint_walk, "bwd_dqkwg": bwd_dqkwg, "bwd_wy": bwd_wy,
               "bwd_gate_cumsum": bwd_gate_cumsum,
               "bwd_qk_norm": lambda phase: norm_backward_launches(phase, s, e, "[channel]"),
               "segment_summary": segment_summary, "adjoint_segment_summary": adjoint_segment_summary,
               "compose_segments": lambda phase: compose("compose_segments_kernel", phase),
               "compose_adjoints": lambda phase: compose("compose_adjoints_kernel", phase)}
    phases = our_programs(save_mode, K, P > 1, channel=True)
    return [launch for phase, names in phases.items() for name in names for launch in by_name[name](phase)]


def plan_p(ctx, s: Shape) -> int:
    """The intra-rank segments the default options run at (``gdn_kcp.plan``)."""
    return plan_segments(ctx, s.HV, s.K, s.V)


def shape_context(s: Shape):
    """A one-rank context of the documents of shape ``s``, on the H200's SMs
    (whose count the segment plan fills)."""
    per_doc = -(-s.T // s.fragments)
    return build_kcp_context(list(range(0, s.T, per_doc)) + [s.T], n_sms=H200.sms)


def our_shape_launches(s: Shape, save_mode: str = "light") -> list[Launch]:
    """Our launches at shape ``s`` (pool dtypes from the light layout of its
    context: a saved tape has its pool's dtype)."""
    ctx = shape_context(s)
    return our_launches(s, pool_element_sizes(ctx, s, OptionsKcp(use_qk_l2norm=True)), save_mode, plan_p(ctx, s))


def our_kda_shape_launches(s: Shape, save_mode: str = "light", P: int | None = None,
                           counts: Mapping[str, kda_counts.Count] | None = None) -> list[Launch]:
    """Our KDA launches at shape ``s`` (pool dtypes from the light layout of
    its context with a gate per key channel) at the plan's P segments
    (``gdn_kcp.plan.segments_for``, as the host path runs them) or ``P``;
    ``counts``: :func:`our_kda_launches`'."""
    ctx = shape_context(s)
    options = OptionsKcp(use_qk_l2norm=True, gate="channel")
    P = segments_for(ctx, s.HV, s.K, s.V, P)
    return our_kda_launches(s, pool_element_sizes(ctx, s, options), save_mode, P, counts)

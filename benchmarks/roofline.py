"""Static H200 estimate of one forward+backward, ours against
flash-linear-attention's (FLA, fla-core 0.5.1), on the calibrated cost model
of :mod:`gdn_kcp.cost_model`: per kernel launch the FLOPs, the bytes, the
compile facts (sm_90) and the estimated time, on the CPU (no GPU).

    python benchmarks/roofline.py [--T 32768] [--docs 1] [--hq 16] [--hv 32] [--save-mode light] [--json]
    python benchmarks/roofline.py --calibration        # the calibration table
    python benchmarks/roofline.py --fit                # refit the model's three constants
    python benchmarks/roofline.py --recalibrate DIR/gpu_check.json [--json]
    python benchmarks/roofline.py --refresh-facts --fla-site DIR [--triton-site DIR]

KDA (``compare_kda``): ours (``chunk_kda``) against FLA 0.5.1's ``chunk_kda``
(``fla_kernels.FLA_KDA_KERNELS``) at the same shape, a gate per key channel,
printed after GDN's rows.

Shape: T tokens in ``--docs`` equal documents (B = 1), H_qk = ``--hq``, HV =
``--hv``, K = V = 128, bf16 inputs, chunks of C = 64, the q/k L2 norm in the
kernels, one rank, default options (``save_mode="light"``: the backward
recomputes prep and the tape walk; ``--save-mode`` for another, and a table
of all three at the end). Ours: the launches of
:mod:`gdn_kcp.host` at the configs of ``compile_specs.kernels``. FLA: the
launches of fla-core 0.5.1's ``chunk_gated_delta_rule(...,
use_qk_l2norm_in_kernel=True, cu_seqlens=...)`` (``benchmarks/fla_kernels.py``
has the table), each kernel at the configuration of its autotune list with
the least modelled time at the shape (its autotuner picks by measuring; the
model picks by its own estimate, the same rule for every kernel).

Compile facts (registers, spills, shared memory, warps, the products'
instruction class) come from ``benchmarks/h200_facts.json``: every kernel of
ours and every configuration of FLA's compiled for sm_90 by triton 3.6, the
triton of the H200 machine this project may borrow (FLA 0.5.1's block
pointers do not compile on triton 3.9). ``--refresh-facts`` recompiles them
(minutes; ``--triton-site`` puts another triton first on the path) and
records the triton and fla versions and a digest of our kernel sources, which
``tests/test_roofline.py`` checks against the sources.

What the work counts, the same for both:
- FLOPs: 2 m n k per matrix product, counted from what each program computes
  at this shape, recomputation included (a QK^T per value tile counts per
  value tile). Elementwise work is not counted, except the forward
  substitution of the triangular inverses: ``SOLVE_OPS`` fp32 ops per tile
  element per row step, and KDA's per-channel decays and pairs
  (:data:`DECAY_OPS`, :data:`PAIR_OPS`; the KDA rows only).
- Bytes: per program, every tile it reads or writes, once (a tile a program
  reads twice is taken to hit the cache), at its dtype: ours the pool dtypes
  of ``gdn_workspace_layout_kcp``, FLA's the dtypes its host code allocates.
  Tiles read by several programs count once per program. FLA's torch ops
  between kernels (GVA sums, dk / dg adds, casts, ``torch.zeros``) are
  launches of bytes only.
- The time of each launch is :func:`gdn_kcp.cost_model.terms` (spills,
  residency, overlap, the walks' serial steps, the three fitted constants);
  the total is the sum over the launches (CUDA-graph replays: no launch
  overhead, no overlap between launches).

Calibration (:data:`CALIBRATION`): FLA 0.5.1's measured H200 forward and
backward times at four shapes, from the FlashQLA authors' published H200
benchmark (CUDA graphs). The model is evidence only as far as it reproduces
them: ``--calibration`` prints each row's modelled time and error, and the
test holds every error within 20 %.

``--recalibrate`` (``benchmarks/recalibrate.py``) refits the three constants
to the FLA times a GPU check measured (``benchmarks/gpu_check.py``'s
``gpu_check.json``) and sets every row, ours held out, against the refit
model.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if __name__ == "__main__":  # before triton is imported: compile for real, ptxas runs for every kernel
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for i, arg in enumerate(sys.argv):  # --triton-site DIR: that triton first on the path
        if arg == "--triton-site" and i + 1 < len(sys.argv):
            sys.path.insert(0, sys.argv[i + 1])
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache or (os.path.isdir(cache) and os.listdir(cache)):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="roofline-triton-")

import torch
from gdn_kcp.cost_model import H200, Launch, Machine, Work, resident, terms, walk
from gdn_kcp.kernels.torch.prep import INVERSE_BLOCK
from gdn_kcp.kernels.triton._common import head_block, heads_per_program, walk_block
from gdn_kcp.kernels.triton.adjoint_summary import adjoint_value_block
from gdn_kcp.kernels.triton.bwd_qk_norm import BT_NORM
from gdn_kcp.kernels.triton.compile_specs import SHARED_MEMORY_LIMIT, kernel_of
from gdn_kcp.kernels.triton.compose_segments import BV_COMPOSE
from gdn_kcp.kernels.triton.scores import SUB_ROWS
from gdn_kcp.kernels.triton.wy_inverse import SUBSTITUTION_BLOCK

from gdn_kcp import OptionsKcp, build_kcp_context
from gdn_kcp.options import SAVE_MODES, walks_with_output
from gdn_kcp.plan import plan_segments, walk_launches
from gdn_kcp.queries import gdn_saved_bytes_kcp, gdn_workspace_layout_kcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fla_kernels  # noqa: E402  (benchmarks/fla_kernels.py: FLA 0.5.1's kernel table)

ROOT = Path(__file__).resolve().parent.parent
FACTS_FILE = Path(__file__).resolve().parent / "h200_facts.json"

SOLVE_OPS = 6
"""fp32 ops per tile element in one row step of a forward substitution
(row extraction: select, add; product: multiply, add; row insertion: select,
plus the masks)."""
BF16 = 2
F32 = 4


def estimate(launches: list[Launch], facts: Mapping[str, Mapping], m: Machine = H200) -> dict:
    """Rows (identical launches grouped) and the totals in ms (all, fwd, bwd)."""
    rows: dict[Launch, dict] = {}
    for launch in launches:
        if launch in rows:
            rows[launch]["n"] += 1
            continue
        f = facts.get(launch.kernel) if launch.kernel else None
        if launch.kernel and f is None:
            raise KeyError(f"no compile facts for {launch.kernel}")
        total = launch.work * launch.programs
        rows[launch] = dict(phase=launch.phase, kernel=launch.name, n=1, programs=launch.programs, steps=launch.steps,
                            products=f["products"] if f else "torch", spill_stores=f["spill_stores"] if f else 0,
                            config=fla_kernels.config_key(f["config"]) if f and "config" in f else "",
                            gflop=total.flops / 1e9, fp32_gflop=total.fp32 / 1e9, gbytes=total.bytes / 1e9,
                            **terms(launch, f, m))
    out = list(rows.values())
    ms = {p: sum(r["n"] * r["time"] for r in out if p in ("all", r["phase"])) * 1e3 for p in ("all", "fwd", "bwd")}
    return {"rows": out, "total_ms": ms["all"], "forward_ms": ms["fwd"], "backward_ms": ms["bwd"]}


def kernel_flops(launches: list[Launch]) -> dict[str, float]:
    """FLOPs of every kernel over the launches (one forward+backward): what
    ``gpu_check`` divides a kernel's measured time by for its achieved rate,
    by the name the profiler gives it (a variant's, ``name[variant]``, is its
    kernel's)."""
    out: dict[str, float] = {}
    for launch in launches:
        if launch.kernel:
            name = kernel_of(launch.kernel)
            out[name] = out.get(name, 0.0) + launch.programs * launch.work.flops
    return out


def shape_of(ctx, H_qk: int, HV: int, K: int, V: int) -> Shape:
    """The model's shape for a one-rank context: its tokens, chunks, documents
    and the chunks of its longest document."""
    return Shape(T=ctx.n_tokens, H=H_qk, HV=HV, K=K, V=V, NC=ctx.index.n_chunks, fragments=ctx.index.n_frag,
                 longest=ctx.index.max_frag_chunks)


# ---------------------------------------------------------------- shapes

@dataclass(frozen=True)
class Shape:
    T: int = 32768
    H: int = 16  # H_qk
    HV: int = 32
    K: int = 128
    V: int = 128
    C: int = 64
    NC: int = 512  # chunks
    fragments: int = 1  # walks (documents on one rank)
    longest: int = 0  # chunks of the longest fragment (0: NC / fragments, documents of equal length)

    @property
    def chunks_per_fragment(self) -> int:
        """The steps of a walk: the longest fragment's chunks (every walk
        program of a launch waits for the longest)."""
        return self.longest or -(-self.NC // self.fragments)


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


def our_programs(save_mode: str = "light", K: int = 128, segmented: bool = False) -> dict[str, tuple[str, ...]]:
    """The programs of one forward and one backward under ``save_mode`` at key
    head ``K``, with intra-rank segments when ``segmented``."""
    fused = walks_with_output(OptionsKcp(save_mode=save_mode), K)
    fwd, bwd = FORWARD_PROGRAMS[fused], RECOMPUTED[save_mode] + BACKWARD_PROGRAMS
    if not segmented:
        return {"fwd": fwd, "bwd": bwd}

    def with_phases(names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(x for name in names for x in (*SEGMENT_PHASES.get(name, ()), name))

    walk = next(name for name in fwd if name in SEGMENT_PHASES)  # the forward's phases run right after prep
    fwd = (fwd[0], *SEGMENT_PHASES[walk], *fwd[1:])
    bwd = with_phases(bwd) if RECOMPUTED[save_mode] else ("segment_summary", *with_phases(bwd))
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

EXP_OPS = 9
"""fp32-pipe ops per exponential: a multiply by log2(e), then MUFU.EX2, which
issues 16 a clock per SM against 128 fp32 FMAs on sm_90 (CUDA C++
programming guide, arithmetic instruction throughput). KDA's decays are per
key channel, elementwise work the size of the products' operands, so both
sides' KDA rows count them (:data:`DECAY_OPS`, :data:`PAIR_OPS`); GDN's (one
gate a row) stay uncounted, as the calibration rows were."""
DECAY_OPS = EXP_OPS + 2
"""fp32 ops per element of a per-channel decay ``x exp(G)``: the cumsum's
add, the exponential, the product."""
PAIR_OPS = 5 + EXP_OPS
"""fp32 ops per (row i, row j, channel d) of our exact pairs inside a
sub-chunk (``kernels/triton/channel.py``: ``a_id b_jd exp(Γ_id - Γ_jd)``):
the masked segment cumsum (select, add), the exponential, two products, the
mask and the sum over d."""
PULL_OPS = PAIR_OPS + 4
"""The same per triple for the pairs' two gradients (``channel_pulls``): one
exponential, then a product pair, a sum and a select for the second side."""


def our_kda_launches(s: Shape, e: Mapping[str, int], save_mode: str = "light", pair_ops: float = PAIR_OPS,
                     pull_ops: float = PULL_OPS) -> list[Launch]:
    """Every Triton launch of one KDA forward and backward (``chunk_kda``'s host
    path, a gate per key channel, the programs of :func:`our_programs`, each
    at its ``[channel]`` configuration) under ``save_mode``, one segment per
    fragment. The intra-chunk products go through sub-chunk anchors: per
    chunk ``NB - 1`` products of ``[C, C]`` over K under tf32
    (``kernels.precision.channel_mode``), the pairs inside each sub-chunk of
    ``SUB`` rows elementwise (``pair_ops``, ``pull_ops`` an (i, j, d) triple:
    :data:`PAIR_OPS`, :data:`PULL_OPS`), exact for any gate."""
    C, K, V, HV, NC = s.C, s.K, s.V, s.HV, s.NC
    SUB, BW, n = SUB_ROWS, walk_block(V), BF16
    NB, NW, F, steps = C // SUB, -(-V // BW), s.fragments, s.chunks_per_fragment
    qk = 2 * C * K * n + 2 * C * e["q_rstd"]
    g = C * K * n  # a chunk's gates, one per key channel
    anchored = (NB - 1) * 2 * C * C * K  # the pairs across sub-chunks: one [C, C] product over K per anchor
    pairs = C * SUB * K  # the (i, j, d) triples inside the sub-chunks

    def products(**extra: float) -> Work:  # channel_products: the anchored products, the pairs, NB decays
        return Work(tf32=anchored, fp32=pairs * pair_ops + NB * C * K * DECAY_OPS) + Work(**extra)

    def pulls() -> Work:  # channel_pulls over K: both sides' anchored products, the pairs' gradients, NB decays
        return Work(tf32=2 * anchored, fp32=pairs * pull_ops + NB * C * K * DECAY_OPS)

    def wy_inverse(phase: str) -> list[Launch]:
        solve, step = inverse_work(C)
        work = products(bytes=C * K * n + C * e["k_rstd"] + C * n + g + C * C * e["A"]) + solve
        return [Launch(phase, "channel_wy_inverse_kernel", NC * HV, work, INVERSE_STEPS, step)]

    def w_u(phase: str) -> list[Launch]:
        work = Work(bf16=2 * C * C * K + 2 * C * C * V, fp32=C * K * DECAY_OPS,
                    bytes=C * C * e["A"] + C * K * n + C * e["k_rstd"] + C * n + g + C * V * n
                    + C * K * e["w"] + C * V * e["v_new"])
        return [Launch(phase, "prep_kernel[channel]", NC * HV, work)]

    def tape_walk(phase: str) -> list[Launch]:
        step = Work(bf16=2 * (2 * C * K * BW), fp32=C * K * DECAY_OPS,
                    bytes=C * K * n + C * e["k_rstd"] + g + C * K * e["w"] + 2 * C * BW * e["v_new"]
                    + K * BW * e["h"])
        return [walk(phase, "tape_walk_kernel[channel]", F * HV * NW, steps, step)]

    def scores(phase: str) -> list[Launch]:  # one program per chunk and value head (its own gates)
        return [Launch(phase, "channel_scores_kernel", NC * HV, products(bytes=qk + g + C * C * e["scores"]))]

    def walk_output(phase: str) -> list[Launch]:  # q and the state's rows decay per channel
        step = Work(bf16=3 * (2 * C * K * BW) + 2 * C * C * BW, fp32=2 * C * K * DECAY_OPS,
                    bytes=qk + g + C * K * e["w"] + C * BW * e["v_new"] + C * C * e["scores"] + C * BW * n)
        return [walk(phase, "walk_output_kernel[channel]", F * HV * NW, steps, step)]

    def output(phase: str) -> list[Launch]:
        work = products(bf16=2 * C * K * V + 2 * C * C * V, fp32=C * K * DECAY_OPS,
                        bytes=qk + g + K * V * e["h"] + C * V * e["v_new"] + C * V * n)
        return [Launch(phase, "output_kernel[channel]", NC * HV, work)]

    def bwd_local_dv(phase: str) -> list[Launch]:
        work = products(bf16=2 * C * C * V, bytes=qk + g + C * V * n + C * V * e["dv_new"])
        return [Launch(phase, "bwd_local_dv_kernel[channel]", NC * HV, work)]

    def adjoint_walk(phase: str) -> list[Launch]:
        step = Work(bf16=4 * (2 * C * K * BW), fp32=2 * C * K * DECAY_OPS,
                    bytes=qk + g + C * K * e["w"] + C * BW * n + 2 * C * BW * e["dv_new"] + K * BW * e["dh"])
        return [walk(phase, "adjoint_walk_kernel[channel]", F * HV * NW, steps, step)]

    def bwd_dqkwg(phase: str) -> list[Launch]:  # dO Vn^T, the state terms, the score terms by channel_pulls
        work = pulls() + Work(bf16=2 * C * C * V + 3 * (2 * C * K * V), fp32=2 * C * K * DECAY_OPS,
                              bytes=g + C * V * (n + e["v_new"] + e["dv_new"]) + K * V * (e["h"] + e["dh"]) + qk
                              + C * K * (e["dq_heads"] + e["dk_heads"] + e["dw"] + e["dgcum"]))
        return [Launch(phase, "bwd_dqkwg_kernel[channel]", NC * HV, work)]

    def bwd_wy(phase: str) -> list[Launch]:
        # the value pass (A^T dU, dU (beta V)^T), dW (beta exp(G) K)^T, A^T dA A^T, A^T dW; dL's pulls
        work = pulls() + Work(bf16=2 * C * C * (2 * K + 2 * V + 2 * C), fp32=2 * C * K * DECAY_OPS,
                              bytes=C * n + g + C * C * e["A"] + C * K * n + C * e["k_rstd"] + C * K * e["dw"]
                              + C * V * n + C * V * e["dv_new"] + 2 * C * K * e["dk_heads"] + 2 * C * K * e["dgcum"]
                              + C * V * n + C * n)
        return [Launch(phase, "bwd_wy_kernel[channel]", NC * HV, work)]

    def bwd_gate_cumsum(phase: str) -> list[Launch]:
        return [Launch(phase, "bwd_gate_cumsum_channel_kernel", NC * HV, Work(bytes=C * K * (e["dgcum"] + n)))]

    by_name = {"prep": lambda phase: [*norm_launches(phase, s, e), *wy_inverse(phase), *w_u(phase)], "w_u": w_u,
               "tape_walk": tape_walk, "output": output, "scores": scores, "walk_output": walk_output,
               "bwd_local_dv": bwd_local_dv, "adjoint_walk": adjoint_walk, "bwd_dqkwg": bwd_dqkwg, "bwd_wy": bwd_wy,
               "bwd_gate_cumsum": bwd_gate_cumsum,
               "bwd_qk_norm": lambda phase: norm_backward_launches(phase, s, e, "[channel]")}
    phases = our_programs(save_mode, K)
    return [launch for phase, names in phases.items() for name in names for launch in by_name[name](phase)]


def plan_p(ctx, s: Shape) -> int:
    """The intra-rank segments the default options run at (``gdn_kcp.plan``)."""
    return plan_segments(ctx, s.HV, s.K, s.V)


def walk_latency(facts: Mapping[str, Mapping], P: int, m: Machine = H200, s: Shape | None = None) -> float:
    """Estimated time (s) of the forward's walk at P segments: the plan's
    launches (:func:`gdn_kcp.plan.walk_launches`) with these compile facts."""
    s = s or Shape()
    launches = walk_launches(P, chunks=s.chunks_per_fragment, frags=s.fragments, HV=s.HV, K=s.K, V=s.V)
    return sum(terms(launch, facts[launch.kernel], m)["time"] for launch, _ in launches)


STEPS_ALONE = "HV=32, steps alone"
"""The walk-over-P table's column of the full shape with no bandwidth limit."""


def walk_latency_table(facts: Mapping[str, Mapping], m: Machine = H200, Ps=(1, 2, 4, 8, 16),
                       heads=(32, 4)) -> list[dict]:
    """The forward walk's estimated time (us) over P at the full shape with HV
    = 32 (the tape walk already HBM-bound: segments only add reads) and with
    HV = 4 (8 programs, each bound by its SM's bandwidth: segments spread them
    over more SMs); and, column :data:`STEPS_ALONE`, at HV = 32 on a machine
    without any bandwidth limit, where a walk step costs its latency and its
    tensor work at one SM's rates: P = 1 stays the best there too, since
    segments triple the walk's program-steps (phase 1 folds V + K columns,
    phase 3 walks again) while the idle SMs add at most 132 / 64 of tensor
    throughput."""
    unbound = replace(m, hbm=math.inf, sm_bytes_per_clock=math.inf)
    rows = []
    for P in Ps:
        row = {"P": P}
        for HV in heads:
            row[f"HV={HV}"] = walk_latency(facts, P, m, replace(Shape(), HV=HV, H=min(Shape().H, HV))) * 1e6
        row[STEPS_ALONE] = walk_latency(facts, P, unbound) * 1e6
        rows.append(row)
    return rows


WALK_KERNELS = ("walk_output_kernel", "segment_summary_kernel", "compose_segments_kernel")
"""The kernels of the forward's walk at P segments."""


# ---------------------------------------------------------------- counterparts

COUNTERPARTS = {
    ("l2_rstd_kernel",): ("l2norm_fwd_kernel",),
    ("wy_inverse_kernel",): ("chunk_gated_delta_rule_fwd_kkt_solve_kernel",),
    ("prep_kernel",): ("recompute_w_u_fwd_kernel",),
    ("scores_kernel", "walk_output_kernel", "tape_walk_kernel"): ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
                                                                  "chunk_fwd_kernel_o"),
    ("output_kernel",): ("chunk_fwd_kernel_o",),
    ("bwd_local_dv_kernel",): ("chunk_bwd_kernel_dv_local",),
    ("adjoint_walk_kernel",): ("chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",),
    ("bwd_dqkwg_kernel",): ("chunk_bwd_kernel_dqkwg",),
    ("bwd_wy_kernel",): ("prepare_wy_repr_bwd_kernel",),
    ("bwd_qk_norm_kernel",): ("l2norm_bwd_kernel",),
    ("bwd_gate_cumsum_kernel",): ("chunk_local_cumsum_scalar_kernel",),
}
"""FLA's kernels that do the work of ours (prep: the WY inverse and W, U; ours
sums the gates inside each program): ``gpu_check`` reports FLA's time over
ours per pair, each side summed over its kernels' launches. Our forward that
keeps no tape runs the scores and the walk with the output where FLA runs its
state walk and its output, and both backwards walk the states again (our tape
walk, FLA's state walk), so those five count as one pair (the output kernel's
pair then holds under ``save_mode="full"`` only). The profiler names FLA's
forward and reverse gate cumsums alike, so the cumsum pair holds both against
our one backward launch (a few microseconds either way). The pairs are for a
forward that walks with the output (``gpu_check`` runs the defaults): under
``save_mode="full"`` the walk group holds our forward's tape walk alone, and
FLA's output kernel counts in two pairs."""

# ---------------------------------------------------------------- FLA (fla-core 0.5.1)

FLA_DEFAULT_CONFIGS = {label: spec.configs[0] for label, spec in fla_kernels.FLA_KERNELS.items()}
"""A configuration of each FLA kernel where no facts pick one (FLOP counts:
only the output kernel's value tile changes them)."""


def fla_kernel_launches(s: Shape, label: str, config: Mapping) -> list[Launch]:
    """The launches of one FLA kernel in a forward+backward, at ``config`` (its
    block sizes change the programs and the bytes: the walks' and the output's
    value tile, the l2norm's rows per program)."""
    C, K, V, HV, H, NC, n = s.C, s.K, s.V, s.HV, s.H, s.NC, BF16
    docs, per_doc = s.fragments, s.chunks_per_fragment
    rows = s.T * H  # rows of q or k for the L2 norm
    if label in ("l2norm_fwd_kernel", "l2norm_bwd_kernel"):
        BT, tiles = config["BT"], (2 if label == "l2norm_fwd_kernel" else 3)  # x, y / y, dy, dx
        phase = "fwd" if label == "l2norm_fwd_kernel" else "bwd"
        return [Launch(phase, label, -(-rows // BT), Work(fp32=2 * BT * K, bytes=BT * (tiles * K * n + F32)))] * 2
    if label == "chunk_local_cumsum_scalar_kernel":
        return [Launch("fwd", label, NC * HV, Work(bytes=C * (n + F32)))]
    if label == "chunk_local_cumsum_scalar_kernel[reverse]":
        return [Launch("bwd", label, NC * HV, Work(bytes=2 * C * F32))]
    if label == "chunk_gated_delta_rule_fwd_kkt_solve_kernel":
        BC = 16
        solve_steps = 4 * (BC - 2)  # four diagonal blocks, rows 2 .. BC - 1 each
        return [Launch("fwd", label, NC * HV,
                       Work(bf16=10 * 2 * BC * BC * K, tf32=16 * 2 * BC**3, fp32=solve_steps * SOLVE_OPS * BC * BC,
                            bytes=C * K * n + C * (F32 + n) + 10 * BC * BC * n),
                       solve_steps, Work(fp32=SOLVE_OPS * BC * BC))]
    if label == "recompute_w_u_fwd_kernel":
        w_u = Work(bf16=2 * C * C * (K + V), bytes=C * C * n + C * (n + F32) + 2 * C * V * n + 2 * C * K * n)
        return [Launch(phase, label, NC * HV, w_u) for phase in ("fwd", "bwd")]
    if label == "chunk_gated_delta_rule_fwd_kernel_h_blockdim64":
        BV = config["BV"]
        step = Work(bf16=2 * (2 * C * K * BV), bytes=K * BV * n + 2 * C * K * n + 2 * C * BV * n + C * F32)
        return [walk(phase, label, docs * HV * -(-V // BV), per_doc, step) for phase in ("fwd", "bwd")]
    if label == "chunk_fwd_kernel_o":
        BV = config["BV"]
        return [Launch("fwd", label, NC * HV * -(-V // BV),
                       Work(bf16=2 * C * C * K + 2 * C * K * BV + 2 * C * C * BV,
                            bytes=2 * C * K * n + K * BV * n + C * F32 + 2 * C * BV * n))]
    if label == "chunk_bwd_kernel_dv_local":
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=2 * C * C * K + 2 * C * C * V, bytes=2 * C * K * n + C * F32 + 2 * C * V * n))]
    if label == "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64":
        BV = config["BV"]
        step = Work(bf16=3 * (2 * C * K * BV), bytes=K * BV * n + C * F32 + 3 * C * BV * n + 3 * C * K * n)
        return [walk("bwd", label, docs * HV * -(-V // BV), per_doc, step)]
    if label == "chunk_bwd_kernel_dqkwg":
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=2 * C * C * V + 3 * (2 * C * K * V) + 2 * (2 * C * C * K),
                            bytes=3 * C * V * n + 2 * K * V * n + 2 * C * K * n + 3 * C * K * n + 2 * C * F32))]
    if label == "prepare_wy_repr_bwd_kernel":
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=2 * C * C * (5 * K + 2 * V + 2 * C),
                            bytes=2 * C * K * n + 3 * C * V * n + C * K * n + C * C * n + 2 * C * n + 2 * C * F32))]
    raise KeyError(label)


def fla_torch_ops(s: Shape) -> list[Launch]:
    """FLA 0.5.1's torch ops between its kernels (bytes read and written)."""
    K, HV, H, n = s.K, s.HV, s.H, BF16

    def op(phase: str, label: str, nbytes: int) -> Launch:
        return Launch(phase, None, 1, Work(bytes=nbytes), label=f"torch: {label}")

    gva = [op("bwd", f"{name} GVA sum", (HV * K + H * K) * s.T * n) for name in ("dq", "dk", "dk2")] if HV != H else []
    return [op("fwd", "A = zeros", s.T * HV * s.C * n), *gva,
            op("bwd", "dg sum over K blocks", 2 * s.T * HV * F32),
            op("bwd", "dk += dk2", 3 * s.T * H * K * n), op("bwd", "dg += dg2", 3 * s.T * HV * F32),
            op("bwd", "dg to bf16", s.T * HV * (F32 + n))]


def fla_launches(s: Shape, configs: Mapping[str, Mapping] | None = None) -> list[Launch]:
    """Every launch of FLA's forward+backward (fla-core 0.5.1), each kernel at
    ``configs[label]`` (default: the first of its list)."""
    configs = {**FLA_DEFAULT_CONFIGS, **(configs or {})}
    kernels = [launch for label in fla_kernels.FLA_KERNELS for launch in fla_kernel_launches(s, label, configs[label])]
    return kernels + fla_torch_ops(s)


def best_fla_facts(s: Shape, fla_facts: Mapping[str, Mapping[str, Mapping]], m: Machine = H200,
                   kernel_launches: Callable[[Shape, str, Mapping], list[Launch]] = fla_kernel_launches
                   ) -> dict[str, dict]:
    """Each FLA kernel's compile facts at the configuration of its list with
    the least modelled time at shape ``s`` (summed over its launches, which
    ``kernel_launches`` gives: GDN's by default, :func:`fla_kda_kernel_launches`
    for KDA's), among those that can launch (shared memory within a block's
    ``SHARED_MEMORY_LIMIT``: the autotuner prunes the others)."""
    best = {}
    for label, by_config in fla_facts.items():
        def cost(facts: Mapping) -> float:
            return sum(terms(launch, facts, m)["time"] for launch in kernel_launches(s, label, facts["config"]))
        best[label] = min((f for f in by_config.values() if f["shared"] <= SHARED_MEMORY_LIMIT), key=cost)
    return best


def fla_estimate(s: Shape, fla_facts: Mapping[str, Mapping[str, Mapping]], m: Machine = H200,
                 kernel_launches: Callable[[Shape, str, Mapping], list[Launch]] = fla_kernel_launches,
                 launches: Callable[[Shape, Mapping], list[Launch]] = fla_launches) -> dict:
    """FLA's estimate at shape ``s``, every kernel at its best configuration
    (GDN's launches by default; KDA's: :func:`fla_kda_estimate`)."""
    best = best_fla_facts(s, fla_facts, m, kernel_launches)
    return estimate(launches(s, {label: f["config"] for label, f in best.items()}), best, m)


# ---------------------------------------------------------------- FLA KDA (fla-core 0.5.1 chunk_kda)

FLA_KDA_DEFAULT_CONFIGS = {label: spec.configs[0] for label, spec in fla_kernels.FLA_KDA_KERNELS.items()}
"""A configuration of each FLA KDA kernel where no facts pick one."""

KDA_SUB_CHUNK = 16
"""``BC``: the sub-chunk of KDA's intra-chunk kernels (16 rows; 4 to a chunk of 64)."""


def fla_kda_kernel_launches(s: Shape, label: str, config: Mapping) -> list[Launch]:
    """The launches of one kernel of FLA 0.5.1's ``chunk_kda`` forward+backward
    (:data:`fla_kernels.FLA_KDA_KERNELS`) at ``config`` (the walks', the
    output's and the cumsum's tiles, the token-parallel kernel's heads per
    program, the l2norm's rows change the programs and the bytes). FLOPs: 2 m
    n k per product each program computes; a contraction a kernel computes
    elementwise on [rows, K] tiles (the token-parallel diagonal blocks, the
    intra backward's diagonal blocks) counts the same, at fp32; and, as ours
    (:func:`our_kda_launches`), every per-channel decay ``x exp(g)`` at
    :data:`DECAY_OPS` fp32 ops an element (each kernel's count of the tiles it
    decays, from its code). Where a
    program's work depends on its place in the chunk (the token-parallel and
    the intra backward kernels), the work is the programs' mean."""
    C, K, V, HV, H, NC, n = s.C, s.K, s.V, s.HV, s.H, s.NC, BF16
    G, BC = HV // H, KDA_SUB_CHUNK
    NS = C // BC  # sub-chunks per chunk
    docs, per_doc = s.fragments, s.chunks_per_fragment
    rows = s.T * H  # rows of q or k for the L2 norm
    if label == "l2norm_fwd_kernel":  # GDN's: q and k
        return fla_kernel_launches(s, label, config)
    if label == "l2norm_bwd_kernel[fp32 dy]":  # y, dx bf16; dy fp32 (dq / dk summed in fp32); rstd
        BT = config["BT"]
        return [Launch("bwd", label, -(-rows // BT), Work(fp32=2 * BT * K, bytes=BT * (2 * K * n + K * F32 + F32)))] * 2
    if label in ("chunk_local_cumsum_vector_kernel", "chunk_local_cumsum_vector_kernel[reverse]"):
        BS = config["BS"]  # a [C, BS] tile per program: bf16 g in, fp32 out / fp32 dg in and out
        reverse = label.endswith("[reverse]")
        return [Launch("bwd" if reverse else "fwd", label, -(-K // BS) * NC * HV,
                       Work(bytes=C * BS * ((F32 if reverse else n) + F32)))]
    if label == "chunk_kda_fwd_kernel_intra_token_parallel":
        # A program per token and BH value heads: for each earlier token j of its sub-chunk and itself (J on
        # average), two K-long dot products per head (Aqk and Akk entries); it reads its own q, k, g rows and
        # beta, k and g rows of the J - 1 earlier tokens, and writes J entries of Aqk (bf16) and Akk (fp32).
        heads = min(config["BH"], HV)
        qk_heads = -(-heads // G)  # the key heads its value heads share
        J = (BC + 1) / 2
        return [Launch("fwd", label, s.T * -(-HV // heads),
                       Work(fp32=J * 2 * (2 * heads * K) + J * heads * K * DECAY_OPS,  # exp(g_i - g_j) k_j
                            bytes=2 * qk_heads * K * n + heads * (K * F32 + n)
                            + (J - 1) * (qk_heads * K * n + heads * K * F32) + J * heads * (n + F32)))]
    if label == "chunk_kda_fwd_kernel_inter_solve_fused":
        # Off-diagonal blocks: Aqk and Akk per pair of sub-chunks (fp32 operands: tf32 products); the
        # substitution on the NS diagonal blocks (rows 2 .. BC - 1); the merge, d + 1 products of BC^3 for each
        # block d below the diagonal (16 at NS = 4, tf32).
        pairs, solve_steps = NS * (NS - 1) // 2, NS * (BC - 2)
        merges = sum((NS - d) * (d + 1) for d in range(1, NS))
        return [Launch("fwd", label, NC * HV,
                       Work(tf32=2 * pairs * 2 * BC * BC * K + merges * 2 * BC**3,
                            fp32=solve_steps * SOLVE_OPS * BC * BC + 9 * BC * K * DECAY_OPS,  # 9 decayed [BC, K] tiles
                            bytes=C * K * n + (C - BC) * K * n + C * K * F32 + NS * BC * BC * F32 + (NS - 1) * BC * n
                            + pairs * BC * BC * n + NS * (NS + 1) // 2 * BC * BC * n),
                       solve_steps, Work(fp32=SOLVE_OPS * BC * BC))]
    if label in ("recompute_w_u_fwd_kda_kernel", "recompute_w_u_fwd_kda_kernel[qg]"):
        # A (bf16) times beta V and beta exp(g) K; reads beta, A, v, k, g; writes u, w, kg (and qg from q)
        qg = label.endswith("[qg]")
        w_u = Work(bf16=2 * C * C * (K + V), fp32=(3 if qg else 2) * C * K * DECAY_OPS,
                   bytes=C * n + C * C * n + 2 * C * V * n + C * K * (n + F32) + 2 * C * K * n
                   + (2 * C * K * n if qg else 0))
        return [Launch("bwd" if qg else "fwd", label, NC * HV, w_u)]
    if label == "chunk_gated_delta_rule_fwd_kernel_h_blockdim64[gk]":
        # per step: h out, W S, K^T V; reads w, kg (K columns), u, the gate's last row (fp32); writes v_new
        BV = config["BV"]
        step = Work(bf16=2 * (2 * C * K * BV), fp32=K * DECAY_OPS,  # the state's rows decay by exp(g_last)
                    bytes=K * BV * n + 2 * C * K * n + 2 * C * BV * n + K * F32)
        return [walk(phase, label, docs * HV * -(-V // BV), per_doc, step) for phase in ("fwd", "bwd")]
    if label == "chunk_gla_fwd_kernel_o":
        # (q exp(g)) S and Aqk V per value tile; reads q, g (fp32), h, Aqk, v_new; writes o
        BV = config["BV"]
        return [Launch("fwd", label, NC * HV * -(-V // BV),
                       Work(bf16=2 * C * K * BV + 2 * C * C * BV, fp32=C * K * DECAY_OPS,
                            bytes=C * K * (n + F32) + K * BV * n + C * C * n + 2 * C * BV * n))]
    if label == "chunk_kda_bwd_kernel_dAv":
        # dO Vn^T and Aqk^T dO; reads Aqk, v_new, do; writes dv (bf16) and dAqk (fp32)
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=2 * (2 * C * C * V), bytes=C * C * n + 3 * C * V * n + C * C * F32))]
    if label == "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64[gk]":
        # per step: dh out; K dS, qg^T dO, W^T dV; reads do, dv, kg, qg, w, the gate's last row; writes dv2
        BV = config["BV"]
        step = Work(bf16=3 * (2 * C * K * BV), fp32=K * DECAY_OPS,
                    bytes=K * BV * n + K * F32 + 3 * C * BV * n + 3 * C * K * n)
        return [walk("bwd", label, docs * HV * -(-V // BV), per_doc, step)]
    if label == "chunk_kda_bwd_kernel_wy_dqkg_fused":
        # dO S^T, Vn dS, dV S^T (dq, dk, dw) over K x V; dV V^T and A dV (dA, du: its first key tile);
        # dW kg^T and A dW over K; dA's two products with A
        return [Launch("bwd", label, NC * HV,
                       Work(bf16=3 * (2 * C * K * V) + 2 * (2 * C * C * V) + 2 * (2 * C * C * K) + 2 * (2 * C**3),
                            fp32=2 * C * K * DECAY_OPS,
                            bytes=C * n + C * C * n + C * K * (2 * n + F32) + 3 * C * K * F32 + 2 * K * V * n
                            + 5 * C * V * n + C * C * F32 + C * F32))]
    if label == "chunk_kda_bwd_kernel_intra":
        # A program per sub-chunk and key tile BK: dAqk, dAkk (fp32) times the gated k of each earlier sub-chunk
        # and, transposed, the gated q and beta k of each later one (NS - 1 in all: tf32 products); the two
        # diagonal blocks elementwise (fp32); reads its own g, q, k, beta, dq, dk, dg, writes dq2, dk2, dg2,
        # db; the earlier sub-chunks' k, g and the later ones' q, k, g, beta and their dA blocks (the mean:
        # (NS - 1) / 2 of each)
        BK = min(32, 1 << (K - 1).bit_length())
        block = 2 * BC * BC * BK
        others = (NS - 1) / 2 * (BC * BK * (n + F32) + BC * BK * (2 * n + F32) + BC * n + 2 * 2 * BC * BC * F32)
        return [Launch("bwd", label, -(-K // BK) * NS * NC * HV,
                       Work(tf32=(NS - 1) * 2 * block,
                            fp32=2 * 2 * block + (2 * BC * BC * BK + (NS - 1) * BC * BK + 1.5 * BC * BK) * DECAY_OPS,
                            bytes=BC * BK * (F32 + 2 * n) + BC * n + 6 * BC * BK * F32 + BC * F32 + 2 * BC * BC * F32
                            + others))]
    raise KeyError(label)


def fla_kda_torch_ops(s: Shape) -> list[Launch]:
    """FLA 0.5.1's torch ops between ``chunk_kda``'s kernels (bytes read and
    written): the zeroed Akk and o, the intra backward's db partials (one per
    key tile of 32) summed and added to the fused kernel's, the GVA sums of dq
    and dk (fp32), and the casts of dg and db to the bf16 inputs' dtype."""
    T, K, V, HV, H, n = s.T, s.K, s.V, s.HV, s.H, BF16
    NK = -(-K // min(32, 1 << (K - 1).bit_length()))

    def op(phase: str, label: str, nbytes: int) -> Launch:
        return Launch(phase, None, 1, Work(bytes=nbytes), label=f"torch: {label}")

    gva = [op("bwd", f"{name} GVA sum", (HV + H) * K * T * F32) for name in ("dq", "dk")] if HV != H else []
    return [op("fwd", "Akk = zeros", T * HV * s.C * n), op("fwd", "o = zeros", T * HV * V * n),
            op("bwd", "db sum over K blocks", (NK + 1) * T * HV * F32), op("bwd", "db += db2", 3 * T * HV * F32),
            *gva, op("bwd", "dg to bf16", T * HV * K * (F32 + n)), op("bwd", "db to bf16", T * HV * (F32 + n))]


def fla_kda_launches(s: Shape, configs: Mapping[str, Mapping] | None = None) -> list[Launch]:
    """Every launch of FLA's ``chunk_kda`` forward+backward (fla-core 0.5.1),
    each kernel at ``configs[label]`` (default: the first of its list)."""
    configs = {**FLA_KDA_DEFAULT_CONFIGS, **(configs or {})}
    kernels = [launch for label in fla_kernels.FLA_KDA_KERNELS
               for launch in fla_kda_kernel_launches(s, label, configs[label])]
    return kernels + fla_kda_torch_ops(s)


def best_fla_kda_facts(s: Shape, fla_kda_facts: Mapping[str, Mapping[str, Mapping]],
                       m: Machine = H200) -> dict[str, dict]:
    """:func:`best_fla_facts` for KDA's kernels (``facts["fla_kda"]``)."""
    return best_fla_facts(s, fla_kda_facts, m, fla_kda_kernel_launches)


def fla_kda_estimate(s: Shape, fla_kda_facts: Mapping[str, Mapping[str, Mapping]], m: Machine = H200) -> dict:
    """FLA ``chunk_kda``'s estimate at shape ``s``, every kernel at its best
    configuration (``fla_kda_facts``: ``facts["fla_kda"]``)."""
    return fla_estimate(s, fla_kda_facts, m, fla_kda_kernel_launches, fla_kda_launches)


# ---------------------------------------------------------------- compile facts

def source_digest() -> str:
    """sha256 of our Triton kernels' code and launch configs (what our compile
    facts depend on): each file's syntax tree without its docstrings, so a
    docstring or a comment changes nothing."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "kernels" / "triton").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        digest.update(path.name.encode() + ast.dump(tree).encode())
    return digest.hexdigest()[:16]


def load_facts(path: Path = FACTS_FILE) -> dict:
    """The committed compile facts: ``{"ours": {kernel: facts}, "fla": {kernel:
    {config: facts}}, "triton": ..., "fla_version": ..., "ours_digest": ...}``."""
    return json.loads(path.read_text())


def warn_if_stale(facts: Mapping) -> None:
    """Warn (stderr) when ``facts`` were compiled from other kernel sources
    than these: its estimates of ours are then of other kernels."""
    if facts["ours_digest"] != source_digest():
        progress(f"warning: {FACTS_FILE.name} was compiled from other kernel sources: run --refresh-facts")


def refresh_facts(fla_site: str | None, path: Path = FACTS_FILE) -> dict:
    """Compile ours (``compile_specs.report``) and every configuration of FLA's
    kernels (GDN's, and KDA's under ``"fla_kda"``) for sm_90 and write them to
    ``path``."""
    import triton
    from gdn_kcp.kernels.triton.compile_specs import report

    progress(f"compiling our kernels for sm_90 with triton {triton.__version__} ...")
    rows = report(90, 128, 128)
    if any(r["registers"] == 0 for r in rows):
        raise RuntimeError("ptxas logged nothing: run with a fresh TRITON_CACHE_DIR")
    progress("compiling every configuration of FLA's kernels for sm_90 ...")
    fla = fla_kernels.compile_facts(fla_site, progress=progress)
    progress("compiling every configuration of FLA's KDA kernels for sm_90 ...")
    kda_table = fla_kernels.FLA_KDA_KERNELS
    # a kernel both tables hold (the l2norm) is GDN's facts: compiled again, it hits the cache and ptxas logs nothing
    shared = {label for label, spec in kda_table.items() if fla_kernels.FLA_KERNELS.get(label) is spec}
    fla_kda = fla_kernels.compile_facts(fla_site, [label for label in kda_table if label not in shared],
                                        progress=progress, table=kda_table)
    fla_kda = {label: fla[label] if label in shared else fla_kda[label] for label in kda_table}
    if any(f["registers"] == 0 for table in (fla, fla_kda) for by_config in table.values()
           for f in by_config.values()):
        raise RuntimeError("ptxas logged nothing for an FLA kernel: run with a fresh TRITON_CACHE_DIR")
    facts = {"triton": triton.__version__, "fla_version": fla_kernels.fla_version(fla_site),
             "ours_digest": source_digest(), "ours": {r["kernel"]: r for r in rows}, "fla": fla,
             "fla_kda": fla_kda}
    path.write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n")
    return facts


# ---------------------------------------------------------------- calibration

@dataclass(frozen=True)
class Measured:
    """One measured time: a shape (one sequence of T tokens, K = V) and a phase."""

    H: int
    HV: int
    T: int
    phase: str  # "forward" / "backward"
    ms: float
    K: int = 128

    @property
    def shape(self) -> Shape:
        """The model's shape of this measurement."""
        return model_shape(self.T, 1, self.H, self.HV, self.K, self.K)


CALIBRATION = (
    Measured(16, 32, 32768, "forward", 1.890), Measured(16, 32, 32768, "backward", 5.697),
    Measured(16, 32, 8192, "forward", 0.472), Measured(16, 32, 8192, "backward", 1.444),
    Measured(2, 8, 32768, "forward", 0.902), Measured(4, 8, 32768, "backward", 2.743),
)
"""FLA 0.5.1 on one H200 (CUDA graphs, bf16, K = V = 128, chunk 64, one
sequence), from the FlashQLA authors' published benchmark: the rows the model
is fitted to."""


def model_shape(T: int, docs: int, H: int, HV: int, K: int = 128, V: int = 128) -> Shape:
    """``T`` tokens in ``docs`` documents of lengths as equal as can be."""
    lengths = [T // docs + (i < T % docs) for i in range(docs)]
    return Shape(T=T, H=H, HV=HV, K=K, V=V, NC=sum(-(-L // 64) for L in lengths), fragments=docs,
                 longest=-(-max(lengths) // 64))


def error_table(rows: Sequence[Measured], estimate_at: Callable[[Shape], dict]) -> list[dict]:
    """Each measured row with its modelled time (``estimate_at(shape)``: an
    estimate's dict) and the relative error, one estimate per distinct shape
    (a shape's forward and backward rows share it: the fit evaluates this
    about a thousand times)."""
    estimates: dict[Shape, dict] = {}
    out = []
    for row in rows:
        if row.shape not in estimates:
            estimates[row.shape] = estimate_at(row.shape)
        modelled = estimates[row.shape][f"{row.phase}_ms"]
        out.append(dict(asdict(row), model_ms=modelled, error=modelled / row.ms - 1))
    return out


def calibration_table(fla_facts: Mapping, m: Machine = H200, rows: Sequence[Measured] = CALIBRATION) -> list[dict]:
    """Each measured FLA row's (default :data:`CALIBRATION`) measured and
    modelled time and the relative error."""
    return error_table(rows, lambda s: fla_estimate(s, fla_facts, m))


def prediction_table(our_facts: Mapping, m: Machine, rows: Sequence[Measured]) -> list[dict]:
    """Each measured row of ours with our modelled time (the default options
    at its shape) and the relative error: the rows the fit never sees."""
    return error_table(rows, lambda s: estimate(our_shape_launches(s), our_facts, m))


FIT_RANGES = {"memory_efficiency": (0.3, 1.0), "compute_efficiency": (0.1, 1.0), "step_latency": (0.05e-6, 3e-6)}


def fit(fla_facts: Mapping, m: Machine = H200, rows: Sequence[Measured] = CALIBRATION) -> Machine:
    """The three constants of least sum of squared log errors over the
    measured FLA ``rows`` (default :data:`CALIBRATION`; ``m`` gives the
    peaks): a grid of 6 points per constant (log-spaced), then five rounds of
    a golden-section search along each constant in turn. Deterministic, so
    the test can refit and compare."""
    if not rows:
        raise ValueError("fit: no measured rows to fit the constants to")

    def loss(machine: Machine) -> float:
        return sum(math.log1p(r["error"]) ** 2 for r in calibration_table(fla_facts, machine, rows))

    def grid(lo: float, hi: float, n: int) -> list[float]:
        return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]

    names = list(FIT_RANGES)
    best = min((replace(m, **dict(zip(names, values))) for values in
                __import__("itertools").product(*(grid(*FIT_RANGES[k], 6) for k in names))), key=loss)
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(5):
        for name in names:
            lo, hi = (math.log(x) for x in FIT_RANGES[name])
            for _ in range(24):
                a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
                if loss(replace(best, **{name: math.exp(a)})) <= loss(replace(best, **{name: math.exp(b)})):
                    hi = b
                else:
                    lo = a
            candidate = replace(best, **{name: math.exp((lo + hi) / 2)})
            if loss(candidate) < loss(best):
                best = candidate
    return best


# ---------------------------------------------------------------- output

def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def markdown(title: str, result: dict) -> str:
    lines = [f"### {title}", "",
             ("| phase | kernel | n | config | class | spills (B/thr) | programs | steps | GFLOP | GB | "
              "compute (us) | memory (us) | serial (us) | time (us) | n x time (us) |"),
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['phase']} | {r['kernel']} | {r['n']} | {r['config'] or '-'} | {r['products']} | "
                     f"{r['spill_stores']:,} | {r['programs']:,} | {r['steps'] or '-'} | {r['gflop']:.1f} | "
                     f"{r['gbytes']:.3f} | {r['compute'] * 1e6:.0f} | {r['memory'] * 1e6:.0f} | "
                     f"{r['serial'] * 1e6:.0f} | {r['time'] * 1e6:.0f} | {r['n'] * r['time'] * 1e6:.0f} |")
    lines.append(f"\nTotal {result['total_ms']:.2f} ms (forward {result['forward_ms']:.2f}, "
                 f"backward {result['backward_ms']:.2f}).")
    return "\n".join(lines)


def calibration_markdown(table: list[dict]) -> str:
    lines = ["| H_qk | HV | T | FLA | measured (ms) | model (ms) | error |", "|---:|---:|---:|---|---:|---:|---:|"]
    for r in table:
        lines.append(f"| {r['H']} | {r['HV']} | {r['T']} | {r['phase']} | {r['ms']:.3f} | {r['model_ms']:.3f} | "
                     f"{r['error']:+.0%} |")
    return "\n".join(lines)


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


def our_full_launches() -> tuple[Shape, list[Launch]]:
    """The full shape and our launches at it (pool dtypes from the layout)."""
    shape, ctx, options = full_shape()
    return shape, our_launches(shape, pool_element_sizes(ctx, shape, options), P=plan_p(ctx, shape))


def our_estimate(facts: Mapping[str, Mapping], m: Machine = H200) -> dict:
    """Our estimate at the full shape, from compile facts by kernel name."""
    return estimate(our_full_launches()[1], facts, m)


def compare(s: Shape, facts: Mapping, m: Machine = H200, save_mode: str = "light") -> dict:
    """Ours (under ``save_mode``) and FLA's estimates at shape ``s``."""
    return {"ours": estimate(our_shape_launches(s, save_mode), facts["ours"], m),
            "fla": fla_estimate(s, facts["fla"], m)}


def save_mode_table(s: Shape, facts: Mapping, m: Machine = H200) -> list[dict]:
    """Our modelled forward and backward under each save mode, with the
    bytes each saves beyond the inputs (one rank, one layer) and the ratio to
    FLA's modelled total (FLA 0.5.1 saves A and the q/k norms: "inverse")."""
    fla = fla_estimate(s, facts["fla"], m)["total_ms"]
    ctx = shape_context(s)
    rows = []
    for mode in SAVE_MODES:
        ours = estimate(our_shape_launches(s, mode), facts["ours"], m)
        options = OptionsKcp(use_qk_l2norm=True, save_mode=mode)
        saved = gdn_saved_bytes_kcp(ctx, s.H, s.HV, s.K, s.V, dtype=torch.bfloat16, options=options)
        rows.append({"save_mode": mode, "forward_ms": ours["forward_ms"], "backward_ms": ours["backward_ms"],
                     "total_ms": ours["total_ms"], "saved_mb": saved / 1e6, "ratio": ours["total_ms"] / fla})
    return rows


def save_mode_markdown(rows: list[dict]) -> str:
    lines = ["| save_mode | forward (ms) | backward (ms) | total (ms) | / FLA | saved beyond the inputs (MB) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['save_mode']} | {r['forward_ms']:.2f} | {r['backward_ms']:.2f} | {r['total_ms']:.2f} | "
                     f"{r['ratio']:.2f} | {r['saved_mb']:.0f} |")
    return "\n".join(lines)


def our_kda_shape_launches(s: Shape, save_mode: str = "light", **ops: float) -> list[Launch]:
    """Our KDA launches at shape ``s`` (pool dtypes from the light layout of
    its context with a gate per key channel); ``ops``: :func:`our_kda_launches`'
    ``pair_ops`` / ``pull_ops``. One segment per fragment: a shape where the
    plan runs more is refused."""
    ctx = shape_context(s)
    options = OptionsKcp(use_qk_l2norm=True, gate="channel")
    P = plan_segments(ctx, s.HV, s.K, s.V)
    if P != 1:
        raise ValueError(f"the KDA rows model one segment per fragment; the plan runs P={P} at {s}")
    return our_kda_launches(s, pool_element_sizes(ctx, s, options), save_mode, **ops)


def compare_kda(s: Shape, facts: Mapping, m: Machine = H200, save_mode: str = "light") -> dict:
    """KDA's estimates at shape ``s``: ours (``chunk_kda`` under ``save_mode``)
    and FLA 0.5.1's ``chunk_kda`` (``facts["fla_kda"]``)."""
    return {"ours": estimate(our_kda_shape_launches(s, save_mode), facts["ours"], m),
            "fla": fla_kda_estimate(s, facts["fla_kda"], m)}


def kda_pairs_ms(s: Shape, facts: Mapping, m: Machine = H200) -> float:
    """Milliseconds of our KDA estimate at ``s`` that are the exact pairs'
    elementwise work: the estimate less the same launches with no work for
    the (i, j, d) triples inside the sub-chunks."""
    ours = estimate(our_kda_shape_launches(s), facts["ours"], m)["total_ms"]
    return ours - estimate(our_kda_shape_launches(s, pair_ops=0, pull_ops=0), facts["ours"], m)["total_ms"]


def kda_markdown(result: dict) -> str:
    """One KDA estimate's launches, short: phase, kernel, launches, time (ms)
    and the share of its compute that is fp32 (elementwise) work."""
    lines = ["| phase | kernel | n | time (ms) | fp32 GFLOP | tensor GFLOP | GB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['phase']} | {r['kernel']} | {r['n']} | {r['n'] * r['time'] * 1e3:.2f} | "
                     f"{r['n'] * r['fp32_gflop']:.1f} | {r['n'] * (r['gflop'] - r['fp32_gflop']):.1f} | "
                     f"{r['n'] * r['gbytes']:.2f} |")
    return "\n".join(lines)


def kda_summary(results: Mapping, pairs_ms: float) -> str:
    """The sentence of docs/cuda.md on KDA's modelled times."""
    ours, fla = results["ours"], results["fla"]
    return (f"ours {ours['total_ms']:.2f} ms (forward {ours['forward_ms']:.2f}, backward {ours['backward_ms']:.2f}), "
            f"FLA's chunk_kda {fla['total_ms']:.2f} ms (forward {fla['forward_ms']:.2f}, backward "
            f"{fla['backward_ms']:.2f}): **ours is {ours['total_ms'] / fla['total_ms']:.2f}x FLA's time**, "
            f"{pairs_ms:.2f} ms of ours the exact pairs' elementwise work")


def breakdown(results: Mapping) -> str:
    """The sentence of docs/cuda.md on where ours loses, from the estimate's rows (ms)."""
    def ms(name: str, kernels: set, phase: str) -> float:
        rows = results[name]["rows"]
        return sum(r["n"] * r["time"] for r in rows if kernel_of(r["kernel"]) in kernels and r["phase"] == phase) * 1e3

    intra = {"chunk_gated_delta_rule_fwd_kkt_solve_kernel", "recompute_w_u_fwd_kernel"}
    return (f"prep {ms('ours', {'wy_inverse_kernel', 'prep_kernel'}, 'fwd'):.2f} ms in the forward against "
            f"{ms('fla', intra, 'fwd'):.2f} ms for FLA's kkt + solve and W, U; the scores and the walk with the "
            f"output {ms('ours', {'scores_kernel', 'walk_output_kernel'}, 'fwd'):.2f} ms against "
            f"{ms('fla', {'chunk_gated_delta_rule_fwd_kernel_h_blockdim64', 'chunk_fwd_kernel_o'}, 'fwd'):.2f} ms "
            f"for FLA's state walk and output; bwd_dqkwg "
            f"{ms('ours', {'bwd_dqkwg_kernel'}, 'bwd'):.2f} ms against FLA's "
            f"{ms('fla', {'chunk_bwd_kernel_dqkwg'}, 'bwd'):.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--T", type=int, default=32768, help="tokens")
    parser.add_argument("--docs", type=int, default=1, help="documents of equal length")
    parser.add_argument("--hq", type=int, default=16, help="key heads H_qk")
    parser.add_argument("--hv", type=int, default=32, help="value heads HV")
    parser.add_argument("--save-mode", choices=SAVE_MODES, default="light", help="our OptionsKcp.save_mode")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    parser.add_argument("--calibration", action="store_true", help="print the calibration table and stop")
    parser.add_argument("--fit", action="store_true", help="refit the three constants and print them")
    parser.add_argument("--recalibrate", type=Path, default=None, metavar="GPU_CHECK_JSON",
                        help="refit the constants to a GPU check's FLA times and set its rows against the model")
    parser.add_argument("--refresh-facts", action="store_true", help=f"recompile every kernel into {FACTS_FILE.name}")
    parser.add_argument("--fla-site", "--fla", default=None, metavar="DIR",
                        help="a `pip install --target DIR fla-core==0.5.1` directory (for --refresh-facts)")
    parser.add_argument("--triton-site", default=None, metavar="DIR",
                        help="a directory whose triton goes first on the path (for --refresh-facts)")
    args = parser.parse_args()
    if args.T < 1 or args.docs < 1 or args.docs > args.T or args.hq < 1 or args.hv % args.hq:
        parser.error(f"need T >= docs >= 1 and HV a multiple of H_qk, got T={args.T}, docs={args.docs}, "
                     f"hq={args.hq}, hv={args.hv}")
    facts = refresh_facts(args.fla_site) if args.refresh_facts else load_facts()
    warn_if_stale(facts)
    if args.recalibrate:
        # Imported here, not at the top: recalibrate imports this module. Run as a script this module is
        # __main__, so it stands in for "roofline" rather than being executed a second time.
        sys.modules.setdefault("roofline", sys.modules[__name__])
        from recalibrate import run_recalibration

        run_recalibration(args.recalibrate, facts, args.json)
        return
    machine = H200
    if args.fit:
        machine = fit(facts["fla"])
        print(json.dumps({k: getattr(machine, k) for k in FIT_RANGES}, indent=1))
    table = calibration_table(facts["fla"], machine)
    if args.calibration or args.fit:
        print(calibration_markdown(table))
        return
    shape = model_shape(args.T, args.docs, args.hq, args.hv)
    results = compare(shape, facts, machine, args.save_mode)
    if args.json:
        print(json.dumps({name: {"forward_ms": r["forward_ms"], "backward_ms": r["backward_ms"], "rows": r["rows"]}
                          for name, r in results.items()} | {"shape": asdict(shape), "triton": facts["triton"],
                                                              "calibration": table}, indent=1, default=str))
        return
    print(f"Shape: T = {shape.T} in {shape.fragments} document(s), H_qk = {shape.H}, HV = {shape.HV}, "
          f"K = V = {shape.K}, bf16; compile facts from triton {facts['triton']}, FLA {facts['fla_version']}.\n")
    print(markdown("Ours (gdn_kcp, Triton)", results["ours"]))
    print("\n" + markdown("FLA (fla-core 0.5.1 chunk_gated_delta_rule)", results["fla"]))
    ratio = results["ours"]["total_ms"] / results["fla"]["total_ms"]
    print(f"\nours / FLA = {ratio:.2f} (save_mode={args.save_mode!r})\n\n### Save modes\n\n"
          f"{save_mode_markdown(save_mode_table(shape, facts, machine))}")
    print(f"\n### Calibration\n\n{calibration_markdown(table)}")
    kda = compare_kda(shape, facts, machine, args.save_mode)
    print(f"\n### KDA (a gate per key channel)\n\n{kda_summary(kda, kda_pairs_ms(shape, facts, machine))}.\n")
    print(f"Ours (gdn_kcp chunk_kda, Triton):\n\n{kda_markdown(kda['ours'])}\n")
    print(f"FLA (fla-core 0.5.1 chunk_kda):\n\n{kda_markdown(kda['fla'])}")
    segments = walk_latency_table(facts["ours"], machine)
    plan_ctx = replace(full_shape()[1], n_sms=machine.sms)
    plan_p = {f"HV={hv}": plan_segments(plan_ctx, hv, 128, 128) for hv in (32, 4)}
    print("\n### Forward walk over intra-rank segments P (one document of 32,768 tokens)\n")
    print(f"Walk programs resident per SM as compiled: {resident(facts['ours']['walk_output_kernel'], machine)}. "
          "The plan (gdn_kcp.plan, 132 SMs) picks P = "
          + ", ".join(f"{p} at {hv}" for hv, p in plan_p.items()) + ".\n")
    columns = [*plan_p, STEPS_ALONE]
    print("| P | " + " | ".join(f"walk (us), {c}" for c in columns) + " |\n|---:|" + "---:|" * len(columns))
    for row in segments:
        print(f"| {row['P']} | " + " | ".join(f"{row[c]:.0f}" for c in columns) + " |")


if __name__ == "__main__":
    main()

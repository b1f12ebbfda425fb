"""Static H200 estimate of one forward+backward, ours against FLA's: per kernel
launch the FLOPs, the bytes moved, the instruction class from the compile and
the estimated time, on the CPU (no GPU).

    python benchmarks/roofline.py [--fla [SITE]] [--json] [--step-us 0.27]    # make roofline

Shape: one document of T = 32768 tokens (B = 1), H_qk = 16, HV = 32,
K = V = 128, bf16 inputs, chunks of C = 64, the q/k L2 norm in the kernels,
one rank, default options (``save_mode="light"``: the backward recomputes prep
and the tape walk). Ours: the launches of :mod:`gdn_kcp.host` (forward.py,
backward.py) at the configs of ``compile_specs.kernels``, compiled by
``compile_specs.report``. FLA: ``chunk_gated_delta_rule(...,
use_qk_l2norm_in_kernel=True, cu_seqlens=...)`` of fla-core (``--fla SITE``
for a ``pip install --target SITE`` directory; without the flag FLA is
included when ``fla`` imports), its kernels compiled the same way (sm_90,
ptxas log and PTX; pointers 16-byte aligned, as ``compile_specs``
compiles ours and as a launch specialises them) at one typical autotune config each.

The model, the same for both:
- FLOPs: 2 m n k per matrix product, counted from what each program computes
  at this shape, recomputation included (a QK^T per value tile counts per
  value tile). Elementwise work is not counted, except the forward
  substitution of the triangular inverses: ``SOLVE_OPS`` fp32 ops per tile
  element per row step (row extraction: select, add; product: multiply, add;
  row insertion: select, plus the masks).
- Bytes: per program, every tile it reads or writes, once (a tile a program
  reads twice is taken to hit the cache), at its dtype: bf16 inputs and
  outputs; ours the pool dtypes of ``gdn_workspace_layout_kcp`` (so the
  estimate follows ``gdn_kcp.dtypes``), FLA's the dtypes its host code
  allocates. Tiles read by several programs (a key head's q/k by each of its
  HV / H_qk value heads, q, k and w by each value tile) count once per
  program. FLA's torch ops between kernels (GVA sums, dk / dg adds, casts,
  ``torch.zeros``) are launches of bytes only.
- Class from the compile: ``wgmma`` / ``mma`` products at the tensor-core peak
  (bf16 or tf32 by their operands), ``fma`` / ``-`` at the fp32 peak. Spill
  stores (bytes per thread) are shown, not charged.
- Peaks: H200 SXM datasheet (NVIDIA, 2024), dense = half the "with sparsity"
  figures: bf16 989 TFLOP/s, tf32 494, fp32 67, HBM3e 4.8 TB/s; 132 SMs.
  No derating: every term is a lower bound.
- Time of a launch = max(compute, memory, serial):
  compute = FLOPs / peak / (share of the 132 SMs holding a program);
  memory = bytes / min(HBM, busy SMs x ``SM_BYTES_PER_CLOCK`` x clock);
  serial, for programs that run a chain of dependent steps (a walk: one
  chunk per step, ``NC / fragments`` steps; a forward substitution: one row
  per step) = waves x steps x max(step latency + the step's own work at one
  SM's rates, the step's bytes at the program's share of the bandwidth).
  Waves = ceil(programs / (132 x resident programs per SM)), resident from
  registers, warps and shared memory of the compile. The walks run one
  program per (fragment, head, value tile): 64 programs < 132 SMs, so they
  are bound by their steps, not by the machine's peaks.
- Step latency (``--step-us``, default 0.27 us): two dependent cross-warp
  exchanges per step, about 250 cycles each at 1.83 GHz (the clock the bf16
  peak implies: 989 TFLOP/s / (132 SMs x 4096 FLOP/clk)). A walk's step waits
  for its state twice (operand staged to shared memory, wgmma issued and
  waited for, w S then k^T v_new; the adjoint likewise); a substitution row
  step waits for two cross-warp reductions (the row of L, then the product).
  The same for both implementations; the script prints the totals at half
  and twice the latency.
- Total = the sum over the launches of one forward+backward; no launch
  overhead, no overlap between launches.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

if __name__ == "__main__":  # before triton is imported: compile for real, ptxas runs for every kernel
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cache = os.environ.get("TRITON_CACHE_DIR")
    if not cache or (os.path.isdir(cache) and os.listdir(cache)):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="roofline-triton-")

import torch
from gdn_kcp.kernels.torch.prep import INVERSE_BLOCK
from gdn_kcp.kernels.triton._common import value_block
from gdn_kcp.kernels.triton.bwd_qk_norm import BT_NORM
from gdn_kcp.kernels.triton.compose_segments import BV_COMPOSE

from gdn_kcp import OptionsKcp, build_kcp_context
from gdn_kcp.plan import plan_segments
from gdn_kcp.queries import gdn_workspace_layout_kcp

SOLVE_OPS = 6
"""fp32 ops per tile element in one row step of a forward substitution."""
BF16 = 2
F32 = 4


@dataclass(frozen=True)
class Machine:
    """H200 SXM peaks (datasheet; dense) and the latency assumption."""

    sms: int = 132
    bf16: float = 989e12
    tf32: float = 494e12
    fp32: float = 67e12
    hbm: float = 4.8e12
    clock: float = 1.83e9
    sm_bytes_per_clock: int = 64  # one SM's load/store path to L2 (an assumption; binds only with few programs)
    step_latency: float = 0.27e-6
    registers: int = 65536  # per SM
    shared: int = 233_472  # 228 KiB per SM, 1 KiB of it reserved per resident program
    warps: int = 64
    programs: int = 32

    @property
    def sm_bandwidth(self) -> float:
        return self.sm_bytes_per_clock * self.clock


H200 = Machine()


@dataclass(frozen=True)
class Work:
    """FLOPs by precision (``bf16`` / ``tf32`` products, ``fp32`` FMA-pipe work) and bytes."""

    bf16: float = 0.0
    tf32: float = 0.0
    fp32: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def __mul__(self, n: float) -> Work:
        return Work(*(a * n for a in astuple(self)))

    @property
    def flops(self) -> float:
        return self.bf16 + self.tf32 + self.fp32


def astuple(w: Work) -> tuple[float, ...]:
    return w.bf16, w.tf32, w.fp32, w.bytes


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``programs`` programs of ``work`` each; with ``steps``,
    each program runs a chain of ``steps`` dependent steps of ``step`` work.
    ``kernel`` names its compile facts (None: a torch op, bytes only)."""

    phase: str
    kernel: str | None
    programs: int
    work: Work
    steps: int = 0
    step: Work = field(default_factory=Work)
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or self.kernel or "?"


def walk(phase: str, kernel: str, programs: int, steps: int, step: Work) -> Launch:
    return Launch(phase, kernel, programs, step * steps, steps, step)


# ---------------------------------------------------------------- the model

def resident(facts: Mapping, m: Machine = H200) -> int:
    """Programs of a kernel resident on one SM at once (registers are allocated
    in 256-register units per warp)."""
    warps = facts["num_warps"]
    per_warp = -(-facts["registers"] * 32 // 256) * 256
    limits = (m.registers // (per_warp * warps), m.shared // (facts["shared"] + 1024), m.warps // warps, m.programs)
    return max(1, min(limits))


def terms(launch: Launch, facts: Mapping | None, m: Machine = H200) -> dict:
    """Compute, memory and serial time (s) of one launch, and the largest: its time."""
    total = launch.work * launch.programs
    if facts is None:  # a torch op: streams its bytes over the whole machine
        memory = total.bytes / m.hbm
        return {"compute": 0.0, "memory": memory, "serial": 0.0, "time": memory, "resident": None, "waves": None}
    tensor = facts["products"] in ("wgmma", "mma")
    rates = (m.bf16 if tensor else m.fp32, m.tf32 if tensor else m.fp32, m.fp32)
    busy = min(launch.programs, m.sms)
    compute = sum(f / r for f, r in zip(astuple(total)[:3], rates)) * m.sms / busy
    memory = total.bytes / min(m.hbm, busy * m.sm_bandwidth)
    serial, res, waves = 0.0, resident(facts, m), None
    if launch.steps:
        in_flight = min(launch.programs, m.sms * res)
        sharing = math.ceil(in_flight / busy)  # programs sharing one SM's rates
        waves = math.ceil(launch.programs / in_flight)
        s = launch.step
        step_work = sharing * m.sms * sum(f / r for f, r in zip(astuple(s)[:3], rates))
        step_bytes = s.bytes / min(m.sm_bandwidth / sharing, m.hbm / in_flight)
        serial = waves * launch.steps * max(m.step_latency + step_work, step_bytes)
    return {"compute": compute, "memory": memory, "serial": serial, "time": max(compute, memory, serial),
            "resident": res, "waves": waves}


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
                         gflop=total.flops / 1e9, gbytes=total.bytes / 1e9, **terms(launch, f, m))
    out = list(rows.values())
    ms = {p: sum(r["n"] * r["time"] for r in out if p in ("all", r["phase"])) * 1e3 for p in ("all", "fwd", "bwd")}
    return {"rows": out, "total_ms": ms["all"], "forward_ms": ms["fwd"], "backward_ms": ms["bwd"]}


def kernel_flops(launches: list[Launch]) -> dict[str, float]:
    """FLOPs of every kernel over the launches (one forward+backward): what
    ``gpu_check`` divides a kernel's measured time by for its achieved rate."""
    out: dict[str, float] = {}
    for launch in launches:
        if launch.kernel:
            out[launch.kernel] = out.get(launch.kernel, 0.0) + launch.programs * launch.work.flops
    return out


def shape_of(ctx, H_qk: int, HV: int, K: int, V: int) -> Shape:
    """The model's shape for a one-rank context: its tokens, chunks and documents."""
    return Shape(T=ctx.n_tokens, H=H_qk, HV=HV, K=K, V=V, NC=ctx.index.n_chunks, fragments=ctx.index.n_frag)


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

    @property
    def chunks_per_fragment(self) -> int:
        return -(-self.NC // self.fragments)


def full_shape() -> tuple[Shape, object, OptionsKcp]:
    """The full shape on a one-rank context of one document, and the options."""
    shape = Shape()
    ctx = build_kcp_context([0, shape.T])
    return shape_of(ctx, shape.H, shape.HV, shape.K, shape.V), ctx, OptionsKcp(use_qk_l2norm=True)


def pool_element_sizes(ctx, s: Shape, options: OptionsKcp, dtype=torch.bfloat16) -> dict[str, int]:
    """Bytes per element of every pool a forward or backward binds (the layout's dtypes)."""
    layout = gdn_workspace_layout_kcp(ctx, s.H, s.HV, s.K, s.V, dtype=dtype, options=options)
    return {name: spec.dtype.itemsize for call in (layout.fwd, layout.bwd) for name, spec in call.pools.items()}


# ---------------------------------------------------------------- ours

OUR_PROGRAMS = {
    "fwd": ("prep", "tape_walk", "output"),
    "bwd": ("prep", "tape_walk", "bwd_local_dv", "adjoint_walk", "bwd_dqkwg", "bwd_wy", "bwd_gate_cumsum",
            "bwd_qk_norm"),
}
"""The programs of one forward and one backward on one rank under the default
options (host/forward.py, host/backward.py; tests/test_roofline.py checks it)."""


def our_launches(s: Shape, e: Mapping[str, int]) -> list[Launch]:
    """Every Triton launch of OUR_PROGRAMS; ``e``: bytes per element of each pool."""
    C, K, V, HV, H, NC = s.C, s.K, s.V, s.HV, s.H, s.NC
    BV, BC = value_block(V), INVERSE_BLOCK
    NV, G, n = -(-V // BV), HV // H, BF16
    qk = 2 * C * K * n + 2 * C * e["q_rstd"]  # q and k rows of a chunk, with their norms

    def prep(phase: str) -> list[Launch]:
        norm = Launch(phase, "l2_rstd_kernel", -(-s.T // C) * H,
                      Work(fp32=2 * C * K, bytes=C * K * n + C * e["q_rstd"]))
        store_A = phase == "bwd"  # the light forward keeps no A; the backward's recompute writes it
        steps = BC - 1
        work = Work(bf16=2 * C * C * K + 8 * C**3 + 2 * C * C * K + 2 * C * C * V,  # L, two block merges, W, U
                    fp32=steps * SOLVE_OPS * C * C,
                    bytes=C * K * n + C * e["k_rstd"] + 2 * C * n + C * V * n + store_A * C * C * e["A"]
                    + C * K * e["w"] + C * V * e["v_new"])
        return [norm, norm, Launch(phase, "prep_kernel", NC * HV, work, steps, Work(fp32=SOLVE_OPS * C * C))]

    def tape_walk(phase: str) -> list[Launch]:
        step = Work(bf16=2 * (2 * C * K * BV), bytes=C * K * n + C * e["k_rstd"] + C * n + C * K * e["w"]
                    + 2 * C * BV * e["v_new"] + K * BV * e["h"])
        return [walk(phase, "tape_walk_kernel", s.fragments * HV * NV, s.chunks_per_fragment, step)]

    def output(phase: str) -> list[Launch]:
        work = Work(bf16=2 * C * C * K + 2 * C * K * BV + 2 * C * C * BV,
                    bytes=qk + C * n + K * BV * e["h"] + C * BV * e["v_new"] + C * BV * n)
        return [Launch(phase, "output_kernel", NC * HV * NV, work)]

    def bwd_local_dv(phase: str) -> list[Launch]:  # one program per chunk and head walks the value tiles
        work = Work(bf16=2 * C * C * K + 2 * C * C * V, bytes=qk + C * n + C * V * n + C * V * e["dv_new"])
        return [Launch(phase, "bwd_local_dv_kernel", NC * HV, work)]

    def adjoint_walk(phase: str) -> list[Launch]:
        step = Work(bf16=3 * (2 * C * K * BV), bytes=qk + C * n + C * K * e["w"] + C * BV * n
                    + 2 * C * BV * e["dv_new"] + K * BV * e["dh"])
        return [walk(phase, "adjoint_walk_kernel", s.fragments * HV * NV, s.chunks_per_fragment, step)]

    def bwd_dqkwg(phase: str) -> list[Launch]:
        # dO Vn^T; the state terms of dq, dk, dw; the score terms of dq, dk and QK^T
        work = Work(bf16=2 * C * C * V + 3 * (2 * C * K * V) + 3 * (2 * C * C * K),
                    bytes=C * n + C * V * (n + e["v_new"] + e["dv_new"]) + K * V * (e["h"] + e["dh"]) + qk
                    + C * K * (e["dq_heads"] + e["dk_heads"] + e["dw"]) + C * e["dgcum"])
        return [Launch(phase, "bwd_dqkwg_kernel", NC * HV, work)]

    def bwd_wy(phase: str) -> list[Launch]:
        work = Work(bf16=2 * C * C * (5 * K + 2 * V + 2 * C),
                    bytes=2 * C * n + C * C * e["A"] + C * K * n + C * e["k_rstd"] + C * K * e["dw"] + C * V * n
                    + C * V * e["dv_new"] + 2 * C * K * e["dk_heads"] + 2 * C * e["dgcum"] + C * V * n + C * n)
        return [Launch(phase, "bwd_wy_kernel", NC * HV, work)]

    def bwd_gate_cumsum(phase: str) -> list[Launch]:
        return [Launch(phase, "bwd_gate_cumsum_kernel", NC * HV, Work(bytes=C * e["dgcum"] + C * n))]

    def bwd_qk_norm(phase: str) -> list[Launch]:
        work = Work(bytes=BT_NORM * (G * K * e["dq_heads"] + e["q_rstd"] + 2 * K * n))
        return [Launch(phase, "bwd_qk_norm_kernel", -(-s.T // BT_NORM) * H, work)] * 2  # dq, dk

    programs = {"prep": prep, "tape_walk": tape_walk, "output": output, "bwd_local_dv": bwd_local_dv,
                "adjoint_walk": adjoint_walk, "bwd_dqkwg": bwd_dqkwg, "bwd_wy": bwd_wy,
                "bwd_gate_cumsum": bwd_gate_cumsum, "bwd_qk_norm": bwd_qk_norm}
    return [launch for phase, names in OUR_PROGRAMS.items() for name in names for launch in programs[name](phase)]


def segment_walk_launches(s: Shape, e: Mapping[str, int], P: int) -> list[Launch]:
    """The forward's state walk at P intra-rank segments (every fragment cut
    into P, as the plan's model does): P = 1 is the tape walk alone; P > 1 is
    phase 1 (``segment_summary``, ``[S | M]`` of every segment, value tiles
    of the V + K columns), phase 2 (``compose_segments``, P dependent steps of
    a K x K by K x 16 product in fp32 per fragment and value tile of 16) and
    phase 3 (the tape walk over the F P segments)."""
    C, K, V, HV, n = s.C, s.K, s.V, s.HV, BF16
    BV = value_block(V)
    NV, NS = -(-V // BV), -(-(V + K) // BV)
    tape = Work(bf16=2 * (2 * C * K * BV), bytes=C * K * n + C * e["k_rstd"] + C * n + C * K * e["w"]
                + 2 * C * BV * e["v_new"] + K * BV * e["h"])
    if P == 1:
        return [walk("fwd", "tape_walk_kernel", s.fragments * HV * NV, s.chunks_per_fragment, tape)]
    steps = -(-s.chunks_per_fragment // P)
    summary = Work(bf16=2 * (2 * C * K * BV), bytes=C * K * n + C * e["k_rstd"] + C * n + C * K * e["w"]
                   + C * BV * e["v_new"])
    BC = min(BV_COMPOSE, V)
    compose = Work(fp32=2 * K * K * BC, bytes=(K * K + 2 * K * BC) * e["seg_summary"])
    return [walk("fwd", "segment_summary_kernel", s.fragments * P * HV * NS, steps, summary),
            walk("fwd", "compose_segments_kernel", s.fragments * HV * -(-V // BC), P, compose),
            walk("fwd", "tape_walk_kernel", s.fragments * P * HV * NV, steps, tape)]


def walk_latency(facts: Mapping[str, Mapping], P: int, m: Machine = H200, s: Shape | None = None) -> float:
    """Estimated time (s) of the forward's walk at P segments (:func:`segment_walk_launches`)."""
    s = s or Shape()
    e = dict(k_rstd=F32, w=BF16, v_new=BF16, h=BF16, seg_summary=F32)
    return sum(terms(launch, facts[launch.kernel], m)["time"] for launch in segment_walk_launches(s, e, P))


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


WALK_KERNELS = ("tape_walk_kernel", "segment_summary_kernel", "compose_segments_kernel")
"""The kernels of the forward's walk at P segments."""


def our_facts(K: int = 128, V: int = 128) -> dict[str, dict]:
    """Compile facts of every kernel (``compile_specs.report``: needs a fresh TRITON_CACHE_DIR)."""
    from gdn_kcp.kernels.triton.compile_specs import report

    rows = report(90, K, V)
    if any(r["registers"] == 0 for r in rows):
        raise RuntimeError("ptxas logged nothing: run with a fresh TRITON_CACHE_DIR")
    return {r["kernel"]: r for r in rows}


# ---------------------------------------------------------------- FLA

COUNTERPARTS = {
    "l2_rstd_kernel": ("l2norm_fwd_kernel",),
    "prep_kernel": ("chunk_gated_delta_rule_fwd_kkt_solve_kernel", "recompute_w_u_fwd_kernel"),
    "tape_walk_kernel": ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64",),
    "output_kernel": ("chunk_fwd_kernel_o",),
    "bwd_local_dv_kernel": ("chunk_bwd_kernel_dv_local",),
    "adjoint_walk_kernel": ("chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",),
    "bwd_dqkwg_kernel": ("chunk_bwd_kernel_dqkwg",),
    "bwd_wy_kernel": ("prepare_wy_repr_bwd_kernel",),
    "bwd_qk_norm_kernel": ("l2norm_bwd_kernel",),
    "bwd_gate_cumsum_kernel": ("chunk_local_cumsum_scalar_kernel",),
}
"""FLA's kernels that do the work of each of ours (prep: the WY inverse and
W, U; ours sums the gates inside each program): ``gpu_check`` reports FLA's
time over ours per pair. The profiler names FLA's forward and reverse gate
cumsums alike, so the cumsum pair holds both against our one backward launch
(a few microseconds either way)."""

FLA_BT_NORM = 16
FLA_BC = 16
FLA_BV_WALK = 64
FLA_BV_OUTPUT = 64
FLA_VARLEN = {"IS_VARLEN": True}
FLA_KERNELS = {
    # label: (module, kernel, pointers "name:dtype" ("-": absent), constexprs, num_warps, num_stages)
    "l2norm_fwd_kernel": ("fla.modules.norm.l2norm", "l2norm_fwd_kernel", "x:bf16 y:bf16 rstd:fp32",
                          {"D": 128, "BD": 128, "NB": 8, "BT": FLA_BT_NORM}, 4, 3),
    "chunk_local_cumsum_scalar_kernel": (
        "fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel", "s:bf16 o:fp32",
        {"B": 1, "H": 32, "REVERSE": False, "HAS_SCALE": True, "USE_GRAPH": False, **FLA_VARLEN}, 4, 3),
    "chunk_gated_delta_rule_fwd_kkt_solve_kernel": (
        "fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel",
        "k:bf16 g:fp32 beta:bf16 A:bf16", {"BC": FLA_BC, "BK": 64, "USE_G": True, **FLA_VARLEN}, 4, 3),
    "recompute_w_u_fwd_kernel": (
        "fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel",
        "k:bf16 v:bf16 beta:bf16 w:bf16 u:bf16 A:bf16 g:fp32", {"BK": 64, "BV": 64, "USE_G": True, **FLA_VARLEN}, 4, 2),
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": (
        "fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64",
        "k:bf16 v:bf16 w:bf16 v_new:bf16 g:fp32 gk:- h:bf16 h0:- ht:-",
        {"BV": FLA_BV_WALK, "USE_G": True, "USE_GK": False, "USE_INITIAL_STATE": False, "STORE_FINAL_STATE": False,
         "SAVE_NEW_VALUE": True, "STATE_V_FIRST": False, **FLA_VARLEN}, 4, 2),
    "chunk_fwd_kernel_o": (
        "fla.ops.common.chunk_o", "chunk_fwd_kernel_o", "q:bf16 k:bf16 v:bf16 h:bf16 g:fp32 g_gamma:- o:bf16",
        {"BK": 64, "BV": FLA_BV_OUTPUT, "USE_G": True, "USE_G_GAMMA": False, "STATE_V_FIRST": False, **FLA_VARLEN},
        4, 3),
    "chunk_bwd_kernel_dv_local": (
        "fla.ops.common.chunk_o", "chunk_bwd_kernel_dv_local", "q:bf16 k:bf16 g:fp32 g_gamma:- A:- do:bf16 dv:bf16",
        {"BK": 128, "BV": 128, "USE_G": True, "USE_G_GAMMA": False, "USE_A": False, **FLA_VARLEN}, 4, 2),
    "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64": (
        "fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64",
        "q:bf16 k:bf16 w:bf16 g:fp32 gk:- dht:- dh0:- do:bf16 dh:bf16 dv:bf16 dv2:bf16",
        {"BV": FLA_BV_WALK, "USE_G": True, "USE_GK": False, "USE_INITIAL_STATE": False,
         "USE_FINAL_STATE_GRADIENT": False, "STATE_V_FIRST": False, **FLA_VARLEN}, 4, 2),
    "chunk_bwd_kernel_dqkwg": (
        "fla.ops.common.chunk_o", "chunk_bwd_kernel_dqkwg",
        "q:bf16 k:bf16 v:bf16 g:fp32 g_gamma:- h:bf16 do:bf16 dh:bf16 dq:bf16 dk:bf16 dw:bf16 dv:bf16 dg:fp32",
        {"B": 1, "BK": 128, "BV": 128, "USE_G": True, "USE_G_GAMMA": False, "USE_DW": True, "STATE_V_FIRST": False,
         **FLA_VARLEN}, 4, 2),
    "prepare_wy_repr_bwd_kernel": (
        "fla.ops.gated_delta_rule.wy_fast", "prepare_wy_repr_bwd_kernel",
        "k:bf16 v:bf16 beta:bf16 g:fp32 A:bf16 dw:bf16 du:bf16 dk:bf16 dv:bf16 db:bf16 dg:fp32",
        {"BK": 64, "BV": 64, "USE_G": True, **FLA_VARLEN}, 4, 2),
    "chunk_local_cumsum_scalar_kernel[reverse]": (
        "fla.ops.utils.cumsum", "chunk_local_cumsum_scalar_kernel", "s:fp32 o:fp32 scale:-",
        {"B": 1, "H": 32, "REVERSE": True, "HAS_SCALE": False, "USE_GRAPH": False, **FLA_VARLEN}, 4, 3),
    "l2norm_bwd_kernel": ("fla.modules.norm.l2norm", "l2norm_bwd_kernel", "y:bf16 rstd:fp32 dy:bf16 dx:bf16",
                          {"D": 128, "BD": 128, "NB": 8, "BT": FLA_BT_NORM}, 4, 3),
}
"""FLA's kernels of ``fla.ops.gated_delta_rule.chunk`` (fla-core 0.6.0) at one
typical Hopper choice of each autotune list (the BK / BV its host code picks on
an H100/H200); ``cu_seqlens`` / ``chunk_indices`` / ``chunk_offsets`` are int64."""


def fla_launches(s: Shape) -> list[Launch]:
    """Every launch of FLA's forward+backward (fla-core 0.6.0, ``chunk.py``), in order."""
    C, K, V, HV, H, NC, n = s.C, s.K, s.V, s.HV, s.H, s.NC, BF16
    BC, BVW, BVO, BTN = FLA_BC, FLA_BV_WALK, FLA_BV_OUTPUT, FLA_BT_NORM
    docs, per_doc = s.fragments, s.chunks_per_fragment
    rows = s.T * H  # rows of q or k for the L2 norm

    def torch_op(phase: str, label: str, nbytes: int) -> Launch:
        return Launch(phase, None, 1, Work(bytes=nbytes), label=f"torch: {label}")

    def l2norm(phase: str) -> Launch:
        kernel, tiles = ("l2norm_fwd_kernel", 2) if phase == "fwd" else ("l2norm_bwd_kernel", 3)  # x, y / y, dy, dx
        return Launch(phase, kernel, -(-rows // BTN), Work(fp32=2 * BTN * K, bytes=BTN * (tiles * K * n + F32)))

    w_u = Work(bf16=2 * C * C * (K + V), bytes=C * C * n + C * (n + F32) + 2 * C * V * n + 2 * C * K * n)
    fwd_h = Work(bf16=2 * (2 * C * K * BVW), bytes=K * BVW * n + 2 * C * K * n + 2 * C * BVW * n + C * F32)
    solve_steps = 4 * (BC - 2)  # four diagonal blocks, rows 2 .. BC - 1 each
    kkt = Launch("fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel", NC * HV,
                 Work(bf16=10 * 2 * BC * BC * K, tf32=16 * 2 * BC**3, fp32=solve_steps * SOLVE_OPS * BC * BC,
                      bytes=C * K * n + C * (F32 + n) + 10 * BC * BC * n),
                 solve_steps, Work(fp32=SOLVE_OPS * BC * BC))
    forward = [
        l2norm("fwd"), l2norm("fwd"),
        Launch("fwd", "chunk_local_cumsum_scalar_kernel", NC * HV, Work(bytes=C * (n + F32))),
        torch_op("fwd", "A = zeros", s.T * HV * C * n),
        kkt,
        Launch("fwd", "recompute_w_u_fwd_kernel", NC * HV, w_u),
        walk("fwd", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", docs * HV * -(-V // BVW), per_doc, fwd_h),
        Launch("fwd", "chunk_fwd_kernel_o", NC * HV * -(-V // BVO),
               Work(bf16=2 * C * C * K + 2 * C * K * BVO + 2 * C * C * BVO,
                    bytes=2 * C * K * n + K * BVO * n + C * F32 + 2 * C * BVO * n)),
    ]
    gva = (HV * K + H * K) * s.T * n  # [T, HV, K] summed over each key head's value heads
    backward = [
        Launch("bwd", "recompute_w_u_fwd_kernel", NC * HV, w_u),
        walk("bwd", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", docs * HV * -(-V // BVW), per_doc, fwd_h),
        Launch("bwd", "chunk_bwd_kernel_dv_local", NC * HV,
               Work(bf16=2 * C * C * K + 2 * C * C * V, bytes=2 * C * K * n + C * F32 + 2 * C * V * n)),
        walk("bwd", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", docs * HV * -(-V // BVW), per_doc,
             Work(bf16=3 * (2 * C * K * BVW), bytes=K * BVW * n + C * F32 + 3 * C * BVW * n + 3 * C * K * n)),
        Launch("bwd", "chunk_bwd_kernel_dqkwg", NC * HV,
               Work(bf16=2 * C * C * V + 3 * (2 * C * K * V) + 2 * (2 * C * C * K),
                    bytes=3 * C * V * n + 2 * K * V * n + 2 * C * K * n + 3 * C * K * n + 2 * C * F32)),
        torch_op("bwd", "dq GVA sum", gva), torch_op("bwd", "dk GVA sum", gva),
        torch_op("bwd", "dg sum over K blocks", 2 * s.T * HV * F32),
        Launch("bwd", "prepare_wy_repr_bwd_kernel", NC * HV,
               Work(bf16=2 * C * C * (5 * K + 2 * V + 2 * C),
                    bytes=2 * C * K * n + 3 * C * V * n + C * K * n + C * C * n + 2 * C * n + 2 * C * F32)),
        torch_op("bwd", "dk2 GVA sum", gva),
        torch_op("bwd", "dk += dk2", 3 * s.T * H * K * n), torch_op("bwd", "dg += dg2", 3 * s.T * HV * F32),
        Launch("bwd", "chunk_local_cumsum_scalar_kernel[reverse]", NC * HV, Work(bytes=2 * C * F32)),
        torch_op("bwd", "dg to bf16", s.T * HV * (F32 + n)),
        l2norm("bwd"), l2norm("bwd"),
    ]
    return forward + backward


def fla_facts(site: str | None) -> dict[str, dict]:
    """Compile facts of FLA's kernels (FLA_KERNELS) for sm_90, as ``compile_specs.report`` reads ours."""
    import contextlib
    import io
    import warnings

    import triton
    import triton.language as tl
    from gdn_kcp.kernels.triton.compile_specs import instruction_class, ptxas_facts
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    if site:
        sys.path.insert(0, site)
    warnings.filterwarnings("ignore", module="fla")  # "Triton is not supported on current platform"
    # chunk_fwd picks its solve precision from the device at import (the CPU: ieee); an sm_90 GPU gets tf32
    importlib.import_module("fla.ops.gated_delta_rule.chunk_fwd").SOLVE_TRIL_DOT_PRECISION = tl.constexpr("tf32")
    triton.knobs.nvidia.dump_ptxas_log = True
    heads = {"H": 16, "HV": 32, "K": 128, "V": 128, "BT": 64}
    facts = {}
    for label, (module, name, pointer_list, constexprs, warps, stages) in FLA_KERNELS.items():
        pointers = dict(item.split(":") for item in pointer_list.split())
        kernel = getattr(importlib.import_module(module), name)
        while not isinstance(kernel, JITFunction):  # heuristics / autotuner wrappers
            kernel = kernel.fn
        params = {p.name: p for p in kernel.params}
        constants = {k: v for k, v in {**heads, **constexprs}.items() if k in params}
        signature, attrs = {}, {}
        for i, p in enumerate(kernel.params):
            if p.is_constexpr or pointers.get(p.name) == "-":
                signature[p.name] = "constexpr"
                constants.setdefault(p.name, None)
            elif p.name in pointers or p.name in ("cu_seqlens", "chunk_indices", "chunk_offsets"):
                signature[p.name] = "*" + pointers.get(p.name, "i64")
                attrs[(i,)] = [["tt.divisibility", 16]]  # aligned, as compile_specs.source compiles ours
            else:
                signature[p.name] = "fp32" if p.name in ("eps", "scale") else "i32"
        log, start = io.StringIO(), time.perf_counter()
        with contextlib.redirect_stdout(log):
            source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": stages})
        has_dot = "tt.dot" in compiled.asm["ttir"]
        facts[label] = dict(kernel=label, shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps,
                            num_stages=compiled.metadata.num_stages,
                            products=instruction_class(compiled.asm["ptx"], has_dot), **ptxas_facts(log.getvalue()))
        progress(f"  {label}: {time.perf_counter() - start:.1f} s")
    return facts


# ---------------------------------------------------------------- output

def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def markdown(title: str, result: dict) -> str:
    lines = [f"### {title}", "",
             ("| phase | kernel | n | class | spills (B/thr) | programs | steps | GFLOP | GB | compute (us) | "
             "memory (us) | serial (us) | time (us) | n x time (us) |"),
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['phase']} | {r['kernel']} | {r['n']} | {r['products']} | {r['spill_stores']:,} | "
                     f"{r['programs']:,} | {r['steps'] or '-'} | {r['gflop']:.1f} | {r['gbytes']:.3f} | "
                     f"{r['compute'] * 1e6:.0f} | {r['memory'] * 1e6:.0f} | {r['serial'] * 1e6:.0f} | "
                     f"{r['time'] * 1e6:.0f} | {r['n'] * r['time'] * 1e6:.0f} |")
    lines.append(f"\nTotal {result['total_ms']:.2f} ms (forward {result['forward_ms']:.2f}, "
                 f"backward {result['backward_ms']:.2f}).")
    return "\n".join(lines)


def our_full_launches() -> tuple[Shape, list[Launch]]:
    """The full shape and our launches at it (pool dtypes from the layout)."""
    shape, ctx, options = full_shape()
    return shape, our_launches(shape, pool_element_sizes(ctx, shape, options))


def our_estimate(facts: Mapping[str, Mapping], m: Machine = H200) -> dict:
    """Our estimate at the full shape, from compile facts by kernel name."""
    return estimate(our_full_launches()[1], facts, m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fla", nargs="?", const="", default=None, metavar="SITE",
                        help="include FLA (SITE: a `pip install --target` directory put on sys.path)")
    parser.add_argument("--no-fla", action="store_true", help="ours only")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    parser.add_argument("--step-us", type=float, default=H200.step_latency * 1e6, help="latency of a dependent step")
    args = parser.parse_args()
    machine = replace(H200, step_latency=args.step_us * 1e-6)
    shape, ours = our_full_launches()
    launches = {"ours": ours}
    progress("compiling our kernels for sm_90 (compile_specs.report, about a minute on 2 cores) ...")
    start = time.perf_counter()
    facts = {"ours": our_facts(shape.K, shape.V)}
    progress(f"  done in {time.perf_counter() - start:.0f} s")
    want_fla = not args.no_fla and (args.fla is not None or importlib.util.find_spec("fla") is not None)
    if want_fla:
        progress("compiling FLA's kernels for sm_90 ...")
        try:
            facts["fla"] = fla_facts(args.fla or None)
            launches["fla"] = fla_launches(shape)
        except Exception as error:  # noqa: BLE001 - fla absent or failing: ours alone
            progress(f"  FLA skipped: {type(error).__name__}: {error}")
    results = {name: estimate(launches[name], facts[name], machine) for name in launches}
    sensitivity = {f"{x}x step latency": {name: estimate(launches[name], facts[name],
                                                         replace(machine, step_latency=machine.step_latency * x))
                                          ["total_ms"] for name in launches} for x in (0.5, 2)}
    ratio = results["ours"]["total_ms"] / results["fla"]["total_ms"] if "fla" in results else None
    segments = walk_latency_table(facts["ours"], machine)
    plan_ctx = replace(full_shape()[1], n_sms=machine.sms)
    plan_p = {f"HV={hv}": plan_segments(plan_ctx, hv, shape.K, shape.V) for hv in (32, 4)}
    if args.json:
        print(json.dumps({"shape": asdict(shape), "machine": asdict(machine), "facts": facts, "results": results,
                              "ratio_ours_over_fla": ratio, "sensitivity_total_ms": sensitivity,
                          "segments": {"plan_P": plan_p, "walk_latency": segments}}, indent=1))
        return
    print(markdown("Ours (gdn_kcp, Triton)", results["ours"]))
    if "fla" in results:
        print("\n" + markdown("FLA (fla-core chunk_gated_delta_rule)", results["fla"]))
        print(f"\nours / FLA = {ratio:.2f}")
    for label, totals in sensitivity.items():
        print(f"at {label}: " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in totals.items()))
    print("\n### Forward walk over intra-rank segments P (one document of the shape above)\n")
    print(f"Walk programs resident per SM as compiled: {resident(facts['ours']['tape_walk_kernel'], machine)}. "
          "The plan (gdn_kcp.plan, 132 SMs) picks P = "
          + ", ".join(f"{p} at {hv}" for hv, p in plan_p.items()) + ".\n")
    columns = [*plan_p, STEPS_ALONE]
    print("| P | " + " | ".join(f"walk (us), {c}" for c in columns) + " |\n|---:|" + "---:|" * len(columns))
    for row in segments:
        print(f"| {row['P']} | " + " | ".join(f"{row[c]:.0f}" for c in columns) + " |")


if __name__ == "__main__":
    main()

"""Static H200 estimate of one forward+backward, ours against
flash-linear-attention's (FLA, fla-core 0.5.1), on the calibrated cost model
of :mod:`gdn_kcp.cost_model`: per kernel launch the FLOPs, the bytes, the
compile facts (sm_90) and the estimated time, on the CPU (no GPU).

    python benchmarks/roofline.py [--T 32768] [--docs 1] [--hq 16] [--hv 32] [--save-mode light] [--json]
    python benchmarks/roofline.py --calibration        # the calibration table
    python benchmarks/roofline.py --fit                # refit the model's three constants
    python benchmarks/roofline.py --recalibrate DIR/gpu_check.json [--json]
    python benchmarks/roofline.py --refresh-facts --fla-site DIR [--triton-site DIR]

    python benchmarks/roofline.py --kda-table          # KDA's work a chunk, per program, both sides

KDA (``compare_kda``): ours (``chunk_kda``, at the plan's segments) against FLA
0.5.1's ``chunk_kda`` on both of its intra paths (``safe_gate`` False and
True: ``fla_kernels.FLA_KDA_KERNELS``, ``FLA_KDA_SAFE_GATE_KERNELS``) at the
same shape, a gate per key channel, printed after GDN's rows; ``--json``
carries it under ``kda`` (``ours``, ``fla``, ``fla_safe_gate``).

Shape: T tokens in ``--docs`` equal documents (B = 1), H_qk = ``--hq``, HV =
``--hv``, K = V = 128, bf16 inputs, chunks of C = 64, the q/k L2 norm in the
kernels, one rank, default options (``save_mode="light"``: the backward
recomputes prep and the tape walk; ``--save-mode`` for another, and a table
of all three at the end). Ours (``benchmarks/our_launches.py``): the launches of
:mod:`gdn_kcp.host` at the configs of ``compile_specs.kernels``. FLA
(``benchmarks/fla_launches.py``): the launches of fla-core 0.5.1's
``chunk_gated_delta_rule(..., use_qk_l2norm_in_kernel=True, cu_seqlens=...)``
(``benchmarks/fla_kernels.py`` has the table), each kernel at the configuration of its autotune list with
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
  element per row step (``benchmarks/launch_model.py`` holds the shape, this
  count and the estimate of a list of launches). The KDA rows count every
  elementwise operation of both sides in issue slots, 2 FLOPs each at the
  fp32 peak (``benchmarks/kda_counts.py``: exponentials, scans, selects,
  products, the substitution).
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
from gdn_kcp.cost_model import H200, Machine, resident, terms
from gdn_kcp.kernels.triton.compile_specs import kernel_of

from gdn_kcp import OptionsKcp
from gdn_kcp.options import SAVE_MODES
from gdn_kcp.plan import plan_segments, segments_for, walk_launches
from gdn_kcp.queries import gdn_saved_bytes_kcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fla_kernels  # noqa: E402  (benchmarks/fla_kernels.py: FLA 0.5.1's kernel table)
import fla_launches as fla_launches_module  # noqa: E402
import kda_counts  # noqa: E402  (benchmarks/kda_counts.py: KDA's elementwise work)
from fla_launches import (best_fla_facts, fla_estimate, fla_kda_count, fla_kda_estimate,  # noqa: E402
                          fla_kda_kernel_launches, kda_facts)
from launch_model import Shape, estimate, model_shape  # noqa: E402
from our_launches import (full_shape, our_kda_counts, our_kda_shape_launches, our_shape_launches,  # noqa: E402
                          shape_context)

ROOT = Path(__file__).resolve().parent.parent
FACTS_FILE = Path(__file__).resolve().parent / "h200_facts.json"

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
    kernels (GDN's, and KDA's under ``"fla_kda"`` and, its safe-gate path's,
    ``"fla_kda_safe_gate"``) for sm_90 and write them to
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
    progress("compiling every configuration of FLA's safe-gate KDA kernels for sm_90 ...")
    fla_kda_safe_gate = fla_kernels.compile_facts(fla_site, progress=progress,
                                                  table=fla_kernels.FLA_KDA_SAFE_GATE_KERNELS)
    if any(f["registers"] == 0 for table in (fla, fla_kda, fla_kda_safe_gate) for by_config in table.values()
           for f in by_config.values()):
        raise RuntimeError("ptxas logged nothing for an FLA kernel: run with a fresh TRITON_CACHE_DIR")
    facts = {"triton": triton.__version__, "fla_version": fla_kernels.fla_version(fla_site),
             "ours_digest": source_digest(), "ours": {r["kernel"]: r for r in rows}, "fla": fla,
             "fla_kda": fla_kda, "fla_kda_safe_gate": fla_kda_safe_gate}
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


KDA_SIDES = ("ours", "fla", "fla_safe_gate")
"""The KDA estimates: ours, FLA's ``chunk_kda`` with ``safe_gate=False`` (its
token-parallel intra kernel, the default) and with ``safe_gate=True`` (its
M = 16 tensor-core path, for gates bounded below)."""


def compare_kda(s: Shape, facts: Mapping, m: Machine = H200, save_mode: str = "light") -> dict:
    """KDA's estimates at shape ``s`` (:data:`KDA_SIDES`): ours (``chunk_kda``
    under ``save_mode``, at the plan's segments) and FLA 0.5.1's ``chunk_kda``
    on either intra path."""
    return {"ours": estimate(our_kda_shape_launches(s, save_mode), facts["ours"], m),
            "fla": fla_kda_estimate(s, kda_facts(facts), m),
            "fla_safe_gate": fla_kda_estimate(s, kda_facts(facts, safe_gate=True), m, safe_gate=True)}


def kda_elementwise_ms(s: Shape, facts: Mapping, m: Machine = H200) -> float:
    """Milliseconds of our KDA estimate at ``s`` that its elementwise work
    adds: the estimate less the same launches with none."""
    ours = estimate(our_kda_shape_launches(s), facts["ours"], m)["total_ms"]
    none = {kernel: kda_counts.Count() for kernel in our_kda_counts(s)}
    return ours - estimate(our_kda_shape_launches(s, counts=none), facts["ours"], m)["total_ms"]


def kda_markdown(result: dict) -> str:
    """One KDA estimate's launches, short: phase, kernel, launches, time (ms),
    the elementwise work (G slots), the tensor-core GFLOP and the GB."""
    lines = ["| phase | kernel | n | time (ms) | elementwise (G slots) | tensor GFLOP | GB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['phase']} | {r['kernel']} | {r['n']} | {r['n'] * r['time'] * 1e3:.2f} | "
                     f"{r['n'] * r['fp32_gflop'] / kda_counts.FLOP_PER_SLOT:.1f} | "
                     f"{r['n'] * (r['gflop'] - r['fp32_gflop']):.1f} | {r['n'] * r['gbytes']:.2f} |")
    return "\n".join(lines)


def kda_summary(results: Mapping, elementwise_ms: float) -> str:
    """The sentence of docs/model.md on KDA's modelled times."""
    ours, fla, safe = results["ours"], results["fla"], results["fla_safe_gate"]
    faster = min(fla["total_ms"], safe["total_ms"])
    return (f"ours {ours['total_ms']:.2f} ms (forward {ours['forward_ms']:.2f}, backward {ours['backward_ms']:.2f}), "
            f"FLA's chunk_kda {fla['total_ms']:.2f} ms (forward {fla['forward_ms']:.2f}, backward "
            f"{fla['backward_ms']:.2f}) and with safe_gate {safe['total_ms']:.2f} ms (forward "
            f"{safe['forward_ms']:.2f}, backward {safe['backward_ms']:.2f}): **ours is "
            f"{ours['total_ms'] / faster:.2f}x the faster FLA path's time**, {elementwise_ms:.2f} ms of ours "
            f"elementwise work")


def kda_rows(facts: Mapping, m: Machine = H200, heads=((16, 32), (4, 8), (2, 4)), T: int = 32768) -> list[dict]:
    """KDA's totals at one document of ``T`` tokens for each (H_qk, HV) of
    ``heads``, ours at the plan's segments: the issue's three shapes."""
    rows = []
    for H, HV in heads:
        s = model_shape(T, 1, H, HV)
        r = compare_kda(s, facts, m)
        rows.append({"H": H, "HV": HV, "P": segments_for(shape_context(s), HV, s.K, s.V, None),
                     **{f"{side}_ms": r[side]["total_ms"] for side in KDA_SIDES}})
    return rows


def with_elementwise(m: Machine, efficiency: float) -> Machine:
    """``m`` with its elementwise (fp32) work at ``efficiency`` of the fp32
    issue peak, its other constants unchanged (the model assumes
    ``m.compute_efficiency``, the fraction fitted on the GDN rows' tensor-core
    work; ``math.inf`` makes the elementwise work free)."""
    return replace(m, fp32=m.fp32 * efficiency / m.compute_efficiency)


def elementwise_at_peak(m: Machine = H200) -> Machine:
    """``m`` with its fp32 (elementwise) work at the peak issue rate: the
    bound of KDA's rows where no calibration row says how fast either side's
    elementwise work runs."""
    return with_elementwise(m, 1.0)


def kda_rows_markdown(rows: list[dict]) -> str:
    lines = ["| H_qk | HV | P | ours (ms) | FLA (ms) | FLA safe_gate (ms) | ours / faster FLA |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        faster = min(r["fla_ms"], r["fla_safe_gate_ms"])
        lines.append(f"| {r['H']} | {r['HV']} | {r['P']} | {r['ours_ms']:.2f} | {r['fla_ms']:.2f} | "
                     f"{r['fla_safe_gate_ms']:.2f} | {r['ours_ms'] / faster:.2f} |")
    return "\n".join(lines)


KDA_PROGRAM_PAIRS = (
    ("l2 norms", ("l2_rstd_kernel",), ("l2norm_fwd_kernel",)),
    ("segments (P > 1)", ("segment_summary_kernel[channel]", "compose_segments_kernel",
                          "adjoint_segment_summary_kernel[channel]", "compose_adjoints_kernel"), ()),
    ("gate cumsum", (), ("chunk_local_cumsum_vector_kernel",)),
    ("intra products: L / Akk (+ Aqk)", ("channel_wy_inverse_kernel",),
     ("chunk_kda_fwd_kernel_intra_token_parallel", "chunk_kda_fwd_kernel_intra_sub_chunk",
      "chunk_kda_fwd_kernel_inter_solve_fused", "chunk_kda_fwd_kernel_inter_solve_fused[safe_gate]")),
    ("W, U", ("prep_kernel[channel]",), ("recompute_w_u_fwd_kda_kernel", "recompute_w_u_fwd_kda_kernel[qg]")),
    ("scores (Aqk)", ("channel_scores_kernel",), ()),
    ("walks' decays (FLA's kg, qg: in W, U)", ("channel_decays_kernel",), ()),
    ("state walk (+ output)", ("walk_output_kernel[channel]", "tape_walk_kernel[channel]"),
     ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64[gk]",)),
    ("output", ("output_kernel[channel]",), ("chunk_gla_fwd_kernel_o",)),
    ("local dv", ("bwd_local_dv_kernel[channel]",), ("chunk_kda_bwd_kernel_dAv",)),
    ("adjoint walk", ("adjoint_walk_kernel[channel]",), ("chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64[gk]",)),
    ("dq, dk, dw, dg (state, score terms)", ("bwd_dqkwg_kernel[channel]",), ("chunk_kda_bwd_kernel_wy_dqkg_fused",)),
    ("WY backward, intra pulls", ("bwd_wy_kernel[channel]",),
     ("chunk_kda_bwd_kernel_intra", "chunk_kda_bwd_kernel_intra[safe_gate]")),
    ("gate cumsum backward", ("bwd_gate_cumsum_channel_kernel",), ("chunk_local_cumsum_vector_kernel[reverse]",)),
    ("q, k norm backward", ("bwd_qk_norm_kernel[channel]",), ("l2norm_bwd_kernel[fp32 dy]",)),
)
"""The per-program table's rows: what our KDA programs and FLA's kernels do
the same work of (FLA's forward intra kernels form Aqk and Akk at once; its
fused backward kernel holds the WY backward's value pass and dA)."""


def kda_program_table(s: Shape, facts: Mapping, m: Machine = H200, save_mode: str = "light") -> dict[str, dict]:
    """Per side (:data:`KDA_SIDES`) and kernel, a step's work a chunk of C
    tokens and value head: its launches, exponentials, elementwise issue
    slots (the exponentials' included) and tensor-core FLOPs, from the
    estimates' launches (ours at the plan's P; a kernel launched twice a step,
    as our recomputed prep and walk or FLA's recomputed w, u and state walk,
    counts both). Exponentials are :mod:`kda_counts`' in the proportion of
    the launch's slots."""
    results = compare_kda(s, facts, m, save_mode)
    chunk_heads = s.NC * s.HV
    out = {}
    for side in KDA_SIDES:
        if side == "ours":
            counts = our_kda_counts(s)
        else:
            best = best_fla_facts(s, kda_facts(facts, side == "fla_safe_gate"), m, fla_kda_kernel_launches)
            counts = {label: fla_kda_count(s, label, f["config"]) for label, f in best.items()
                      if not label.startswith("l2norm")}
        rows: dict[str, dict] = {}
        for r in results[side]["rows"]:
            if r["products"] == "torch":
                continue
            row = rows.setdefault(r["kernel"], {"kernel": r["kernel"], "launches": 0, "exps": 0.0, "slots": 0.0,
                                                "tensor": 0.0})
            slots = r["n"] * r["fp32_gflop"] * 1e9 / kda_counts.FLOP_PER_SLOT / chunk_heads
            count = counts.get(kernel_of(r["kernel"]) if r["kernel"] not in counts else r["kernel"])
            row["launches"] += r["n"]
            row["slots"] += slots
            row["exps"] += slots * count.exps / count.slots if count and count.slots else 0.0
            row["tensor"] += r["n"] * (r["gflop"] - r["fp32_gflop"]) * 1e9 / chunk_heads
        out[side] = rows
    return out


def kda_program_markdown(table: Mapping[str, dict]) -> str:
    """The per-program table, ours and FLA's side by side (:data:`KDA_PROGRAM_PAIRS`;
    FLA's two intra paths' kernels in one column), and each side's sums."""
    fla = {**table["fla"], **table["fla_safe_gate"]}

    def cells(rows: Mapping[str, dict], kernels: Sequence[str]) -> str:
        present = [rows[k] for k in kernels if k in rows]
        if not present:
            return "- | - | - | -"
        names = "<br>".join(r["kernel"] + (f" (x{r['launches']})" if r["launches"] > 1 else "") for r in present)
        return (f"{names} | " + "<br>".join(f"{r['exps'] / 1e3:,.1f}" for r in present) + " | "
                + "<br>".join(f"{r['slots'] / 1e3:,.0f}" for r in present) + " | "
                + "<br>".join(f"{r['tensor'] / 1e6:,.2f}" for r in present))

    lines = ["| work | ours | exp (k) | slots (k) | tensor (MFLOP) | FLA 0.5.1 | exp (k) | slots (k) | "
             "tensor (MFLOP) |", "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for work, ours, theirs in KDA_PROGRAM_PAIRS:
        lines.append(f"| {work} | {cells(table['ours'], ours)} | {cells(fla, theirs)} |")
    lines += ["", "| a step, a chunk of 64 tokens and one value head | exp (k) | slots (k) | tensor (MFLOP) |",
              "|---|---:|---:|---:|"]
    for side, label in (("ours", "ours"), ("fla", "FLA, safe_gate=False"), ("fla_safe_gate", "FLA, safe_gate=True")):
        rows = table[side].values()
        lines.append(f"| {label} | {sum(r['exps'] for r in rows) / 1e3:,.1f} | "
                     f"{sum(r['slots'] for r in rows) / 1e3:,.0f} | {sum(r['tensor'] for r in rows) / 1e6:,.2f} |")
    return "\n".join(lines)


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
    parser.add_argument("--kda-table", action="store_true",
                        help="print KDA's per-program table (exponentials, slots, tensor FLOPs a chunk) and stop")
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
    if args.kda_table:
        print(kda_program_markdown(kda_program_table(shape, facts, machine, args.save_mode)))
        return
    results = compare(shape, facts, machine, args.save_mode)
    kda = compare_kda(shape, facts, machine, args.save_mode)
    if args.json:
        def side(r: Mapping) -> dict:
            return {"forward_ms": r["forward_ms"], "backward_ms": r["backward_ms"], "rows": r["rows"]}

        print(json.dumps({name: side(r) for name, r in results.items()}
                         | {"kda": {name: side(r) for name, r in kda.items()}
                            | {"segments": segments_for(shape_context(shape), shape.HV, shape.K, shape.V, None)},
                            "shape": asdict(shape), "triton": facts["triton"], "calibration": table},
                         indent=1, default=str))
        return
    print(f"Shape: T = {shape.T} in {shape.fragments} document(s), H_qk = {shape.H}, HV = {shape.HV}, "
          f"K = V = {shape.K}, bf16; compile facts from triton {facts['triton']}, FLA {facts['fla_version']}.\n")
    print(markdown("Ours (gdn_kcp, Triton)", results["ours"]))
    print("\n" + markdown("FLA (fla-core 0.5.1 chunk_gated_delta_rule)", results["fla"]))
    ratio = results["ours"]["total_ms"] / results["fla"]["total_ms"]
    print(f"\nours / FLA = {ratio:.2f} (save_mode={args.save_mode!r})\n\n### Save modes\n\n"
          f"{save_mode_markdown(save_mode_table(shape, facts, machine))}")
    print(f"\n### Calibration\n\n{calibration_markdown(table)}")
    print(f"\n### KDA (a gate per key channel)\n\n{kda_summary(kda, kda_elementwise_ms(shape, facts, machine))}.\n")
    print(f"Ours (gdn_kcp chunk_kda, Triton):\n\n{kda_markdown(kda['ours'])}\n")
    print(f"FLA (fla-core 0.5.1 chunk_kda, safe_gate=False):\n\n{kda_markdown(kda['fla'])}\n")
    print(f"FLA (fla-core 0.5.1 chunk_kda, safe_gate=True):\n\n{kda_markdown(kda['fla_safe_gate'])}\n")
    print(f"At one document of {shape.T:,} tokens and fewer heads (ours at the plan's P):\n\n"
          f"{kda_rows_markdown(kda_rows(facts, machine, T=shape.T))}\n")
    print("The same with the elementwise work at the fp32 issue peak (an efficiency of 1 for it, the compute "
          f"efficiency of the tensor work unchanged):\n\n"
          f"{kda_rows_markdown(kda_rows(facts, elementwise_at_peak(machine), T=shape.T))}")
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

"""The GPU check: every stage in a process of its own under its own time cap,
so a stage that fails, hangs or poisons the CUDA context (an illegal address
is sticky) stops nothing else. Writes ``gpu_check.json`` (after every stage)
and ``gpu_check.md`` to ``--out``.

    python benchmarks/gpu_check.py --out DIR             # on a GPU (gpu_check.sh): at most 9 minutes
    python benchmarks/gpu_check.py --out DIR --quick     # correctness, calibration rows, capture: 4 minutes
    python benchmarks/gpu_check.py --out DIR --dry-run   # every stage's code on the CPU, tiny shapes

The check's shape: T = 32768 packed tokens (documents of 64 to 6000 tokens),
H_qk = 16, HV = 32, K = V = 128, bf16. The stages, in the order they run
(:data:`STAGES`), are in ``gpu_stages.py`` and ``gpu_capture.py``;
``roofline.py --recalibrate DIR/gpu_check.json`` refits the model on the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent

STAGES = {  # name: (module, cap in seconds on the GPU, in --quick)
    "programs": ("gpu_stages", 40, True),
    "forward_backward": ("gpu_stages", 25, True),
    "calibration": ("gpu_stages", 60, True),
    "capture": ("gpu_capture", 110, True),  # two compiles with Inductor, the traced layer's the larger
    "memory": ("gpu_capture", 90, False),  # one Inductor compile of the traced host path (light)
    "checkpointing": ("gpu_capture", 25, False),
    "timing": ("gpu_stages", 35, False),
    "kda": ("gpu_stages", 60, False),  # KDA against FLA's chunk_kda: its first call runs its autotuners
    "lowering": ("gpu_capture", 90, False),  # Inductor compiles the traced host path's forward and backward
    "segments": ("gpu_stages", 35, False),
    "decode": ("gpu_stages", 30, False),  # GDN's layer, then KDA's
    "profile": ("gpu_stages", 60, False),  # GDN's kernels, then KDA's: ours, FLA's two intra paths (each autotunes)
    "cute": ("gpu_stages", 45, False),  # CuTe DSL programs, not yet run on a GPU: last, its own cap (4 compiles)
}
"""The most important first: a run out of time loses the last."""

REQUIRED = {
    "programs": ("max_relative_error", "segments_max_relative_error", "kda_relative_rms", "limit", "pass"),
    "forward_backward": ("relative_rms_vs_torch_programs", "pass"),
    "calibration": ("calibration",),
    "capture": ("readme", "layer_traced", "pass"),
    "memory": ("save_modes", "traced", "checkpoint"),
    "checkpointing": ("torch", "verified_before", "cases", "pass"),
    "timing": ("ms", "model_ms"),
    "kda": ("ms", "model_ms"),
    "lowering": ("relative_rms_vs_eager", "calls_gdn_kcp_op", "triton_launches_in_code", "traced_ms", "pass"),
    "segments": (),
    "decode": ("decode_vs_full_relative_rms", "decode_step_ms", "kda_decode_vs_full_relative_rms", "kda_decode_step_ms"),
    "profile": ("kernel_ms", "kernel_tflops", "kda_shape", "kda_kernel_ms"),
    "cute": ("compile", "max_relative_error", "ms", "limit", "pass"),
}
"""The keys each stage's results must hold once it has run (a stage stopped
at its cap is "incomplete" with the ones it lacks)."""

BUDGET_S = {"full": 450, "quick": 230, "dry": 180}
"""The whole run's seconds (gpu_check.sh's 8 and 4 minutes, less the start);
no stage starts past it and each gets at most what is left."""

DRY_CAP_S = 90
INTERPRETED = ("programs", "forward_backward")
"""The dry run's stages that run the Triton programs under the interpreter;
the others run the torch programs (the same host code, seconds not minutes)."""


def run_stage(name: str, out: Path, dry: bool) -> int:
    """In the child: one stage, its results in ``out/stages/<name>.json``."""
    import torch  # noqa: F401 - after TRITON_INTERPRET is set (main)
    from gpu_common import Results, Setup

    from gdn_kcp.host.programs import use_programs

    results = Results(out / "stages" / f"{name}.json")
    setup = Setup.make(dry)
    stage = getattr(__import__(STAGES[name][0]), name)
    backend = ("triton" if name in INTERPRETED else "torch") if dry else None
    try:
        if backend:
            with use_programs("cpu", backend):
                stage(results, setup)
        else:
            stage(results, setup)
    except BaseException:  # noqa: BLE001 - the parent reads the trace from the file
        (out / "stages" / f"{name}.error").write_text(traceback.format_exc())
        return 1
    return 0


def run_header(args) -> dict:
    """The run's versions and shape, read without touching the GPU (the parent
    holds no CUDA context)."""
    import torch
    import triton
    from gpu_common import Setup

    setup = Setup.make(args.dry_run)
    device = "cpu"
    if not args.dry_run:
        try:
            device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                    text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            device = "cuda (nvidia-smi unreadable)"
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "device": device, "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(), "T": setup.T,
            "documents": len(setup.bounds) - 1, "dims": list(setup.dims), "dtype": str(setup.dtype),
            "quick": args.quick, "dry_run": args.dry_run}


def launch(name: str, args, cap: float) -> dict:
    """One stage in a child process (its own session: a cap kills it and every
    compile worker it started); its status, seconds, results and error."""
    stages = args.out / "stages"
    for suffix in (".json", ".error"):
        (stages / f"{name}{suffix}").unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--out", str(args.out)]
    command += ["--dry-run"] if args.dry_run else []
    # The dry run's children take one CPU thread: beside other work (a test suite's other worker) OpenMP's
    # threads spin against it (the whole dry run 182 s against 59 s under a two-thread load on 2 cores).
    env = dict(os.environ, OMP_NUM_THREADS="1") if args.dry_run else None
    start = time.perf_counter()
    with open(stages / f"{name}.log", "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            code = child.wait(timeout=cap)
            status = "ran" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = "timed out"
    row = {"status": status, "seconds": round(time.perf_counter() - start, 1), "cap_s": round(cap)}
    if (stages / f"{name}.json").exists():
        row["results"] = json.loads((stages / f"{name}.json").read_text())
    missing = [key for key in REQUIRED[name] if key not in row.get("results", {})]
    if status == "ran" and missing:
        row.update(status="incomplete", missing=missing)
    if (stages / f"{name}.error").exists():
        row["error"] = (stages / f"{name}.error").read_text()
    elif status != "ran":
        row["error"] = "".join((stages / f"{name}.log").read_text().splitlines(keepends=True)[-30:])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton under the interpreter")
    parser.add_argument("--quick", action="store_true", help="only " + ", ".join(n for n, s in STAGES.items() if s[2]))
    parser.add_argument("--stages", default=None, help="comma-separated subset of: " + ", ".join(STAGES))
    parser.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # the child's one stage
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))  # the stage modules beside this file, whoever runs it
    if args.dry_run:  # before torch and triton are imported: the interpreter runs the Triton programs
        os.environ["TRITON_INTERPRET"] = "1"
    if args.stage:
        sys.exit(run_stage(args.stage, args.out, args.dry_run))
    names = args.stages.split(",") if args.stages else [n for n, s in STAGES.items() if s[2] or not args.quick]
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        parser.error(f"--stages: unknown {unknown}; the stages are {', '.join(STAGES)}")
    (args.out / "stages").mkdir(parents=True, exist_ok=True)
    budget = BUDGET_S["dry" if args.dry_run else "quick" if args.quick else "full"]
    report, start = {"run": run_header(args), "stages": {}}, time.perf_counter()
    for name in names:
        left = budget - (time.perf_counter() - start)
        cap = min(DRY_CAP_S if args.dry_run else STAGES[name][1], left)
        if cap < 5:
            report["stages"][name] = {"status": "skipped: out of time", "cap_s": 0}
        else:
            report["stages"][name] = launch(name, args, cap)
        stage = report["stages"][name]
        print(f"{name}: {stage['status']}, {stage.get('seconds', 0)} s", flush=True)
        report["run"]["seconds"] = round(time.perf_counter() - start, 1)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    from gpu_report import markdown

    (args.out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()

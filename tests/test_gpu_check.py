"""The GPU check cannot rot: its dry run (every stage's code on the CPU, tiny
shapes, the Triton programs under the interpreter) runs every stage within its
budget and writes every stage's keys; a stage past its cap is killed and the
next one runs; nothing under benchmarks/ imports from tests/."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    report["markdown"] = (out / "gpu_check.md").read_text()
    report["out"] = out
    return report


def test_the_dry_run_runs_every_stage_within_its_budget(dry_run):
    """Every stage ran (not failed, timed out, skipped or incomplete) inside the
    dry run's budget of 3 minutes (gpu_check.BUDGET_S: a stage that would start
    past it is skipped, so this is the 3-minute bound), and the Markdown has
    a row per stage."""
    gpu_check = load_gpu_check()
    stages = dry_run["stages"]
    assert list(stages) == list(gpu_check.STAGES)
    failed = {name: (row["status"], row.get("missing"), (row.get("error") or "")[-1500:])
              for name, row in stages.items() if row["status"] != "ran"}
    assert not failed, failed
    assert gpu_check.BUDGET_S["dry"] == 180 and dry_run["run"]["seconds"] <= 180
    for name in stages:
        assert f"| {name} | " in dry_run["markdown"], name


def test_the_dry_run_writes_every_stage_keys_and_passes_what_it_can_judge(dry_run):
    """The keys each stage must hold (gpu_check.REQUIRED) are there; the
    verdicts the CPU can give hold: the Triton programs (interpreted) match
    their torch twins and so does the whole forward+backward, checkpointing
    is bitwise, the traced host path matches eager, each call allocates
    exactly its queried workspace, and the README's compile-and-capture block
    and the traced layer each compile one graph over their packings."""
    gpu_check = load_gpu_check()
    results = {name: row["results"] for name, row in dry_run["stages"].items()}
    for name, keys in gpu_check.REQUIRED.items():
        assert set(keys) <= set(results[name]), (name, set(keys) - set(results[name]))
    for name in ("programs", "forward_backward", "checkpointing", "lowering"):
        assert results[name]["pass"] is True, (name, results[name])
    assert all(row["pass"] for row in results["memory"]["save_modes"].values()), results["memory"]
    assert [row["pass"] for row in results["memory"]["traced"].values()] == [None], results["memory"]  # CPU: no device bytes
    capture = results["capture"]
    assert capture["readme"]["one_graph"] and capture["layer_traced"]["one_graph"], capture
    assert capture["readme"]["relative_rms_vs_eager"] == 0 and capture["layer_traced"]["worst_relative_rms_vs_eager"] < 1e-2
    rows = results["calibration"]["calibration"]
    assert len(rows) == 4 and all("gdn_kcp_ms" in row and "model_ms" in row for row in rows), rows
    # KDA's profile: one document of the run's T at its dims, our events (CPU: torch ops), FLA's paths where it imports
    from gdn_kcp import build_kcp_context
    from gdn_kcp.plan import segments_for

    profile, (T, (H_qk, HV, K, V)) = results["profile"], (dry_run["run"]["T"], dry_run["run"]["dims"])
    assert profile["kda_shape"] == {"T": T, "documents": 1, "H_qk": H_qk, "HV": HV, "K": K, "V": V, "dtype": "bfloat16",
                                    "P": segments_for(build_kcp_context([0, T]), HV, K, V, None)}, profile["kda_shape"]
    assert profile["kda_kernel_ms"]["ours"] and all(ms >= 0 for ms in profile["kda_kernel_ms"]["ours"].values())
    fla_paths = {"fla", "fla_safe_gate"} & set(profile["kda_kernel_ms"])
    assert fla_paths == {"fla", "fla_safe_gate"} or "kda_fla_error" in profile, profile


def test_the_recalibration_reads_the_dry_run(dry_run):
    """``roofline.py --recalibrate`` on the dry run's JSON: no FLA rows here
    (flash-linear-attention is not a test dependency), so it cannot refit and
    says why with exit status 1, after printing ours against the committed
    constants at the shapes the dry run ran."""
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed: the dry run has FLA rows")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "roofline.py"), "--recalibrate",
                           str(dry_run["out"] / "gpu_check.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "no usable FLA" in done.stderr and "No module named 'fla'" in done.stderr, done.stderr
    assert "gdn_kcp" in done.stdout or "ours" in done.stdout, done.stdout
    # KDA's elementwise rate read from the profile stage: the CPU's events are torch ops, no kernel to fit
    assert "KDA's elementwise rate, from the profile stage at T = 150 (1 document)" in done.stdout, done.stdout
    assert "No fit: none of the model's KDA kernels was profiled." in done.stdout, done.stdout


def test_a_stage_past_its_cap_is_killed_and_reported(tmp_path):
    """A cap shorter than the stage: the stage's process group is killed, its
    status says so with the log's tail, and nothing is left running."""
    gpu_check = load_gpu_check()
    (tmp_path / "stages").mkdir()
    args = Namespace(out=tmp_path, dry_run=True)
    row = gpu_check.launch("programs", args, cap=1.0)
    assert row["status"] == "timed out" and row["seconds"] < 30 and "error" in row, row


def test_nothing_under_benchmarks_imports_from_tests():
    """The GPU machine gets the package and benchmarks/; the tests' helpers are
    not the benchmarks' to import (by name, or by putting tests/ on the path)."""
    helpers = {path.stem for path in (ROOT / "tests").glob("*.py")}
    for path in BENCHMARKS.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not {name.split(".")[0] for name in names} & helpers, (path.name, names)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value != "tests", (path.name, "puts tests/ on the path")


def test_a_cuda_graph_skip_is_reported_with_its_reason():
    """The capture stage reads ``cudagraph_skips`` and the message Inductor logs
    with each skip on CUDA (here one logged by hand, as Inductor logs it)."""
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_capture
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    gpu_capture.fresh_compile_state()
    assert gpu_capture.compile_counters()["cudagraph_skips"] == 0
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
    counters = gpu_capture.compile_counters()
    assert counters["cudagraph_skips"] == 1
    assert counters["cudagraph_skip_reasons"] == ["skipping cudagraphs due to mutated inputs (1 instances)"]


def test_the_dry_run_compiles_a_cute_program_and_gives_no_verdict(dry_run):
    """On the CPU the cute stage compiles scores for sm_90a (wgmma, no spill)
    and judges nothing: only a GPU can run the CuTe programs."""
    results = dry_run["stages"]["cute"]["results"]
    if "skipped" in results:
        pytest.skip(results["skipped"])
    (facts,) = results["compile"].values()
    assert facts["arch"] == "sm_90a" and facts["wgmma_count"] > 0 and facts["local_bytes"] == 0, facts
    assert results["pass"] is None and results["max_relative_error"] == {} and results["ms"] == {}

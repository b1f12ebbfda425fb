"""One-shot GPU check: correctness of every Triton program and of forward+backward
against the torch programs on the same GPU, times of the Triton path, the same
for flash-linear-attention's chunk_gated_delta_rule when ``fla`` imports, and a
``torch.compile(mode="reduce-overhead")`` run, the walk times at P = 1 and at
the segment plan's P (one long document), and a capture-once loop over 10
packings on capped contexts (CUDA graphs recorded, results against eager, no
host sync under ``torch.cuda.set_sync_debug_mode("error")``), and the layer's
decode at FLA's head sizes (against FLA's layer with the same state dict when
flash-linear-attention's layers import), and ours, FLA's and FlashQLA's (when
they import) times at the model's calibration rows beside its estimates.
Writes ``gpu_check.json`` and
``gpu_check.md`` to ``--out``.

    python benchmarks/gpu_check.py --out DIR            # on a GPU machine (gpu_check.sh)
    python benchmarks/gpu_check.py --out DIR --dry-run  # the same steps on the CPU, tiny shapes

Shape of the full check: T = 32768 packed tokens, H_qk = 16, HV = 32, K = V = 128,
bf16 inputs. Every ratio is measured in this run against a baseline in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
if "--dry-run" in sys.argv:  # before torch and triton are imported: the interpreter runs the kernels
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from gdn_kcp import OptionsKcp, build_kcp_context, chunk_gated_delta_rule, gdn_kcp, trace_host_path  # noqa: E402
from gdn_kcp.host.programs import use_programs  # noqa: E402


def packing(T: int, seed: int = 0) -> list[int]:
    """Documents of 64 to 6000 tokens (odd lengths), packed to T."""
    rng = random.Random(seed)
    bounds = [0]
    while bounds[-1] < T:
        bounds.append(min(T, bounds[-1] + rng.randint(64, 6000) | 1))
    return bounds


def inputs(T, H_qk, HV, K, V, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(1, T, H_qk, K, generator=gen)
    k = torch.randn(1, T, H_qk, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen) + 4)
    beta = torch.rand(1, T, HV, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta)]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).square().mean().sqrt() / b.square().mean().sqrt().clamp_min(1e-30)).item()


def timed(fn, device, repeats: int = 5, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def check_programs(results, device, dims, dtype, bounds):
    """Every Triton program against its torch twin on ``device``."""
    from gdn_kcp.kernels import triton as triton_programs
    from program_cases import compare_with_torch

    H_qk, HV, K, V = dims
    case = dict(bounds=tuple(bounds), H_qk=H_qk, HV=HV, K=K, V=V, dtype=dtype, seed=1, l2=True, crossing=True,
                device=str(device))
    errors = compare_with_torch(triton_programs, **case)
    limit = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    results["programs"] = {"max_relative_error": errors, "limit": limit,
                           "pass": all(err < limit for err in errors.values())}


def check_forward_backward(results, device, dims, dtype, bounds):
    """gdn_kcp (one rank) on the Triton programs against the torch programs."""
    H_qk, HV, K, V = dims
    ctx = build_kcp_context(bounds, device=device)
    xs = inputs(bounds[-1], H_qk, HV, K, V, dtype, device)
    do = torch.randn_like(xs[2])
    outs = {}
    for backend in ("triton", "torch"):
        leaves = [x.clone().requires_grad_() for x in xs]
        with use_programs(device.type, backend):
            o, _ = gdn_kcp(*leaves, ctx, use_qk_l2norm_in_kernel=True)
            grads = torch.autograd.grad((o * do).sum(), leaves)
        outs[backend] = [o.detach(), *grads]
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    errors = {n: rel_rms(a, b) for n, a, b in zip(names, outs["triton"], outs["torch"])}
    results["forward_backward"] = {"relative_rms_vs_torch_programs": errors,
                                   "pass": all(e < 1e-2 for e in errors.values())}


def time_paths(results, device, dims, dtype, bounds):
    """Forward and forward+backward times: ours (Triton programs; also under
    ``save_mode="inverse"``, which keeps A as FLA does) and FLA's."""
    H_qk, HV, K, V = dims
    ctx = build_kcp_context(bounds, device=device)
    xs = [x.requires_grad_() for x in inputs(bounds[-1], H_qk, HV, K, V, dtype, device)]
    cu = torch.tensor(bounds, dtype=torch.long, device=device)
    do = torch.randn_like(xs[2])

    def ours(save_mode="light"):
        return gdn_kcp(*xs, ctx, options=OptionsKcp(use_qk_l2norm=True, save_mode=save_mode))[0]

    rows = {"gdn_kcp": ours, "gdn_kcp_inverse": lambda: ours("inverse")}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdr

        def fla():
            return fla_gdr(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]

        rows["fla"] = fla
        with torch.no_grad():
            results["fla_vs_ours_o_relative_rms"] = rel_rms(fla(), ours())
    except Exception as error:  # fla absent or failing: report, time ours alone
        results["fla_error"] = f"{type(error).__name__}: {error}"
    timing = {}
    for name, fn in rows.items():
        with torch.no_grad():
            forward = timed(fn, device)
        both = timed(lambda: torch.autograd.grad((fn() * do).sum(), xs), device)
        timing[name] = {"forward_ms": forward, "forward_backward_ms": both}
    if "fla" in timing:
        timing["ratio_fla_over_ours"] = {
            key: timing["fla"][key] / timing["gdn_kcp"][key] for key in ("forward_ms", "forward_backward_ms")
        }
    results["timing"] = timing
    results["model"] = modelled_times(ctx, dims)


def modelled_times(ctx, dims) -> dict:
    """The calibrated model's times at this packing (``roofline.compare`` on the
    committed compile facts; walks as long as the longest document), beside
    the measured ones. The model assumes CUDA-graph replays, the timings
    here are eager (launch overheads included): compare with care."""
    import roofline

    shape, facts = roofline.shape_of(ctx, *dims), roofline.load_facts()
    estimates = roofline.compare(shape, facts)
    estimates["ours_inverse"] = roofline.compare(shape, facts, save_mode="inverse")["ours"]
    return {name.replace("ours", "gdn_kcp"): {"forward_ms": round(r["forward_ms"], 3),
                                              "forward_backward_ms": round(r["total_ms"], 3)}
            for name, r in estimates.items()}


def profile_kernels(results, device, dims, dtype, bounds):
    """Per-kernel device time of one forward+backward (torch.profiler), ours and
    FLA's when it imports: where the time goes, kernel by kernel."""
    H_qk, HV, K, V = dims
    ctx = build_kcp_context(bounds, device=device)
    xs = [x.requires_grad_() for x in inputs(bounds[-1], H_qk, HV, K, V, dtype, device)]
    cu = torch.tensor(bounds, dtype=torch.long, device=device)
    do = torch.randn_like(xs[2])
    paths = {"gdn_kcp": lambda: gdn_kcp(*xs, ctx, use_qk_l2norm_in_kernel=True)[0]}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdr

        paths["fla"] = lambda: fla_gdr(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]
    except Exception:
        pass
    table = {}
    for name, fn in paths.items():
        torch.autograd.grad((fn() * do).sum(), xs)  # compiled and warm
        if device.type == "cuda":
            torch.cuda.synchronize()
        rows = {key[:80]: round(ms, 3)
                for key, ms in kernel_ms(lambda: torch.autograd.grad((fn() * do).sum(), xs), device).items()}
        table[name] = dict(sorted(rows.items(), key=lambda kv: -kv[1])[:25])
    results["kernel_ms"] = table
    results["kernel_tflops"] = achieved_tflops(table, ctx, dims)
    if "fla" in table:
        results["kernel_ratio_fla_over_ours"] = counterpart_ratios(table["gdn_kcp"], table["fla"])


def counterpart_ratios(ours: dict, fla: dict) -> dict:
    """FLA's time over ours, kernel by kernel (``roofline.COUNTERPARTS``: the
    FLA kernels that do the work of each of ours), where both were profiled."""
    import roofline

    out = {}
    for kernels, theirs in roofline.COUNTERPARTS.items():
        mine = sum(ours.get(kernel, 0.0) for kernel in kernels)
        if mine and all(name in fla for name in theirs):
            out["+".join(kernels)] = round(sum(fla[name] for name in theirs) / mine, 3)
    return out


def achieved_tflops(kernel_ms: dict, ctx, dims) -> dict:
    """Achieved TFLOP/s of every profiled kernel the static model counts: its
    FLOPs in one forward+backward (``roofline.kernel_flops`` at this context's
    tokens, chunks and documents) over its measured time."""
    import roofline

    shape = roofline.shape_of(ctx, *dims)
    elements = roofline.pool_element_sizes(ctx, shape, OptionsKcp(use_qk_l2norm=True))
    flops = {"gdn_kcp": roofline.kernel_flops(roofline.our_launches(shape, elements, P=roofline.plan_p(ctx, shape))),
             "fla": roofline.kernel_flops(roofline.fla_launches(shape))}
    return {name: {kernel: round(flops[name][kernel] / (ms * 1e-3) / 1e12, 2)
                   for kernel, ms in rows.items() if kernel in flops[name] and flops[name][kernel] and ms > 0}
            for name, rows in kernel_ms.items()}


def check_reduce_overhead(results, device, dims, dtype, bounds):
    """A layer around gdn_kcp under torch.compile(mode="reduce-overhead")."""
    from gdn_layer import KcpLayer

    H_qk, HV, K, V = dims
    ctx = build_kcp_context(bounds, device=device)
    torch.manual_seed(0)
    layer = KcpLayer(ctx, d_model=256, H_qk=H_qk, HV=HV, K=K, V=V,
                     options=OptionsKcp(use_qk_l2norm=True, graph="replay")).to(device=device, dtype=dtype)
    x = torch.randn(1, bounds[-1], 256, device=device, dtype=dtype)
    eager = layer(x).detach()
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    compiled = torch.compile(layer, mode=mode, fullgraph=True)
    for _ in range(3):
        y = compiled(x)
        y.float().square().mean().backward()
    results["compile"] = {"mode": mode, "relative_rms_vs_eager": rel_rms(y.detach(), eager),
                          "step_ms": timed(lambda: compiled(x).float().square().mean().backward(), device, 3, 1)}


def capped_packings(T: int, max_docs: int, n: int, seed: int = 1) -> list[list[int]]:
    """``n`` random packings of T tokens, 1 to ``max_docs`` documents each."""
    rng = random.Random(seed)
    return [[0, *sorted(rng.randint(0, T) for _ in range(rng.randint(0, max_docs - 1))), T] for _ in range(n)]


class CountCudaGraphs:
    """Counts CUDA graph captures (``torch.cuda.CUDAGraph.capture_begin``)."""

    def __enter__(self):
        self.count, self.original = 0, torch.cuda.CUDAGraph.capture_begin
        outer = self

        def counted(graph, *args, **kwargs):
            outer.count += 1
            return outer.original(graph, *args, **kwargs)

        torch.cuda.CUDAGraph.capture_begin = counted
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.capture_begin = self.original
        return False


def check_capture_once(results, device, dims, dtype, bounds, steps: int | None = None):
    """Capture once: a layer around gdn_kcp on capped contexts, a new packing
    each of ``steps`` steps, under torch.compile(mode="reduce-overhead") with a
    held workspace: Dynamo graphs and CUDA graphs recorded (goal: 1 each),
    compiled against eager every step, and one capped call under
    ``torch.cuda.set_sync_debug_mode("error")`` (no host sync). ``steps``:
    10 on a GPU, 3 on the CPU dry run (each step there takes seconds)."""
    from torch._dynamo.utils import counters

    from gdn_kcp import WorkspaceKcp
    from gdn_layer import KcpLayer

    H_qk, HV, K, V = dims
    T, max_docs = bounds[-1], 16
    steps = steps or (10 if device.type == "cuda" else 3)
    options = OptionsKcp(use_qk_l2norm=True, graph="replay")
    contexts = [build_kcp_context(b, device=device, max_docs=max_docs) for b in capped_packings(T, max_docs, steps)]
    workspace = WorkspaceKcp(contexts[0], H_qk, HV, K, V, dtype=dtype, options=options, device=device)
    torch.manual_seed(0)
    layer = KcpLayer(contexts[0], d_model=256, H_qk=H_qk, HV=HV, K=K, V=V, options=options,
                     workspace=workspace).to(device=device, dtype=dtype)
    x = torch.randn(1, T, 256, device=device, dtype=dtype)
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, mode=mode, fullgraph=True)
    errors = []
    graphs = CountCudaGraphs() if device.type == "cuda" else _null()
    with graphs:
        for ctx in contexts:
            eager = layer(x, ctx).detach()
            y = compiled(x, ctx)
            y.float().square().mean().backward()
            errors.append(rel_rms(y.detach(), eager))
    capture = {"mode": mode, "steps": steps, "max_docs": max_docs, "dynamo_graphs": counters["stats"]["unique_graphs"],
               "cuda_graphs_recorded": getattr(graphs, "count", None), "worst_relative_rms_vs_eager": max(errors)}
    if device.type == "cuda":
        leaves = [t.requires_grad_() for t in inputs(T, H_qk, HV, K, V, dtype, device)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            o, _ = gdn_kcp(*leaves, contexts[-1], options=options, workspace=workspace)
            torch.autograd.grad(o.float().square().mean(), leaves)
            capture["no_host_sync"] = True
        finally:
            torch.cuda.set_sync_debug_mode("default")
    results["capture_once"] = capture


WALK_KERNELS = ("walk_output", "tape_walk", "segment_summary", "compose_segments", "adjoint_walk",
                "adjoint_segment_summary", "compose_adjoints")
"""The kernels of the state walks and of the segment phases (profiler names
start with them; the forward's walk is the walk with the output)."""


def time_segments(results, device, dims, dtype, bounds):
    """Intra-rank segments on one long document of T tokens, at the check's HV
    (the walk HBM-bound in the plan's model: it keeps P = 1) and at HV = 4
    (8 walk programs: the model expects P > 1 to pay): forward and
    forward+backward times and the walk kernels' device times at P = 1, at the
    plan's P (``gdn_kcp.plan``, this device's SM count) and at P = 2, 4, 8,
    each checked against P = 1 (the largest relative RMS of o and the gradients)."""
    H_qk, HV, K, V = dims
    out = {}
    for heads in dict.fromkeys((HV, 4)):
        out[f"HV={heads}"] = segment_times(device, (min(H_qk, heads), heads, K, V), dtype, bounds[-1])
    results["segments"] = out


def kernel_ms(fn, device) -> dict[str, float]:
    """Milliseconds of each profiler event with time in one call of ``fn``:
    device time on a GPU, self CPU time on the CPU (where events are ops)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0) if device.type == "cuda" else event.self_cpu_time_total
        if us > 0:
            times[event.key] = us / 1e3
    return times


def walk_kernel_ms(fn, device) -> dict[str, float]:
    """Milliseconds of each walk and segment kernel (:data:`WALK_KERNELS`) in one call of ``fn``."""
    walks = {}
    for key, ms in kernel_ms(fn, device).items():
        name = next((w for w in WALK_KERNELS if key.startswith(w)), None)
        if name:
            walks[name] = walks.get(name, 0.0) + ms
    return {name: round(ms, 3) for name, ms in walks.items()}


def segment_times(device, dims, dtype, T):
    """:func:`time_segments` at one head count; with the forward walk's time in
    the plan's model beside its measured one (``gdn_kcp.plan.walk_cost``), and
    the P of the least measured forward walk."""
    from gdn_kcp.plan import plan_segments, segment_range, walk_cost

    H_qk, HV, K, V = dims
    ctx = build_kcp_context([0, T], device=device)
    plan = plan_segments(ctx, HV, K, V)
    xs = [x.requires_grad_() for x in inputs(T, H_qk, HV, K, V, dtype, device)]
    do = torch.randn_like(xs[2])
    rows, reference = {}, None
    for P in sorted({1, plan, 2, 4, 8} & set(range(1, segment_range(ctx) + 1))):
        options = OptionsKcp(use_qk_l2norm=True, segments=P)

        def run():
            return gdn_kcp(*xs, ctx, options=options)[0]

        grads = torch.autograd.grad((run() * do).sum(), xs)
        outputs = [run().detach(), *grads]
        if reference is None:
            reference = outputs
        with torch.no_grad():
            forward = timed(run, device)
            forward_walks = walk_kernel_ms(run, device)
        both = timed(lambda: torch.autograd.grad((run() * do).sum(), xs), device)
        walks = walk_kernel_ms(lambda: torch.autograd.grad((run() * do).sum(), xs), device)
        model = walk_cost(P, chunks=ctx.plan_chunks, frags=ctx.plan_frags, HV=HV, K=K, V=V, n_sms=ctx.n_sms)
        rows[P] = {"forward_ms": forward, "forward_backward_ms": both, "walk_kernels_ms": walks,
                   "walk_ms": round(sum(walks.values()), 3),
                   "forward_walk_ms": round(sum(forward_walks.values()), 3),
                   "model_forward_walk_ms": round(model * 1e3, 3),
                   "max_relative_rms_vs_p1": max(rel_rms(a, b) for a, b in zip(outputs, reference))}
    best = min(rows, key=lambda P: rows[P]["forward_walk_ms"])
    return {"plan_P": plan, "measured_best_P": best, "n_sms": ctx.n_sms, "by_P": rows}


def _flash_qla_entry():
    """FlashQLA's chunked GDN when ``flash_qla`` imports (its ``chunk_gated_delta_rule``,
    FLA's call form), else None."""
    try:
        import flash_qla
    except ImportError:
        return None
    return getattr(flash_qla, "chunk_gated_delta_rule", None)


def check_calibration(results, device, dims, dtype, bounds):
    """The model's calibration rows (``roofline.CALIBRATION``: one sequence,
    K = V = 128, bf16, FLA 0.5.1's published H200 times): forward and
    backward ms of ours, FLA's and, when ``flash_qla`` imports, FlashQLA's,
    each beside the calibrated model's estimate, so one run recalibrates it.
    Times are eager (the published ones and the model: CUDA-graph replays),
    the backward is forward+backward minus forward."""
    import roofline

    facts = roofline.load_facts()
    paths = {"gdn_kcp": None}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdr

        paths["fla"] = fla_gdr
    except Exception as error:
        results["calibration_fla_error"] = f"{type(error).__name__}: {error}"
    if _flash_qla_entry() is not None:
        paths["flash_qla"] = _flash_qla_entry()
    published = {(m.H, m.HV, m.T, m.phase): m.ms for m in roofline.CALIBRATION}
    rows = []
    for H_qk, HV, T in sorted({(m.H, m.HV, m.T) for m in roofline.CALIBRATION}, reverse=True):
        dry = device.type == "cpu"  # the dry run: the interpreter, tiny shapes, one timing
        run_T, K, run_heads = (96, 16, (max(1, H_qk // 8), max(1, HV // 8))) if dry else (T, 128, (H_qk, HV))
        xs = [x.requires_grad_() for x in inputs(run_T, *run_heads, K, K, dtype, device)]
        cu = torch.tensor([0, run_T], dtype=torch.long, device=device)
        ctx = build_kcp_context([0, run_T], device=device)
        do = torch.randn_like(xs[2])
        model = roofline.compare(roofline.model_shape(T, 1, H_qk, HV), facts)
        row = {"H_qk": H_qk, "HV": HV, "T": T, "run_T": run_T, "run_heads": run_heads,
               "published_fla_ms": {phase: published.get((H_qk, HV, T, phase)) for phase in ("forward", "backward")},
               "model_ms": {name: {"forward": round(r["forward_ms"], 3), "backward": round(r["backward_ms"], 3)}
                            for name, r in model.items()}}
        for name, entry in paths.items():
            def fn(entry=entry):
                if entry is None:
                    return gdn_kcp(*xs, ctx, use_qk_l2norm_in_kernel=True)[0]
                return entry(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]

            try:
                repeats = dict(repeats=1, warmup=0) if dry else {}
                with torch.no_grad():
                    forward = timed(fn, device, **repeats)
                both = timed(lambda: torch.autograd.grad((fn() * do).sum(), xs), device, **repeats)
                row[f"{name}_ms"] = {"forward": round(forward, 3), "backward": round(both - forward, 3)}
            except Exception as error:
                row[f"{name}_error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
    results["calibration"] = rows


def check_decode(results, device, dims, dtype, bounds):
    """Our GatedDeltaNet at FLA's layer head sizes (head_dim 256, expand_v 2: K =
    256, V = 512): a prefill and 16 decode steps against the full forward, the
    time per decode step (B = 8 rows), and, when flash-linear-attention's layer
    imports, the same state dict in FLA's layer: its forward and its own
    prefill + steps (FLA's cache protocol, our Cache object) against ours."""
    from gdn_kcp.layers import Cache, GatedDeltaNet

    small = device.type == "cpu"
    config = dict(hidden_size=64, head_dim=16, num_heads=2, expand_v=2) if small else \
        dict(hidden_size=1024, head_dim=256, num_heads=4, expand_v=2)
    B, T, steps = (2, 80, 4) if small else (8, 2048, 16)
    torch.manual_seed(0)
    ours = GatedDeltaNet(layer_idx=0, **config).to(device, dtype).eval()
    x = torch.randn(B, T + steps, config["hidden_size"], device=device, dtype=dtype)

    def decode(layer):
        cache, outputs = Cache(), []
        with torch.no_grad():
            outputs.append(layer(x[:, :T], use_cache=True, past_key_values=cache)[0])
            for t in range(T, T + steps):
                outputs.append(layer(x[:, t:t + 1], use_cache=True, past_key_values=cache)[0])
        return torch.cat(outputs, 1), cache

    with torch.no_grad():
        full = ours(x)[0]
    decoded, cache = decode(ours)
    token = x[:, T:T + 1]
    with torch.no_grad():  # a step that reads the cache and leaves it, timed again and again
        step_ms = timed(lambda: ours(token, use_cache=False, past_key_values=cache)[0], device)
    row = dict(config=config, B=B, prompt=T, steps=steps, decode_vs_full_relative_rms=rel_rms(decoded, full),
               decode_step_ms=step_ms)
    try:
        from fla.layers import GatedDeltaNet as FlaGatedDeltaNet

        theirs = FlaGatedDeltaNet(layer_idx=0, **config).to(device, dtype).eval()
        ours.load_state_dict(theirs.state_dict(), strict=True)
        with torch.no_grad():
            row["fla_forward_vs_ours_relative_rms"] = rel_rms(theirs(x)[0], ours(x)[0])
        row["fla_decode_vs_ours_relative_rms"] = rel_rms(decode(theirs)[0], decode(ours)[0])
        fla_cache = decode(theirs)[1]
        with torch.no_grad():
            row["fla_decode_step_ms"] = timed(
                lambda: theirs(token, use_cache=False, past_key_values=fla_cache)[0], device)
    except Exception as error:  # FLA's layers (flash-linear-attention, transformers) absent or failing
        row["fla_error"] = f"{type(error).__name__}: {error}"
    results["decode"] = row


def check_lowering(results, device, dims, dtype, bounds):
    """The traced host path (``gdn_kcp.trace_host_path``): the FLA entry's
    forward+backward compiled with it against eager, whether the output code
    still calls a gdn_kcp op, how many Triton kernels it launches, and its
    time beside the opaque ops' compiled graph and eager. The dry run traces
    the torch programs with aot_eager (Inductor's C++ takes minutes on a CPU)."""
    from torch._inductor.utils import run_and_get_code

    H_qk, HV, K, V = dims
    T = min(bounds[-1], 8192)
    cu = torch.tensor([b for b in bounds if b < T] + [T], device=device)
    xs = inputs(T, H_qk, HV, K, V, dtype, device)
    do = torch.randn_like(xs[2])

    def step(q, k, v, g, b):
        return chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in xs]
        o = fn(*leaves)
        return [o.detach(), *torch.autograd.grad((o * do).sum(), leaves)]

    cuda = device.type == "cuda"
    backend = "inductor" if cuda else "aot_eager"
    row = {"T": T, "documents": len(cu) - 1, "backend": backend}
    with _null() if cuda else use_programs("cpu", "torch"):
        eager = run(step)
        torch._dynamo.reset()
        opaque = torch.compile(step, fullgraph=True, backend=backend)
        run(opaque)
        row["opaque_ms"] = timed(lambda: run(opaque), device, 3, 1)
        row["eager_ms"] = timed(lambda: run(step), device, 3, 1)
        traced = torch.compile(step, fullgraph=True, backend=backend)
        with trace_host_path():
            start = time.perf_counter()
            got, codes = run_and_get_code(run, traced)
            row["compile_s"] = round(time.perf_counter() - start, 1)
            row["traced_ms"] = timed(lambda: run(traced), device, 3, 1)
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    row["relative_rms_vs_eager"] = {n: rel_rms(a, b) for n, a, b in zip(names, got, eager)}
    row["calls_gdn_kcp_op"] = any("gdn_kcp" in code for code in codes) if codes else None  # aot_eager: no code
    row["triton_launches_in_code"] = sum(code.count(".run(") for code in codes)
    row["pass"] = all(e < 1e-2 for e in row["relative_rms_vs_eager"].values()) and row["calls_gdn_kcp_op"] is not True
    results["lowering"] = row


def check_checkpointing(results, device, dims, dtype, bounds):
    """GDN under ``torch.utils.checkpoint`` on this torch, its release taken as
    verified for the check (``gdn_kcp.checkpointing.VERIFIED_TORCH`` gains it
    once this passes): for a region the call closes ("core") and one a relu
    closes after it ("later"), under each ``reuse_recompute_tapes``, the
    gradients bitwise those without checkpoint, and what the probe chose."""
    from gdn_kcp import checkpointing

    H_qk, HV, K, V = dims
    ctx = build_kcp_context(bounds, device=device)
    xs = inputs(bounds[-1], H_qk, HV, K, V, dtype, device)
    do = torch.randn_like(xs[2])
    release, verified = checkpointing.torch_release(), checkpointing.VERIFIED_TORCH
    checkpointing.VERIFIED_TORCH = (*verified, release)

    def grads(region: str, checkpointed: bool, options: OptionsKcp) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in xs]

        def fn(*x):
            o = gdn_kcp(*x, ctx, options=options)[0]
            return torch.relu(o) if region == "later" else o
        o = torch.utils.checkpoint.checkpoint(fn, *leaves, use_reentrant=False) if checkpointed else fn(*leaves)
        return list(torch.autograd.grad((o * do).sum(), leaves))

    cases = {}
    try:
        for region in ("core", "later"):
            for reuse in (None, True, False):
                options = OptionsKcp(use_qk_l2norm=True, reuse_recompute_tapes=reuse)
                plain, got = grads(region, False, options), grads(region, True, options)
                record = checkpointing.last_checkpoint_record()
                cases[f"{region}, reuse {reuse}"] = dict(
                    bitwise=all(torch.equal(a, b) for a, b in zip(plain, got)), phase=record.phase,
                    kept_tapes=record.kept_tapes, in_workspace=record.tapes_in_workspace,
                    output_skipped=record.output_skipped, reasons=record.reasons)
    finally:
        checkpointing.VERIFIED_TORCH = verified
    results["checkpointing"] = {"torch": release, "verified_before": release in verified, "cases": cases,
                                "pass": all(c["bitwise"] and c["phase"] == "recompute" for c in cases.values())}


STEPS = {"programs": "check_programs", "forward_backward": "check_forward_backward", "timing": "time_paths",
         "profile": "profile_kernels", "segments": "time_segments", "reduce_overhead": "check_reduce_overhead",
         "capture_once": "check_capture_once", "decode": "check_decode", "calibration": "check_calibration",
         "lowering": "check_lowering", "checkpointing": "check_checkpointing"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton under the interpreter")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated subset of: " + ", ".join(STEPS))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        device, T, dims, dtype = torch.device("cpu"), 300, (1, 2, 32, 32), torch.bfloat16
    else:
        device, T, dims, dtype = torch.device("cuda"), 32768, (16, 32, 128, 128), torch.bfloat16
    bounds = packing(T) if not args.dry_run else [0, 70, 70, 71, 200, 300]
    results = {
        "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "python": platform.python_version(),
        "triton": __import__("triton").__version__, "T": T, "documents": len(bounds) - 1,
        "H_qk, HV, K, V": dims, "dtype": str(dtype),
    }
    steps = [globals()[STEPS[name]] for name in args.steps.split(",")]
    context = use_programs("cpu", "triton") if args.dry_run else _null()
    with context:
        for step in steps:
            start = time.perf_counter()
            try:
                step(results, device, dims, dtype, bounds)
            except Exception:
                results.setdefault("errors", {})[step.__name__] = traceback.format_exc()
            results.setdefault("seconds", {})[step.__name__] = round(time.perf_counter() - start, 1)
            (args.out / "gpu_check.json").write_text(json.dumps(results, indent=2, default=str))
            print(f"{step.__name__}: {results['seconds'][step.__name__]} s", flush=True)
    (args.out / "gpu_check.md").write_text(markdown(results))
    print(markdown(results))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def markdown(r: dict) -> str:
    lines = [f"## GPU check, {r['date']}, {r['device']}",
             f"torch {r['torch']}, triton {r['triton']}, python {r['python']}; T = {r['T']} "
             f"({r['documents']} documents), (H_qk, HV, K, V) = {r['H_qk, HV, K, V']}, {r['dtype']}", ""]
    if "programs" in r:
        worst = max(r["programs"]["max_relative_error"].items(), key=lambda kv: kv[1])
        lines.append(f"- programs vs torch twins: {'pass' if r['programs']['pass'] else 'FAIL'} "
                     f"(worst {worst[0]} {worst[1]:.1e}, limit {r['programs']['limit']})")
    if "forward_backward" in r:
        errors = r["forward_backward"]["relative_rms_vs_torch_programs"]
        lines.append(f"- forward+backward vs torch programs: {'pass' if r['forward_backward']['pass'] else 'FAIL'} "
                     + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    for name, row in r.get("timing", {}).items():
        lines.append(f"- {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    for name, row in r.get("model", {}).items():
        lines.append(f"- {name}, the calibrated model's estimate (CUDA-graph replays; the timings above are eager): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    if "fla_error" in r:
        lines.append(f"- fla not timed: {r['fla_error'].splitlines()[0]}")
    if "compile" in r:
        c = r["compile"]
        lines.append(f"- torch.compile(mode={c['mode']!r}): rel RMS vs eager {c['relative_rms_vs_eager']:.1e}, "
                     f"step {c['step_ms']:.1f} ms")
    if "lowering" in r:
        c = r["lowering"]
        lines.append(f"- traced host path ({c['backend']}, T = {c['T']}): {'pass' if c['pass'] else 'FAIL'}, "
                     f"rel RMS vs eager " + ", ".join(f"{k} {v:.1e}" for k, v in c["relative_rms_vs_eager"].items())
                     + f"; gdn_kcp op in the code: {c['calls_gdn_kcp_op']}, Triton launches "
                     f"{c['triton_launches_in_code']}; compile {c['compile_s']} s; forward+backward "
                     f"{c['traced_ms']:.2f} ms traced, {c['opaque_ms']:.2f} ms opaque, {c['eager_ms']:.2f} ms eager")
    if "capture_once" in r:
        c = r["capture_once"]
        lines.append(f"- capture once ({c['steps']} packings, max_docs = {c['max_docs']}, mode={c['mode']!r}): "
                     f"{c['dynamo_graphs']} Dynamo graph(s), {c['cuda_graphs_recorded']} CUDA graph(s) recorded "
                     f"(goal 1), worst rel RMS vs eager {c['worst_relative_rms_vs_eager']:.1e}, "
                     f"no host sync: {c.get('no_host_sync', 'not checked')}")
    for path, rows in r.get("kernel_ms", {}).items():
        lines.append(f"- {path} kernels (ms, one forward+backward): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in list(rows.items())[:12]))
    for path, rows in r.get("kernel_tflops", {}).items():
        if rows:  # empty on the CPU: the profiler names ops there, not kernels
            lines.append(f"- {path} achieved TFLOP/s: " + ", ".join(f"{k} {v:.1f}" for k, v in rows.items()))
    if r.get("kernel_ratio_fla_over_ours"):
        lines.append("- FLA time / ours, kernel by kernel: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in r["kernel_ratio_fla_over_ours"].items()))
    for heads, seg in r.get("segments", {}).items():
        lines.append(f"- segments, {heads} (one document of T tokens; the plan's P = {seg['plan_P']} on "
                     f"{seg['n_sms']} SMs, the least measured forward walk at P = {seg['measured_best_P']}): "
                     + "; ".join(f"P = {P}: forward walk {row['forward_walk_ms']:.3f} ms (model "
                                 f"{row['model_forward_walk_ms']:.3f}), all walks {row['walk_ms']:.2f} ms, "
                                 f"forward {row['forward_ms']:.2f} ms, forward+backward "
                                 f"{row['forward_backward_ms']:.2f} ms, rel RMS vs P = 1 "
                                 f"{row['max_relative_rms_vs_p1']:.1e}" for P, row in seg["by_P"].items()))
    for row in r.get("calibration", []):
        measured = "; ".join(f"{name} {row[name + '_ms']['forward']:.3f} / {row[name + '_ms']['backward']:.3f}"
                             for name in ("gdn_kcp", "fla", "flash_qla") if name + "_ms" in row)
        model = "; ".join(f"{name} {m['forward']:.3f} / {m['backward']:.3f}" for name, m in row["model_ms"].items())
        pub = row["published_fla_ms"]
        lines.append(f"- calibration row H_qk {row['H_qk']}, HV {row['HV']}, T {row['T']} (run at T = {row['run_T']}),"
                     f" forward / backward ms: measured (eager) {measured}; model {model}; FLA published "
                     f"{pub['forward']} / {pub['backward']}")
    if "decode" in r:
        d = r["decode"]
        lines.append(f"- decode (layer {d['config']}, B = {d['B']}, prompt {d['prompt']}, {d['steps']} steps): rel RMS "
                     f"vs the full forward {d['decode_vs_full_relative_rms']:.1e}, {d['decode_step_ms']:.3f} ms a step"
                     + (f"; FLA's layer, same state dict: forward rel RMS {d['fla_forward_vs_ours_relative_rms']:.1e}, "
                        f"decode {d['fla_decode_vs_ours_relative_rms']:.1e}, {d['fla_decode_step_ms']:.3f} ms a step"
                        if "fla_forward_vs_ours_relative_rms" in d else
                        f"; FLA's layer not run: {d.get('fla_error', '').splitlines()[0] if d.get('fla_error') else ''}"))
    if "checkpointing" in r:
        c = r["checkpointing"]
        lines.append(f"- checkpointing on torch {c['torch']} (verified before: {c['verified_before']}): "
                     f"{'pass' if c['pass'] else 'FAIL'}; " + "; ".join(
                         f"{name}: bitwise {x['bitwise']}, kept {x['kept_tapes']} (in the workspace "
                         f"{x['in_workspace']}), output skipped {x['output_skipped']}"
                         for name, x in c["cases"].items()))
    for step, error in r.get("errors", {}).items():
        lines.append(f"- {step} FAILED: {error.strip().splitlines()[-1]}")
    lines.append("- seconds per step: " + ", ".join(f"{k} {v}" for k, v in r.get("seconds", {}).items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

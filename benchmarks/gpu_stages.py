"""The GPU check's correctness and timing stages. Each takes the stage's
:class:`~gpu_common.Results` and the run's :class:`~gpu_common.Setup`; each
ratio is measured in this run against a baseline in this run."""

from __future__ import annotations

import dataclasses

import torch
from gpu_common import Setup, forward_backward_ms, leaves, rel_rms, timed

from gdn_kcp import OptionsKcp, build_kcp_context, gdn_kcp
from gdn_kcp.host.programs import use_programs

NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
PROGRAMS_T = 4096
"""Tokens of the per-program comparison: the torch twins walk chunk by chunk."""


def fla_entry():
    """flash-linear-attention's ``chunk_gated_delta_rule`` (raises when it does not import)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def flash_qla_entry():
    """FlashQLA's chunked GDN (FLA's call form) when ``flash_qla`` imports, else None."""
    try:
        import flash_qla
    except ImportError:
        return None
    return getattr(flash_qla, "chunk_gated_delta_rule", None)


def programs(results, s: Setup):
    """Every Triton program against its torch twin on the device (the forward
    and backward programs, then the segment phases at P = 2), relative max
    error of every tensor each writes; KDA's scores, prep, forward walks and
    backward programs so far (a gate per key channel, the gate in kernel) by
    relative RMS."""
    from gdn_kcp.kernels import triton as triton_programs
    from gdn_kcp.kernels.twin_check import (compare_channel_backward, compare_channel_prep, compare_channel_scores,
                                             compare_channel_walks, compare_segments_with_torch, compare_with_torch)

    H_qk, HV, K, V = s.dims
    case = dict(bounds=s.truncated(PROGRAMS_T), H_qk=H_qk, HV=HV, K=K, V=V, dtype=s.dtype, seed=1, l2=True,
                crossing=True, device=str(s.device))
    limit = 1e-2 if s.dtype in (torch.bfloat16, torch.float16) else 1e-4
    results["limit"] = limit
    errors = compare_with_torch(triton_programs, **case)
    results["max_relative_error"] = errors
    segments = compare_segments_with_torch(triton_programs, **case, P=2)
    results["segments_max_relative_error"] = segments
    # KDA's Triton programs so far (a gate per key channel; relative RMS, their twin tests' measure)
    kda = dict(bounds=case["bounds"], H_qk=H_qk, HV=HV, K=K, dtype=s.dtype, seed=1, gate=True, l2=True,
               device=str(s.device))
    kda_errors = {"scores": compare_channel_scores(triton_programs, **kda),
                  **compare_channel_prep(triton_programs, **kda, V=V),
                  **compare_channel_walks(triton_programs, **kda, V=V),
                  **compare_channel_backward(triton_programs, **kda, V=V)}
    results["kda_relative_rms"] = kda_errors
    results["pass"] = all(err < limit for err in [*errors.values(), *segments.values(), *kda_errors.values()])


def forward_backward(results, s: Setup):
    """gdn_kcp (one rank) on the Triton programs against the torch programs,
    the whole packing."""
    ctx = build_kcp_context(list(s.bounds), device=s.device)
    xs = [x.detach() for x in leaves(s)]
    do = torch.randn_like(xs[2])
    outs = {}
    for backend in ("triton", "torch"):
        grads_of = [x.clone().requires_grad_() for x in xs]
        with use_programs(s.device.type, backend):
            o, _ = gdn_kcp(*grads_of, ctx, use_qk_l2norm_in_kernel=True)
            grads = torch.autograd.grad((o * do).sum(), grads_of)
        outs[backend] = [o.detach(), *grads]
    errors = {n: rel_rms(a, b) for n, a, b in zip(NAMES, outs["triton"], outs["torch"])}
    results["relative_rms_vs_torch_programs"] = errors
    results["pass"] = all(e < 1e-2 for e in errors.values())


def time_beside_fla(results, s: Setup, rows: dict, entry, xs, cu, do) -> None:
    """Forward and backward ms of each of our ``rows`` (name: a call giving o)
    and of FLA's ``entry()`` on the same leaves with ``cu_seqlens`` (row
    "fla", beside its output's relative RMS against row "gdn_kcp"; FLA absent
    or failing: ours alone, the reason in ``fla_error``), into ``results["ms"]``."""
    try:
        fla = entry()
        rows["fla"] = lambda: fla(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]
        with torch.no_grad():
            results["fla_vs_ours_o_relative_rms"] = rel_rms(rows["fla"](), rows["gdn_kcp"]())
    except Exception as error:  # noqa: BLE001 - FLA absent or failing: ours alone, the reason reported
        results["fla_error"] = f"{type(error).__name__}: {error}"
    measured = {}
    for name, fn in rows.items():
        ms, how = forward_backward_ms(fn, xs, do, s.device, s.dry)
        measured[name] = dict(ms, how=how)
        results["ms"] = measured


def timing(results, s: Setup):
    """Forward and backward of the whole packing (CUDA-graph replays): ours
    (light, and ``save_mode="inverse"``, which keeps A as FLA does) and FLA's
    with ``cu_seqlens`` (whose index takes host syncs: eager where it cannot
    capture, said in ``how``), beside the calibrated model at this packing."""
    import roofline
    from our_launches import shape_of

    ctx = build_kcp_context(list(s.bounds), device=s.device)
    xs = leaves(s)
    cu = torch.tensor(s.bounds, dtype=torch.long, device=s.device)
    do = torch.randn_like(xs[2])
    rows = {name: (lambda mode=mode: gdn_kcp(*xs, ctx, options=OptionsKcp(use_qk_l2norm=True, save_mode=mode))[0])
            for name, mode in (("gdn_kcp", "light"), ("gdn_kcp_inverse", "inverse"))}
    time_beside_fla(results, s, rows, fla_entry, xs, cu, do)
    shape, facts = shape_of(ctx, *s.dims), roofline.load_facts()
    light = roofline.compare(shape, facts)
    model = {"gdn_kcp": light["ours"], "fla": light["fla"],
             "gdn_kcp_inverse": roofline.compare(shape, facts, save_mode="inverse")["ours"]}
    results["model_ms"] = {name: {"forward": round(r["forward_ms"], 3), "backward": round(r["backward_ms"], 3)}
                           for name, r in model.items()}


def fla_kda_entry():
    """flash-linear-attention's ``chunk_kda`` (raises when it does not import)."""
    from fla.ops.kda import chunk_kda

    return chunk_kda


def kda_leaves(s: Setup, T: int | None = None) -> list[torch.Tensor]:
    """:func:`leaves` with a gate per key channel ``[1, T, HV, K]`` (near
    exp(g) = 0.98 as GDN's, drawn per channel) in place of the scalar one."""
    xs = leaves(s, T)
    H_qk, HV, K, V = s.dims
    gen = torch.Generator(device="cpu").manual_seed(1)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T or s.T, HV, K, generator=gen) + 4)
    xs[3] = g.to(device=s.device, dtype=s.dtype).requires_grad_()
    return xs


def kda(results, s: Setup):
    """KDA (a gate per key channel) over the whole packing: ours (``chunk_kda``,
    the default light save mode) and FLA's ``chunk_kda`` with ``cu_seqlens``,
    forward and backward (CUDA-graph replays where they capture), beside the
    model's KDA rows at this packing (``roofline.compare_kda``); ours against
    FLA's output (relative RMS) as a check that both ran the same call."""
    import roofline
    from our_launches import shape_of

    from gdn_kcp import chunk_kda

    xs = kda_leaves(s)
    cu = torch.tensor(s.bounds, dtype=torch.long, device=s.device)
    do = torch.randn_like(xs[2])
    rows = {"gdn_kcp": lambda: chunk_kda(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]}
    time_beside_fla(results, s, rows, fla_kda_entry, xs, cu, do)
    ctx = build_kcp_context(list(s.bounds))
    model = roofline.compare_kda(shape_of(ctx, *s.dims), roofline.load_facts())
    results["model_ms"] = {name: {"forward": round(r["forward_ms"], 3), "backward": round(r["backward_ms"], 3)}
                           for name, r in model.items()}


def calibration(results, s: Setup):
    """The model's calibration rows (``roofline.CALIBRATION``: one sequence,
    K = V = 128, bf16): forward and backward ms of ours, FLA's and FlashQLA's
    (when they import), CUDA-graph replays as FLA's published times and the
    model count, each beside the model's estimate. ``roofline.py
    --recalibrate`` refits the model on the FLA rows of this stage. FLA runs
    without ``cu_seqlens`` (one sequence), so it captures."""
    import roofline

    facts = roofline.load_facts()
    paths = {"gdn_kcp": None}
    try:
        paths["fla"] = fla_entry()
    except Exception as error:  # noqa: BLE001
        results["fla_error"] = f"{type(error).__name__}: {error}"
    flash_qla = flash_qla_entry()
    if flash_qla is not None:
        paths["flash_qla"] = flash_qla
    published = {(m.H, m.HV, m.T, m.phase): m.ms for m in roofline.CALIBRATION}
    rows = []
    for H_qk, HV, T in sorted({(m.H, m.HV, m.T) for m in roofline.CALIBRATION}, reverse=True):
        run_T, K, heads = (96, s.dims[2], (max(1, H_qk // 8), max(1, HV // 8))) if s.dry else (T, 128, (H_qk, HV))
        xs = leaves(s, run_T, heads)
        ctx = build_kcp_context([0, run_T], device=s.device)
        do = torch.randn_like(xs[2])
        model = roofline.compare(roofline.model_shape(T, 1, H_qk, HV), facts)
        row = {"H_qk": H_qk, "HV": HV, "T": T, "K": K, "run_T": run_T, "run_heads": list(heads),
               "published_fla_ms": {phase: published.get((H_qk, HV, T, phase)) for phase in ("forward", "backward")},
               "model_ms": {name: {"forward": round(r["forward_ms"], 3), "backward": round(r["backward_ms"], 3)}
                            for name, r in model.items()}}
        hows = []
        for name, entry in paths.items():
            def fn(entry=entry):
                if entry is None:
                    return gdn_kcp(*xs, ctx, use_qk_l2norm_in_kernel=True)[0]
                return entry(*xs, use_qk_l2norm_in_kernel=True)[0]

            try:
                row[f"{name}_ms"], how = forward_backward_ms(fn, xs, do, s.device, s.dry)
                row[f"{name}_timing"] = how
                hows.append(how)
            except Exception as error:  # noqa: BLE001 - one path failing leaves the others' rows
                row[f"{name}_error"] = f"{type(error).__name__}: {error}"
        row["timing"] = "cuda_graph" if hows and all(h == "cuda_graph" for h in hows) else "eager"
        rows.append(row)
        results["calibration"] = rows


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


def step_kernel_ms(fn, xs, do, device) -> dict[str, float]:
    """Every profiler event's milliseconds (:func:`kernel_ms`) in one
    forward+backward of ``fn``, after a first one that compiles and
    autotunes; names cut at 80 characters, longest first."""
    def step():
        return torch.autograd.grad((fn() * do).sum(), xs)

    step()
    rows = {key[:80]: round(ms, 3) for key, ms in kernel_ms(step, device).items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def profile(results, s: Setup):
    """Per-kernel device time of one forward+backward (torch.profiler), ours and
    FLA's when it imports, with the achieved TFLOP/s of every kernel the model
    counts and FLA's time over ours kernel by kernel; then KDA's
    (:func:`profile_kda`)."""
    ctx = build_kcp_context(list(s.bounds), device=s.device)
    xs = leaves(s)
    cu = torch.tensor(s.bounds, dtype=torch.long, device=s.device)
    do = torch.randn_like(xs[2])
    paths = {"gdn_kcp": lambda: gdn_kcp(*xs, ctx, use_qk_l2norm_in_kernel=True)[0]}
    try:
        fla = fla_entry()
        paths["fla"] = lambda: fla(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]
    except Exception:  # noqa: BLE001 - ours alone
        pass
    table = {name: dict(list(step_kernel_ms(fn, xs, do, s.device).items())[:25]) for name, fn in paths.items()}
    results["kernel_ms"] = table
    results["kernel_tflops"] = achieved_tflops(table, ctx, s.dims)
    if "fla" in table:
        results["kernel_ratio_fla_over_ours"] = counterpart_ratios(table["gdn_kcp"], table["fla"])
    profile_kda(results, s)


def profile_kda(results, s: Setup):
    """KDA's per-kernel device time of one forward+backward at the model's
    KDA headline: one document of the check's T tokens, its heads and head
    dims, the default light save mode; ours (``chunk_kda``) and, where it
    imports, FLA's ``chunk_kda`` on both intra paths (``safe_gate`` False
    and True), under :data:`roofline.KDA_SIDES`' names. Every event is kept
    (``kda_kernel_ms``): ``recalibrate.py`` fits the rate of the elementwise
    work, which no GDN row has, to the kernels the model counts. The shape
    and our segments there (``kda_shape``) are what the model is evaluated
    at. Each path is on disk once profiled: a stage stopped at its cap keeps
    the paths it finished (FLA's safe-gate path last: its own kernels, which
    no earlier stage ran, autotune on its first call)."""
    from gdn_kcp import chunk_kda
    from gdn_kcp.plan import segments_for

    H_qk, HV, K, V = s.dims
    bounds = [0, s.T]
    P = segments_for(build_kcp_context(bounds, device=s.device), HV, K, V, None)
    results["kda_shape"] = {"T": s.T, "documents": 1, "H_qk": H_qk, "HV": HV, "K": K, "V": V, "P": P,
                            "dtype": str(s.dtype).removeprefix("torch.")}
    xs = kda_leaves(s)
    cu = torch.tensor(bounds, dtype=torch.long, device=s.device)
    do = torch.randn_like(xs[2])
    table = {"ours": step_kernel_ms(lambda: chunk_kda(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0], xs, do,
                                    s.device)}
    results["kda_kernel_ms"] = table
    try:
        fla = fla_kda_entry()
    except Exception as error:  # noqa: BLE001 - ours alone
        results["kda_fla_error"] = f"{type(error).__name__}: {error}"
        return
    for name, safe_gate in (("fla", False), ("fla_safe_gate", True)):
        def fn(safe_gate=safe_gate):
            return fla(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, safe_gate=safe_gate)[0]

        try:
            table[name] = step_kernel_ms(fn, xs, do, s.device)
        except Exception as error:  # noqa: BLE001 - one path failing leaves the other's rows
            results[f"kda_{name}_error"] = f"{type(error).__name__}: {error}"
        results["kda_kernel_ms"] = table


def achieved_tflops(kernel_ms: dict, ctx, dims) -> dict:
    """Achieved TFLOP/s of every profiled kernel the static model counts: its
    FLOPs in one forward+backward (``launch_model.kernel_flops`` at this context's
    tokens, chunks and documents) over its measured time."""
    from fla_launches import fla_launches
    from launch_model import kernel_flops
    from our_launches import our_launches, plan_p, pool_element_sizes, shape_of

    shape = shape_of(ctx, *dims)
    elements = pool_element_sizes(ctx, shape, OptionsKcp(use_qk_l2norm=True))
    flops = {"gdn_kcp": kernel_flops(our_launches(shape, elements, P=plan_p(ctx, shape))),
             "fla": kernel_flops(fla_launches(shape))}
    return {name: {kernel: round(flops[name][kernel] / (ms * 1e-3) / 1e12, 2)
                   for kernel, ms in rows.items() if flops[name].get(kernel) and ms > 0}
            for name, rows in kernel_ms.items()}


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


WALK_KERNELS = ("walk_output", "tape_walk", "segment_summary", "compose_segments", "adjoint_walk",
                "adjoint_segment_summary", "compose_adjoints")
"""The kernels of the state walks and of the segment phases (profiler names
start with them; the forward's walk is the walk with the output)."""


def walk_kernel_ms(fn, device) -> dict[str, float]:
    """Milliseconds of each walk and segment kernel (:data:`WALK_KERNELS`) in one call of ``fn``."""
    walks = {}
    for key, ms in kernel_ms(fn, device).items():
        name = next((w for w in WALK_KERNELS if key.startswith(w)), None)
        if name:
            walks[name] = walks.get(name, 0.0) + ms
    return {name: round(ms, 3) for name, ms in walks.items()}


def segments(results, s: Setup):
    """Intra-rank segments on one long document of T tokens, at the check's HV
    (the walk HBM-bound in the plan's model: it keeps P = 1) and at HV = 4
    (the model expects P > 1 to pay): the walk kernels' device times at P = 1,
    the plan's P (this device's SM count) and 2, 4, 8, the plan's model of the
    forward walk beside them, each P checked against P = 1."""
    H_qk, HV, K, V = s.dims
    for heads in (4,) if s.dry else dict.fromkeys((HV, 4)):  # the dry run: one head count, P = 1 and 2
        results[f"HV={heads}"] = segment_times(s, (min(H_qk, heads), heads))


def segment_times(s: Setup, heads: tuple[int, int]) -> dict:
    from gdn_kcp.plan import plan_segments, segment_range, walk_cost

    HV, K, V = heads[1], s.dims[2], s.dims[3]
    ctx = build_kcp_context([0, s.T], device=s.device)
    plan = plan_segments(ctx, HV, K, V)
    xs = leaves(s, heads=heads)
    do = torch.randn_like(xs[2])
    repeats = s.repeats()
    rows, reference = {}, None
    candidates = {1, plan, 2} if s.dry else {1, plan, 2, 4, 8}
    for P in sorted(candidates & set(range(1, segment_range(ctx) + 1))):
        options = OptionsKcp(use_qk_l2norm=True, segments=P)

        def run():
            return gdn_kcp(*xs, ctx, options=options)[0]

        def step():
            return torch.autograd.grad((run() * do).sum(), xs)

        outputs = [run().detach(), *step()]
        reference = reference or outputs
        with torch.no_grad():
            forward_walks = walk_kernel_ms(run, s.device)
        walks = walk_kernel_ms(step, s.device)
        rows[P] = {"forward_backward_ms": round(timed(step, s.device, **repeats), 3), "walk_kernels_ms": walks,
                   "walk_ms": round(sum(walks.values()), 3),
                   "forward_walk_ms": round(sum(forward_walks.values()), 3),
                   "model_forward_walk_ms": round(walk_cost(P, chunks=ctx.plan_chunks, frags=ctx.plan_frags, HV=HV,
                                                            K=K, V=V, n_sms=ctx.n_sms) * 1e3, 3),
                   "max_relative_rms_vs_p1": max(rel_rms(a, b) for a, b in zip(outputs, reference))}
    best = min(rows, key=lambda P: rows[P]["forward_walk_ms"])
    return {"plan_P": plan, "measured_best_P": best, "n_sms": ctx.n_sms, "by_P": rows}


def decode(results, s: Setup):
    """Our GatedDeltaNet at FLA's layer head sizes (head_dim 256, expand_v 2: K =
    256, V = 512) and our KimiDeltaAttention at FLA's KDA defaults (head_dim 128):
    each a prefill and 16 decode steps against the full forward, the time per
    decode step (B = 8 rows), and, when flash-linear-attention's layer imports,
    the same state dict in FLA's layer: its forward and its own prefill + steps
    (FLA's cache protocol, our Cache object) against ours. KDA's figures are
    ``kda_``-prefixed."""
    from gdn_kcp.layers import GatedDeltaNet, KimiDeltaAttention

    B, T, steps = (2, 80, 4) if s.dry else (8, 2048, 16)
    results.update(B=B, prompt=T, steps=steps)
    gdn = dict(hidden_size=64, head_dim=16, num_heads=2, expand_v=2) if s.dry else \
        dict(hidden_size=1024, head_dim=256, num_heads=4, expand_v=2)
    results["config"] = gdn
    decode_layer(results, s, GatedDeltaNet, "GatedDeltaNet", gdn, "", B, T, steps)
    kda = dict(hidden_size=64, head_dim=16, num_heads=2) if s.dry else dict(hidden_size=1024, head_dim=128,
                                                                             num_heads=8)
    results["kda_config"] = kda
    decode_layer(results, s, KimiDeltaAttention, "KimiDeltaAttention", kda, "kda_", B, T, steps)


def decode_layer(results, s: Setup, Layer, fla_name: str, config: dict, prefix: str, B: int, T: int, steps: int):
    """:func:`decode`'s figures of one layer class, under ``prefix``."""
    from gdn_kcp.layers import Cache

    torch.manual_seed(0)
    ours = Layer(layer_idx=0, **config).to(s.device, s.dtype).eval()
    x = torch.randn(B, T + steps, config["hidden_size"], device=s.device, dtype=s.dtype)

    def prefill_and_steps(layer):
        cache, outputs = Cache(), []
        with torch.no_grad():
            outputs.append(layer(x[:, :T], use_cache=True, past_key_values=cache)[0])
            for t in range(T, T + steps):
                outputs.append(layer(x[:, t:t + 1], use_cache=True, past_key_values=cache)[0])
        return torch.cat(outputs, 1), cache

    with torch.no_grad():
        full = ours(x)[0]
    decoded, cache = prefill_and_steps(ours)
    token = x[:, T:T + 1]
    repeats = s.repeats()
    with torch.no_grad():  # a step that reads the cache and leaves it, timed again and again
        step_ms = timed(lambda: ours(token, use_cache=False, past_key_values=cache)[0], s.device, **repeats)
    results[prefix + "decode_vs_full_relative_rms"] = rel_rms(decoded, full)
    results[prefix + "decode_step_ms"] = step_ms
    try:
        import fla.layers

        theirs = getattr(fla.layers, fla_name)(layer_idx=0, **config).to(s.device, s.dtype).eval()
        ours.load_state_dict(theirs.state_dict(), strict=True)
        with torch.no_grad():
            results[prefix + "fla_forward_vs_ours_relative_rms"] = rel_rms(theirs(x)[0], ours(x)[0])
        fla_decoded, fla_cache = prefill_and_steps(theirs)
        results[prefix + "fla_decode_vs_ours_relative_rms"] = rel_rms(fla_decoded, prefill_and_steps(ours)[0])
        with torch.no_grad():
            results[prefix + "fla_decode_step_ms"] = timed(
                lambda: theirs(token, use_cache=False, past_key_values=fla_cache)[0], s.device, **repeats)
    except Exception as error:  # noqa: BLE001 - FLA's layers (flash-linear-attention, transformers) absent
        results[prefix + "fla_error"] = f"{type(error).__name__}: {error}"


CUTE_CASES = ((torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64), (torch.float16, 64))
"""(dtype, K = V) of the cute stage: the shapes the CuTe programs are compiled and checked for (docs/cute.md)."""


def cute(results, s: Setup):
    """The CuTe DSL programs (``scores``, ``w_u``) against their torch twins at
    the programs stage's case, in bf16 and fp16 at K = V = 128 and 64 (relative
    max error, the Triton programs' limit), and their milliseconds against the
    Triton programs' in this run. A failing case is recorded and the next one
    runs. The dry run (no GPU) compiles scores for sm_90a and reports its facts."""
    for key, value in (("compile", {}), ("max_relative_error", {}), ("ms", {}), ("limit", 1e-2), ("pass", None)):
        results[key] = value
    try:
        from gdn_kcp.kernels.cute import compile_facts
    except ImportError as error:  # the wheel is not installed: nothing to judge
        results["skipped"] = f"nvidia-cutlass-dsl does not import: {error}"
        return
    if not s.cuda:
        facts = compile_facts.compile_facts("scores", torch.bfloat16, 64)
        results["compile"] = {"scores bfloat16 64": dataclasses.asdict(facts)}
        return
    verdicts = []
    for dtype, D in CUTE_CASES:
        name = f"{str(dtype).removeprefix('torch.')} {D}"
        try:
            errors, ms = cute_case(s, dtype, D)
        except Exception as error:  # noqa: BLE001 - a failing case is a result; the others still run
            results["max_relative_error"] = {**results["max_relative_error"], name: f"{type(error).__name__}: {error}"}
            verdicts.append(False)
            continue
        results["max_relative_error"] = {**results["max_relative_error"], name: errors}
        results["ms"] = {**results["ms"], name: ms}
        verdicts.append(all(e < results["limit"] for e in errors.values()))
    results["pass"] = all(verdicts)


def cute_case(s: Setup, dtype: torch.dtype, D: int) -> tuple[dict, dict]:
    """One case: the twin's and the CuTe program's outputs on the same inputs
    (w_u from the torch prep's A), and the CuTe and Triton programs' times."""
    import importlib

    from gdn_kcp.kernels import CHUNK_SIZE
    from gdn_kcp.kernels import torch as torch_programs
    from gdn_kcp.kernels import triton as triton_programs
    from gdn_kcp.kernels.twin_check import CaseSetup

    cute_scores = importlib.import_module("gdn_kcp.kernels.cute.scores").scores
    cute_w_u = importlib.import_module("gdn_kcp.kernels.cute.w_u").w_u
    H_qk, HV, _, _ = s.dims
    case = CaseSetup(s.truncated(PROGRAMS_T), H_qk, HV, D, D, dtype, seed=1, l2=True, crossing=True,
                     device=str(s.device), capped=False)
    T, q, k, v, g, beta, index = case.T, case.q, case.k, case.v, case.g, case.beta, case.index
    norms = dict(q_rstd=case.new(T, H_qk), k_rstd=case.new(T, H_qk))
    A, w, u = case.new(T, HV, CHUNK_SIZE, pool="A"), case.new(T, HV, D, pool="w"), case.new(T, HV, D, pool="v_new")
    torch_programs.prep(q, k, v, g, beta, index, A_out=A, w_out=w, u_out=u, q_rstd_out=norms["q_rstd"],
                        k_rstd_out=norms["k_rstd"])

    scores_out, w_out, u_out = case.new(T, HV, CHUNK_SIZE, pool="scores"), torch.zeros_like(w), torch.zeros_like(u)

    def run_scores(programs_scores):
        programs_scores(q, k, g, index, scores_out=scores_out, **norms)
        return scores_out.clone()

    def run_w_u(programs_w_u):
        programs_w_u(k, v, g, beta, A, index, k_rstd=norms["k_rstd"], w_out=w_out, u_out=u_out)
        return w_out.clone(), u_out.clone()

    def launch_scores(programs_scores):  # the launch alone: outputs written in place
        return lambda: programs_scores(q, k, g, index, scores_out=scores_out, **norms)

    def launch_w_u(programs_w_u):
        return lambda: programs_w_u(k, v, g, beta, A, index, k_rstd=norms["k_rstd"], w_out=w_out, u_out=u_out)

    def error(ours, twin):
        return ((ours.double() - twin.double()).abs().max() / twin.double().abs().max()).item()
    errors = {"scores": error(run_scores(cute_scores), run_scores(torch_programs.scores))}
    (w_cute, u_cute), (w_twin, u_twin) = run_w_u(cute_w_u), run_w_u(torch_programs.w_u)
    errors.update(w=error(w_cute, w_twin), u=error(u_cute, u_twin))
    ms = {"scores": {"cute": timed(launch_scores(cute_scores), s.device),
                     "triton": timed(launch_scores(triton_programs.scores), s.device)},
          "w_u": {"cute": timed(launch_w_u(cute_w_u), s.device),
                  "triton": timed(launch_w_u(triton_programs.w_u), s.device)}}
    return errors, ms

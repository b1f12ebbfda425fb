"""The GPU check's stages that run the package as users do: the README's
compile-and-capture block and the layer under ``torch.compile(mode=
"reduce-overhead")``, the device's memory against the byte queries, activation
checkpointing on this torch, and the traced host path under Inductor."""

from __future__ import annotations

import logging
import sys
import time
import types
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.utils._python_dispatch
from gpu_common import CountCudaGraphs, Setup, capped_packings, inputs, leaves, rel_rms, synchronize, timed
from markdown_blocks import headed_blocks

from gdn_kcp import OptionsKcp, WorkspaceKcp, build_kcp_context, chunk_gated_delta_rule, gdn_kcp, trace_host_path
from gdn_kcp.host.programs import use_programs

ROOT = Path(__file__).resolve().parent.parent
README_BLOCK = "Compile and capture"


def readme_block(heading: str = README_BLOCK) -> str:
    """The first ```python block under ``heading`` in README.md."""
    for found, code in headed_blocks(ROOT / "README.md"):
        if found == heading:
            return code
    raise LookupError(f"README.md has no python block under {heading!r}")


@contextmanager
def _aot_eager_compile():
    """``torch.compile`` with ``backend="aot_eager"`` where none is named (the
    dry run: Inductor's C++ for the README's block takes tens of seconds on a CPU)."""
    original = torch.compile

    def compile_aot_eager(*args, **kwargs):
        kwargs.setdefault("backend", "aot_eager")
        return original(*args, **kwargs)

    torch.compile = compile_aot_eager
    try:
        yield
    finally:
        torch.compile = original


class SkipReasons(logging.Handler):
    """Inductor's "skipping cudagraphs due to ..." messages (its cudagraphs and
    perf-hint logs, turned on here): on CUDA one per ``cudagraph_skips`` count
    (off CUDA Inductor counts a skip without a message)."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "skipping cudagraphs" in message:
            self.reasons.append(message[:400])


SKIPS = SkipReasons()


def compile_counters() -> dict:
    """Dynamo graphs, graph breaks and Inductor's CUDA-graph skips (with their
    reasons) since :func:`fresh_compile_state`."""
    from torch._dynamo.utils import counters

    return {"dynamo_graphs": counters["stats"]["unique_graphs"], "graph_breaks": dict(counters["graph_break"]),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"], "cudagraph_skip_reasons": list(SKIPS.reasons)}


def fresh_compile_state() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    SKIPS.reasons.clear()
    for artifact in ("cudagraphs", "perf_hints"):  # where the skip messages go (torch 2.13: "cudagraphs")
        try:
            torch._logging.set_logs(**{artifact: True})
        except (TypeError, ValueError):  # an artifact this torch does not have
            pass
    for artifact in ("cudagraphs", "perf_hints"):
        logger = torch._logging.getArtifactLogger("torch._inductor.cudagraph_utils", artifact)
        if SKIPS not in logger.handlers:
            logger.addHandler(SKIPS)


def capture(results, s: Setup):
    """Capture as users run it: the README's compile-and-capture block run as
    written (on CUDA it compiles with ``mode="reduce-overhead"``: one CUDA
    graph over its 3 packings), then the layer (``gdn_kcp.layers.GatedDeltaNet``
    on a capped context with a held workspace) under ``trace_host_path()`` and
    ``mode="reduce-overhead"`` over 4 packings. For each: Dynamo graphs, CUDA
    graphs recorded, ``cudagraph_skips`` (0 wanted; the reasons otherwise), the
    compiled step against eager and its time against eager's."""
    results["readme"] = readme_capture(s)
    results["layer_traced"] = layer_capture(s)
    results["pass"] = all(row.get("cudagraph_skips") == 0 and row.get("one_graph") for row in
                          (results["readme"], results["layer_traced"])) if s.cuda else None


def readme_capture(s: Setup) -> dict:
    module = types.ModuleType("readme_capture")  # Dynamo imports a compiled function's module by name
    sys.modules[module.__name__] = module
    fresh_compile_state()
    with CountCudaGraphs(s.device) as graphs, _aot_eager_compile() if s.dry else _Null():
        exec(compile(readme_block(), f"README.md # {README_BLOCK}", "exec"), module.__dict__)
        row = dict(compile_counters(), cuda_graphs_recorded=graphs.count)
    ns = module.__dict__
    row["device"], row["packings"] = ns["device"], len(ns["steps"])
    # the block's own step, compiled and eager, on its last packing (its first graph is the step function's)
    args = [ns[name] for name in ("q", "k", "v", "g", "b", "ctx")]

    def eager(*args):  # the body of the block's compiled lambda
        return ns["gdn_kcp"](*args, options=ns["options"], workspace=ns["workspace"])[0]


    def step(fn):
        return lambda: fn(*args).float().square().sum().backward()

    row["relative_rms_vs_eager"] = rel_rms(ns["step_fn"](*args).detach().clone(), eager(*args).detach())
    repeats = s.repeats(repeats=20, warmup=3)
    row["compiled_step_ms"] = timed(step(ns["step_fn"]), s.device, **repeats)
    row["eager_step_ms"] = timed(step(eager), s.device, **repeats)
    # one Dynamo graph each for the step and the flat entry; one CUDA graph each for the step's forward and backward
    row["one_graph"] = row["dynamo_graphs"] == 2 and (row["cuda_graphs_recorded"] or 0) <= 2
    return row


def layer_capture(s: Setup) -> dict:
    from gdn_kcp.layers import GatedDeltaNet

    H_qk, HV, K, V = s.dims
    T, max_docs, steps = (256, 8, 3) if s.dry else (8192, 16, 4)
    hidden = 64 if s.dry else 1024
    packings = capped_packings(T, max_docs, steps)
    contexts = [build_kcp_context(b, device=s.device, max_docs=max_docs) for b in packings]
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=hidden, head_dim=K, num_heads=H_qk, num_v_heads=HV, expand_v=V / K,
                          layer_idx=0).to(device=s.device, dtype=s.dtype)
    options = layer.kcp_options()
    workspace = WorkspaceKcp(contexts[0], H_qk, HV, K, V, dtype=s.dtype, options=options, device=s.device)
    x = torch.randn(1, T, hidden, device=s.device, dtype=s.dtype)

    def forward(x, ctx):
        return layer(x, kcp_context=ctx, workspace=workspace, kcp_options=options)[0]

    def step(fn, ctx):
        fn(x, ctx).float().square().mean().backward()

    how = {"mode": "reduce-overhead"} if s.cuda else {"backend": "aot_eager"}  # Inductor's C++: minutes on a CPU
    fresh_compile_state()
    errors = []
    with trace_host_path(), CountCudaGraphs(s.device) as graphs, \
            (use_programs("cpu", "torch") if s.dry else _Null()):
        compiled = torch.compile(forward, fullgraph=True, **how)
        for ctx in contexts:
            eager = forward(x, ctx).detach()
            step(compiled, ctx)
            errors.append(rel_rms(compiled(x, ctx).detach(), eager))
        row = dict(compile_counters(), cuda_graphs_recorded=graphs.count, packings=steps, T=T, max_docs=max_docs,
                   worst_relative_rms_vs_eager=max(errors))
        repeats = s.repeats(repeats=10, warmup=2)
        row["compiled_step_ms"] = timed(lambda: step(compiled, contexts[-1]), s.device, **repeats)
        row["eager_step_ms"] = timed(lambda: step(forward, contexts[-1]), s.device, **repeats)
    row["one_graph"] = row["dynamo_graphs"] == 1 and (row["cuda_graphs_recorded"] or 0) <= 2
    return row


def memory(results, s: Setup):
    """Bytes on the device against the byte queries, for save_mode light,
    inverse and full: the workspace each call allocates (its uint8 arena,
    exactly ``layout.fwd.bytes`` / ``.bwd.bytes``), what the forward leaves
    allocated (o and the saved tensors: ``gdn_saved_layout_kcp``, each rounded
    up to the caching allocator's 512 B), and the forward's and backward's
    peaks above their queried parts (``excess``). Then a checkpointed region
    (``torch.utils.checkpoint``): its backward peak with kept tapes against the
    replay's, beside ``gdn_checkpoint_bytes_kcp``. On the CPU (the dry run)
    the same code runs and the device figures are None."""
    from gdn_kcp import gdn_saved_layout_kcp, gdn_workspace_layout_kcp

    ctx = build_kcp_context(list(s.bounds), device=s.device)
    H_qk, HV, K, V = s.dims
    rows = {}
    for mode in ("light", "inverse", "full"):
        options = OptionsKcp(use_qk_l2norm=True, save_mode=mode)
        layout = gdn_workspace_layout_kcp(ctx, H_qk, HV, K, V, dtype=s.dtype, options=options)
        saved = gdn_saved_layout_kcp(ctx, H_qk, HV, K, V, dtype=s.dtype, options=options)
        xs = leaves(s)
        do = torch.randn_like(xs[2])
        with ArenaSizes() as arenas:
            meter = Meter(s.device)
            o, _ = gdn_kcp(*xs, ctx, options=options)
            after_forward, forward_peak = meter.read()
            meter = Meter(s.device)
            grads = torch.autograd.grad(o, xs, do)
            _, backward_peak = meter.read()
        expected_held = rounded(o.nbytes) + sum(rounded(spec.nbytes) for spec in saved.values())
        row = {"workspace_query": [layout.fwd.bytes, layout.bwd.bytes], "workspace_allocated": arenas.sizes,
               "saved_query": sum(spec.nbytes for spec in saved.values()), "held_after_forward": after_forward,
               "held_expected": expected_held, "forward_peak": forward_peak, "backward_peak": backward_peak}
        if s.cuda:
            row["forward_peak_excess"] = forward_peak - expected_held - rounded(layout.fwd.bytes)
            row["backward_peak_excess"] = backward_peak - sum(rounded(g.nbytes) for g in grads) - rounded(
                layout.bwd.bytes)
        row["pass"] = arenas.sizes == [layout.fwd.bytes, layout.bwd.bytes] and (
            not s.cuda or after_forward == expected_held)
        rows[mode] = row
        results["save_modes"] = rows
        del o, grads, xs
    results["traced"] = traced_memory(s, ctx)
    results["checkpoint"] = checkpoint_memory(s, ctx)


def traced_memory(s: Setup, ctx) -> dict:
    """The traced host path (``gdn_kcp.trace_host_path``) under
    ``torch.compile`` (Inductor on CUDA, aot_eager in the dry run) in light
    mode, whose promise (nothing saved) the partitioner broke hardest; one
    Inductor compile of the traced forward and backward, about as long as
    the lowering stage's. The device memory the compiled forward leaves
    allocated against o plus the saved layout (``gdn_saved_layout_kcp``, each
    rounded as the allocator does): equal means Inductor's real kernels and
    buffers keep what the mode promises (tests/test_compiled_saved.py shows it
    for the graphs on the CPU). Off CUDA the figures and the verdict are None."""
    from gdn_kcp import gdn_saved_layout_kcp

    H_qk, HV, K, V = s.dims
    backend = "inductor" if s.cuda else "aot_eager"
    options = OptionsKcp(use_qk_l2norm=True, save_mode="light")
    saved = gdn_saved_layout_kcp(ctx, H_qk, HV, K, V, dtype=s.dtype, options=options)
    step = torch.compile(lambda *x: gdn_kcp(*x, ctx, options=options)[0], fullgraph=True, backend=backend)
    xs = leaves(s)
    fresh_compile_state()
    with trace_host_path():
        step(*xs).sum().backward()  # compiles both graphs; nothing of it stays allocated
        meter = Meter(s.device)
        o = step(*xs)
        held, _ = meter.read()
        o.sum().backward()
    expected = rounded(o.nbytes) + sum(rounded(spec.nbytes) for spec in saved.values())
    return {"light": {"backend": backend, "held_after_forward": held, "held_expected": expected,
                      "pass": held == expected if s.cuda else None}}


def rounded(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts for a tensor of ``nbytes``."""
    return -(-nbytes // 512) * 512


class ArenaSizes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the sizes of the uint8 buffers allocated: the calls' workspace arenas."""

    def __enter__(self):
        self.sizes = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided) and \
                isinstance(out, torch.Tensor) and out.dtype == torch.uint8:
            self.sizes.append(out.numel())
        return out


class Meter:
    """Bytes allocated on a CUDA device since it was made: ``read()`` gives
    (now, peak) above the start; (None, None) off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()

    def read(self) -> tuple[int | None, int | None]:
        if not self.cuda:
            return None, None
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - self.base, torch.cuda.max_memory_allocated() - self.base


@contextmanager
def this_release_verified():
    """This torch's release among ``gdn_kcp.checkpointing.VERIFIED_TORCH``
    while the block runs (the check measures the probe whatever the release;
    the report says whether it was verified before); yields (release, verified
    before)."""
    from gdn_kcp import checkpointing as probe

    release, verified = probe.torch_release(), probe.VERIFIED_TORCH
    probe.VERIFIED_TORCH = (*verified, release)
    try:
        yield release, release in verified
    finally:
        probe.VERIFIED_TORCH = verified


def region(ctx, options: OptionsKcp, closed_by: str):
    """A checkpointable region: GDN, closed by the call itself (``"core"``:
    the region's last saver) or by a relu after it (``"later"``: a later saver)."""
    def fn(*x):
        o = gdn_kcp(*x, ctx, options=options)[0]
        return torch.relu(o) if closed_by == "later" else o
    return fn


def checkpoint_memory(s: Setup, ctx) -> dict:
    """The backward peak of a checkpointed region closed by a relu (a later
    saver) with ``reuse_recompute_tapes`` True against False: kept tapes cost
    ``kept_tapes`` more; and a region the call closes, "auto" against False
    (the tapes in the backward's workspace: no more)."""
    from gdn_kcp import gdn_checkpoint_bytes_kcp

    H_qk, HV, K, V = s.dims
    peaks = {}
    with this_release_verified() as (release, verified_before):
        for closed_by, reuse in (("later", True), ("later", False), ("core", None), ("core", False)):
            xs = leaves(s)
            do = torch.randn_like(xs[2])
            fn = region(ctx, OptionsKcp(use_qk_l2norm=True, reuse_recompute_tapes=reuse), closed_by)
            o = torch.utils.checkpoint.checkpoint(fn, *xs, use_reentrant=False)
            meter = Meter(s.device)
            torch.autograd.grad(o, xs, do)
            peaks[f"{closed_by}, reuse {reuse}"] = meter.read()[1]
            del o, xs
    query = gdn_checkpoint_bytes_kcp(ctx, H_qk, HV, K, V, dtype=s.dtype, options=OptionsKcp(use_qk_l2norm=True))
    row = {"torch": release, "verified_before": verified_before, "backward_peaks": peaks,
           "kept_tapes_query": query.kept_tapes}
    if s.cuda:
        row["later_true_minus_false"] = peaks["later, reuse True"] - peaks["later, reuse False"]
        row["core_auto_minus_false"] = peaks["core, reuse None"] - peaks["core, reuse False"]
    return row


def checkpointing(results, s: Setup):
    """GDN under ``torch.utils.checkpoint`` on this torch, its release taken as
    verified for the check (``gdn_kcp.checkpointing.VERIFIED_TORCH`` gains it
    once this passes): for a region the call closes ("core") and one a relu
    closes after it ("later"), under each ``reuse_recompute_tapes``, the
    gradients bitwise those without checkpoint, and what the probe chose."""
    from gdn_kcp.checkpointing import last_checkpoint_record

    ctx = build_kcp_context(list(s.bounds), device=s.device)
    xs = [x.detach() for x in leaves(s)]
    do = torch.randn_like(xs[2])

    def grads(fn, checkpointed: bool) -> list[torch.Tensor]:
        grads_of = [x.clone().requires_grad_() for x in xs]
        o = torch.utils.checkpoint.checkpoint(fn, *grads_of, use_reentrant=False) if checkpointed else fn(*grads_of)
        return list(torch.autograd.grad((o * do).sum(), grads_of))

    cases = {}
    with this_release_verified() as (release, verified_before):
        results.update(torch=release, verified_before=verified_before)
        for closed_by in ("core", "later"):
            for reuse in (None, True, False):
                fn = region(ctx, OptionsKcp(use_qk_l2norm=True, reuse_recompute_tapes=reuse), closed_by)
                plain, got = grads(fn, False), grads(fn, True)
                record = last_checkpoint_record()
                cases[f"{closed_by}, reuse {reuse}"] = dict(
                    bitwise=all(torch.equal(a, b) for a, b in zip(plain, got)), phase=record.phase,
                    kept_tapes=record.kept_tapes, in_workspace=record.tapes_in_workspace,
                    output_skipped=record.output_skipped, reasons=record.reasons)
                results["cases"] = cases
    results["pass"] = all(c["bitwise"] and c["phase"] == "recompute" for c in cases.values())


def lowering(results, s: Setup):
    """The traced host path (``gdn_kcp.trace_host_path``): the FLA entry's
    forward+backward compiled by Inductor with it against eager, whether the
    output code still calls a gdn_kcp op, how many Triton kernels it launches,
    and its time beside the opaque ops' compiled graph and eager. The dry run
    traces the torch programs with aot_eager (Inductor's C++ takes minutes on
    a CPU)."""
    from torch._inductor.utils import run_and_get_code

    H_qk, HV, K, V = s.dims
    T = min(s.T, 8192)
    cu = torch.tensor(s.truncated(T), device=s.device)
    xs = inputs(T, H_qk, HV, K, V, s.dtype, s.device)
    do = torch.randn_like(xs[2])

    def step(q, k, v, g, b):
        return chunk_gated_delta_rule(q, k, v, g, b, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0]

    def run(fn):
        grads_of = [x.clone().requires_grad_() for x in xs]
        o = fn(*grads_of)
        return [o.detach(), *torch.autograd.grad((o * do).sum(), grads_of)]

    backend = "inductor" if s.cuda else "aot_eager"
    results.update(T=T, documents=len(cu) - 1, backend=backend)
    repeats = s.repeats(repeats=3, warmup=1)
    with use_programs("cpu", "torch") if s.dry else _Null():
        eager = run(step)
        fresh_compile_state()
        opaque = torch.compile(step, fullgraph=True, backend=backend)
        run(opaque)
        results["opaque_ms"] = timed(lambda: run(opaque), s.device, **repeats)
        results["eager_ms"] = timed(lambda: run(step), s.device, **repeats)
        traced = torch.compile(step, fullgraph=True, backend=backend)
        with trace_host_path():
            start = time.perf_counter()
            got, codes = run_and_get_code(run, traced)
            results["compile_s"] = round(time.perf_counter() - start, 1)
            results["traced_ms"] = timed(lambda: run(traced), s.device, **repeats)
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    results["relative_rms_vs_eager"] = {n: rel_rms(a, b) for n, a, b in zip(names, got, eager)}
    results["calls_gdn_kcp_op"] = any("torch.ops.gdn_kcp" in code for code in codes) if codes else None  # aot_eager: no code
    results["triton_launches_in_code"] = sum(code.count(".run(") for code in codes)
    results["pass"] = all(e < 1e-2 for e in results["relative_rms_vs_eager"].values()) and \
        results["calls_gdn_kcp_op"] is not True
    synchronize(s.device)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

"""Activation checkpointing without the double work (gdn_kcp.checkpointing):
gradients bitwise equal to the step without checkpoint, the programs each step
launches, the record of the last call and its fallbacks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from checkpoint_cases import BOUNDS, H_QK, HV, K, V, Model, assert_bitwise, one_rank, run_ranks
from spawn import spawn_ranks

from gdn_kcp import (OptionsKcp, build_kcp_context, checkpoint_policy, chunk_gated_delta_rule, gdn_checkpoint_bytes_kcp,
                     gdn_kcp, gdn_saved_layout_kcp, gdn_workspace_layout_kcp, record_workspace, trace_host_path,
                     WorkspaceKcp)
from gdn_kcp import checkpointing
from gdn_kcp.context.builders import context_from_split
from gdn_kcp.queries.layout import tapes_fit_before_backward
from gdn_kcp.checkpointing import VERIFIED_TORCH, last_checkpoint_record, torch_release
from gdn_kcp.host.programs import count_programs, use_programs

REUSE = (None, True, False)


def step(region: str, form: str, options: OptionsKcp, dtype=torch.float64, kcp: bool = False, **kwargs):
    """Gradients, program counts and the record of one step of a fresh model,
    through the FLA-style entry (``kcp``: ``gdn_kcp`` on one rank, which takes
    every option)."""
    model = Model(dtype, layers=2 if region == "two" else 1)
    if kcp:
        ctx = build_kcp_context(list(BOUNDS))

        def gdn(*x):
            return gdn_kcp(*x, ctx, options=replace(options, use_qk_l2norm=True))[0]
    else:
        gdn = one_rank(options)
    with count_programs() as counts:
        grads = model.step(region, form, gdn, **kwargs)
    return grads, Counter(counts), last_checkpoint_record()


def test_the_running_torch_is_verified():
    assert torch_release() in VERIFIED_TORCH, "run the checkpoint tests on this release, then add it to VERIFIED_TORCH"


@pytest.mark.parametrize("save_mode", ["light", "inverse", "full"])
@pytest.mark.parametrize("region", ["core", "later"])
def test_checkpointed_gradients_are_bitwise_the_step_without(region, save_mode):
    expected, plain, _ = step(region, "none", OptionsKcp(save_mode=save_mode))
    for reuse in REUSE:
        options = OptionsKcp(save_mode=save_mode, reuse_recompute_tapes=reuse)
        got, counts, record = step(region, "checkpoint", options)
        assert_bitwise(expected, got, f"{region}, reuse {reuse}")
        assert record.phase == "recompute" and record.executable and record.early_stop, record
        assert record.last_saver == record.triggered_by_node == (region == "core"), record
        keeps = save_mode != "full" and (reuse is True or (reuse is None and region == "core"))
        assert record.kept_tapes == keeps, record
        assert record.output_skipped == (region == "core"), record
        if save_mode != "light":
            continue
        # the light step without checkpoint: prep twice, the scores and the walk with the output once, the tape
        # walk once (the backward's replay)
        assert plain["prep"] == 2 and plain["scores"] == plain["walk_output"] == plain["tape_walk"] == 1, plain
        if region == "core":  # the recompute does the backward's replay; the output is not launched again
            assert counts == plain, (reuse, counts)
        elif keeps:  # the recompute launches the output path and the tape walk, the backward replays nothing
            assert counts == plain + Counter(scores=1, walk_output=1), counts
        else:  # the recompute runs the forward again, the backward replays
            assert counts == plain + Counter(prep=1, scores=1, walk_output=1), counts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitwise_in_low_precision(dtype):
    for region in ("core", "later"):
        expected, _, _ = step(region, "none", OptionsKcp(), dtype)
        for reuse in REUSE:
            got, _, record = step(region, "checkpoint", OptionsKcp(reuse_recompute_tapes=reuse), dtype)
            assert_bitwise(expected, got, f"{dtype}, {region}, reuse {reuse}")


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.extended), torch.bfloat16])
def test_bitwise_on_the_triton_programs(dtype):
    with use_programs("cpu", "triton"):
        expected, _, _ = step("core", "none", OptionsKcp(), dtype)
        for reuse in (None, False):
            got, counts, record = step("core", "checkpoint", OptionsKcp(reuse_recompute_tapes=reuse), dtype)
            assert_bitwise(expected, got, f"triton {dtype}, reuse {reuse}")
            assert record.kept_tapes == (reuse is None) and record.output_skipped, record


def test_two_calls_in_one_region_only_the_last_keeps():
    expected, plain, _ = step("two", "none", OptionsKcp())
    got, counts, record = step("two", "checkpoint", OptionsKcp())
    assert_bitwise(expected, got, "two calls")
    assert record.kept_tapes and record.output_skipped, record  # the last call of the recompute: the second
    got, counts_true, record = step("two", "checkpoint", OptionsKcp(reuse_recompute_tapes=True))
    assert_bitwise(expected, got, "two calls, reuse True")
    assert counts_true == counts, (counts_true, counts)  # the first call knows the second keeps: no wasted walk


def test_nested_checkpoints_and_retain_graph():
    expected, _, _ = step("core", "none", OptionsKcp())
    got, _, record = step("core", "nested", OptionsKcp())
    assert_bitwise(expected, got, "nested")
    assert record.phase == "recompute", record
    expected, _, _ = step("core", "none", OptionsKcp(), retain_graph=True)
    got, _, record = step("core", "checkpoint", OptionsKcp(), retain_graph=True)
    assert_bitwise(expected, got, "retain_graph")


def test_a_reentrant_checkpoint_falls_back_with_its_reason():
    expected, plain, _ = step("core", "none", OptionsKcp())
    got, counts, record = step("core", "reentrant", OptionsKcp())
    assert_bitwise(expected, got, "reentrant")
    assert record.phase == "none" and not record.kept_tapes and not record.output_skipped, record
    assert record.reasons == ["no non-reentrant checkpoint around the call"]
    assert counts == plain + Counter(prep=1, scores=1, walk_output=1), counts


def test_no_grad_falls_back_with_its_reason():
    model = Model(torch.float64)
    with torch.no_grad():
        torch.utils.checkpoint.checkpoint(model.core, model.x, model.layers[0], one_rank(OptionsKcp()),
                                          use_reentrant=False)
    record = last_checkpoint_record()
    assert not record.executable and not record.kept_tapes and not record.output_skipped, record


def test_output_always_launches_the_output():
    expected, plain, _ = step("core", "none", OptionsKcp())
    got, counts, record = step("core", "checkpoint", OptionsKcp(recompute_output="always"))
    assert_bitwise(expected, got, "recompute_output always")
    assert record.kept_tapes and not record.output_skipped, record
    assert counts == plain + Counter(scores=1, walk_output=1), counts
    assert "recompute_output='always': the output is launched" in record.reasons


def fallback_step(options: OptionsKcp, kcp: bool = False):
    """A checkpointed core that must take the ordinary path: bitwise, the
    forward run again, the record saying why."""
    expected, plain, _ = step("core", "none", options, kcp=kcp)
    got, counts, record = step("core", "checkpoint", options, kcp=kcp)
    assert_bitwise(expected, got, str(options))
    assert not record.kept_tapes and not record.output_skipped, record
    assert counts == plain + Counter(prep=1, scores=1, walk_output=1), counts
    return record


def test_graph_replay_runs_the_forward_again():
    record = fallback_step(OptionsKcp(graph="replay"), kcp=True)
    assert any("graph='replay'" in reason for reason in record.reasons), record


def test_an_unverified_torch_runs_the_forward_again(monkeypatch):
    monkeypatch.setattr(checkpointing, "VERIFIED_TORCH", ("0.1",))
    record = fallback_step(OptionsKcp())
    assert not record.verified and any("not a verified release" in reason for reason in record.reasons), record


def test_a_frame_that_cannot_be_read_runs_the_forward_again(monkeypatch):
    def unreadable(record):
        raise AttributeError("no frame")
    monkeypatch.setattr(checkpointing, "_checkpoint_state", unreadable)
    record = fallback_step(OptionsKcp())
    assert record.phase == "unknown" and "AttributeError: no frame" in record.reasons[-1], record


def test_eager_selective_checkpointing_runs_the_forward_from_its_cache():
    """Eager selective checkpointing serves the recompute from the ops the
    forward recorded: the probe takes the ordinary path (gdn_kcp::fwd again,
    saved by the policy), bitwise."""
    model = Model(torch.float64)
    gdn = one_rank(OptionsKcp())
    expected = model.step("core", "none", gdn)
    for policy in (checkpoint_policy(), lambda ctx, op, *args, **kwargs: CheckpointPolicy.PREFER_RECOMPUTE):
        context_fn = partial(create_selective_checkpoint_contexts, policy)
        for p in (model.x, *model.params):
            p.grad = None
        out = torch.utils.checkpoint.checkpoint(model.core, model.x, model.layers[0], gdn, use_reentrant=False,
                                                context_fn=context_fn)
        (out @ model.layers[0]["o"]).float().square().sum().backward()
        assert_bitwise(expected, [p.grad for p in (model.x, *model.params)], "eager selective")
        record = last_checkpoint_record()
        assert record.phase == "recompute" and not record.kept_tapes and not record.output_skipped, record
        assert any("selective checkpointing" in reason for reason in record.reasons), record


def test_a_workspace_serves_every_recompute_option():
    ctx = build_kcp_context(list(BOUNDS))
    workspace = WorkspaceKcp(ctx, H_QK, HV, K, V, dtype=torch.float64, options=OptionsKcp())
    for reuse in REUSE:
        options = OptionsKcp(reuse_recompute_tapes=reuse, recompute_output="always")
        Model(torch.float64).step("core", "checkpoint",
                                  lambda *x: gdn_kcp(*x, ctx, options=options, workspace=workspace)[0])


def test_options_name_a_bad_value():
    for bad in ("yes", 1, "always"):
        with pytest.raises(ValueError, match="reuse_recompute_tapes"):
            OptionsKcp(reuse_recompute_tapes=bad)
    with pytest.raises(ValueError, match="recompute_output"):
        OptionsKcp(recompute_output="never")
    for refused in ("auto", True):
        with pytest.raises(ValueError, match="reuse_recompute_tapes"):
            OptionsKcp(graph="replay", reuse_recompute_tapes=refused)
    assert OptionsKcp().reuse_tapes == "auto" and OptionsKcp(graph="replay").reuse_tapes is False
    assert OptionsKcp(graph="replay", reuse_recompute_tapes=False).reuse_tapes is False


@pytest.mark.parametrize("R", [2, 3])
def test_checkpointed_ranks_are_bitwise(R):
    options = [OptionsKcp(reuse_recompute_tapes=reuse) for reuse in REUSE]
    options += [OptionsKcp(boundary_mode="replay", save_for_backward=False),
                OptionsKcp(exchange="ring"), OptionsKcp(save_mode="inverse", boundary_mode="replay", segments=2)]
    spawn_ranks(R, run_ranks, options, ("core", "later"))


def test_checkpointed_ranks_where_the_backward_reuses_the_tapes_bytes():
    """K = V = 128 on 2 ranks: a backward that replays the boundary exchange or
    overlaps b2 binds pools in the bytes its h takes later, so the recompute
    keeps the tapes as tensors there (tapes_fit_before_backward; before that
    rule these gradients erred by up to 29)."""
    norm = dict(use_qk_l2norm=True)  # K = 128 unnormalised keys make the recurrence overflow
    options = [OptionsKcp(boundary_mode="replay", save_for_backward=False, **norm),
               OptionsKcp(boundary_mode="replay", save_for_backward=False, exchange="ring", **norm),
               OptionsKcp(schedule="overlap", **norm),
               OptionsKcp(reuse_recompute_tapes=True, boundary_mode="replay", save_for_backward=False, **norm)]
    spawn_ranks(2, run_ranks, options, ("core",), (2, 4, 128, 128))


def test_the_tapes_fit_before_the_backward_only_where_no_earlier_pool_shares_their_bytes():
    """The layout rule behind the workspace form, over the options the ranks test."""
    forms = {"saved": OptionsKcp(), "replay": OptionsKcp(boundary_mode="replay", save_for_backward=False),
             "overlap": OptionsKcp(schedule="overlap")}
    fits = {name: [tapes_fit_before_backward(gdn_workspace_layout_kcp(
        context_from_split(list(BOUNDS), [(0, 100), (100, 230)], rank), 2, 4, 128, 128, dtype=torch.float64,
        options=options).bwd) for rank in (0, 1)] for name, options in forms.items()}
    assert fits == {"saved": [True, True], "replay": [False, False], "overlap": [False, False]}
    one_rank_layout = gdn_workspace_layout_kcp(build_kcp_context(list(BOUNDS)), 2, 4, 128, 128,
                                               dtype=torch.float64, options=OptionsKcp()).bwd
    assert tapes_fit_before_backward(one_rank_layout)


@pytest.mark.parametrize("save_mode", ["light", "inverse", "full"])
def test_the_queries_state_the_kept_tapes_and_their_backward(save_mode):
    """Tolerance 0 against the real run. A region the call closes keeps the
    tapes in the pools of the call's own backward workspace: that backward's
    recorded peak is the ordinary figure. Behind a later saver
    (``reuse_recompute_tapes=True``) they are tensors of their own:
    ``gdn_checkpoint_bytes_kcp``'s ``kept_tapes`` are their bytes beyond the
    saved set (the record counts the tensors handed over) and
    ``backward_transient`` the peak of the backward that binds them."""
    ctx = build_kcp_context(list(BOUNDS))
    options = OptionsKcp(save_mode=save_mode, use_qk_l2norm=True, reuse_recompute_tapes=True)
    query = gdn_checkpoint_bytes_kcp(ctx, H_QK, HV, K, V, dtype=torch.bfloat16, options=options)
    own = gdn_workspace_layout_kcp(ctx, H_QK, HV, K, V, dtype=torch.bfloat16, options=options).bwd
    saved = gdn_saved_layout_kcp(ctx, H_QK, HV, K, V, dtype=torch.bfloat16, options=options)
    full = gdn_saved_layout_kcp(ctx, H_QK, HV, K, V, dtype=torch.bfloat16,
                                options=OptionsKcp(save_mode="full", use_qk_l2norm=True))
    beyond_saved = sum(spec.nbytes for name, spec in full.items() if name not in saved)
    assert query.kept_tapes == beyond_saved and (beyond_saved > 0) == (save_mode != "full")
    for region in ("core", "later"):
        with record_workspace() as workspaces:
            Model(torch.bfloat16).step(region, "checkpoint", lambda *x: gdn_kcp(*x, ctx, options=options)[0])
        record = last_checkpoint_record()
        assert record.kept_tapes == (save_mode != "full"), record
        if save_mode == "full" or region == "core":
            assert record.kept_bytes == 0 and record.tapes_in_workspace == (save_mode != "full"), record
            assert workspaces.peak("bwd") == own.bytes
        else:
            assert record.kept_bytes == query.kept_tapes and not record.tapes_in_workspace, record
            assert workspaces.peak("bwd") == query.backward_transient


def test_memtracker_sees_the_kept_tapes_only_where_the_query_says():
    """MemTracker on the CPU, a region closed by a wide MLP (a later saver,
    whose backward holds the step's peak): ``"auto"`` replays there and peaks
    as ``False`` does; ``True`` holds the kept tapes through the MLP's
    backward, exactly their queried bytes more. In a region the GDN call
    closes, the tapes go into the pools of the call's backward workspace,
    which the recompute allocates just before that backward: ``"auto"`` and
    ``True`` peak as the replay does."""
    ctx = build_kcp_context(list(BOUNDS))
    peaks, records = {}, {}
    for region in ("mlp", "core"):
        for reuse in REUSE:
            model = Model(torch.float64, mlp=2048 if region == "mlp" else 0)
            tracker = MemTracker()
            options = OptionsKcp(use_qk_l2norm=True, reuse_recompute_tapes=reuse)
            with tracker:
                model.step(region, "checkpoint", lambda *x: gdn_kcp(*x, ctx, options=options)[0])
            peaks[region, reuse] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
            records[region, reuse] = last_checkpoint_record()
    query = gdn_checkpoint_bytes_kcp(ctx, H_QK, HV, K, V, dtype=torch.float64, options=OptionsKcp(use_qk_l2norm=True))
    assert peaks["mlp", None] == peaks["mlp", False]
    assert peaks["mlp", True] == peaks["mlp", False] + query.kept_tapes == peaks["mlp", False] + records[
        "mlp", True].kept_bytes
    assert peaks["core", None] == peaks["core", True] == peaks["core", False]


def test_a_checkpointed_region_compiles_with_fullgraph():
    """torch.compile(fullgraph=True) of a checkpointed region on the opaque
    ops: bitwise the gradients of the same region compiled without the
    checkpoint (aot_eager decomposes the projections' pointwise ops, so eager
    differs from both by fp64 rounding), and the probe stays out of the
    traced code (the record is the last eager call's)."""
    torch._dynamo.reset()
    model = Model(torch.float64)
    gdn = one_rank(OptionsKcp())

    def plain(x, layer):
        return model.core(x, layer, gdn)

    def region(x, layer):
        return torch.utils.checkpoint.checkpoint(model.core, x, layer, gdn, use_reentrant=False)

    model.step("core", "checkpoint", gdn)
    before = last_checkpoint_record()
    grads = []
    for fn in (plain, region):
        for p in (model.x, *model.params):
            p.grad = None
        out = torch.compile(fn, fullgraph=True, backend="aot_eager")(model.x, model.layers[0])
        (out @ model.layers[0]["o"]).float().square().sum().backward()
        grads.append([p.grad for p in (model.x, *model.params)])
    assert_bitwise(grads[0], grads[1], "compiled checkpoint")
    assert last_checkpoint_record() is before


def aot_graphs(**more):
    """An aot_eager backend that keeps its forward and backward graphs:
    ``(backend, graphs)``; ``more``: aot_autograd's other keywords."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = {}

    def keep(name):
        def compiler(gm, inputs):
            graphs[name] = gm
            return gm.forward
        return compiler
    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"), **more), graphs


def gdn_ops(graph) -> Counter:
    """The package's ops in a functionalised graph, by name."""
    return Counter(str(node.args[0]).split(".")[1] for node in graph.graph.nodes
                   if "auto_functionalized" in str(node.target) and "gdn_kcp" in str(node.args[0]))


def test_the_selective_checkpoint_policy_saves_the_forward_op():
    """Compiled (fullgraph, opaque ops): a plain checkpoint recomputes
    ``gdn_kcp::fwd`` in the backward; with ``checkpoint_policy()`` it is saved,
    as without checkpoint. Gradients bitwise the region's without checkpoint."""
    model = Model(torch.float32)
    gdn = one_rank(OptionsKcp())
    context_fn = partial(create_selective_checkpoint_contexts, checkpoint_policy())
    found = {}
    for form in ("none", "checkpoint", "selective"):
        torch._dynamo.reset()

        def region(x, layer):
            if form == "none":
                return model.core(x, layer, gdn)
            more = dict(context_fn=context_fn) if form == "selective" else {}
            return torch.utils.checkpoint.checkpoint(model.core, x, layer, gdn, use_reentrant=False, **more)

        backend, graphs = aot_graphs()
        for p in (model.x, *model.params):
            p.grad = None
        out = torch.compile(region, fullgraph=True, backend=backend)(model.x, model.layers[0])
        (out @ model.layers[0]["o"]).square().sum().backward()
        found[form] = [p.grad.clone() for p in (model.x, *model.params)], gdn_ops(graphs["fw"]), gdn_ops(graphs["bw"])
    for form in ("checkpoint", "selective"):
        assert_bitwise(found["none"][0], found[form][0], form)
    assert found["checkpoint"][2] == Counter(fwd=1, bwd=1)
    assert found["selective"][1:] == found["none"][1:] == (Counter(fwd=1), Counter(bwd=1))


def inductor_partition_graphs():
    """AOT autograd with Inductor's decompositions and partitioner, keeping
    the forward and backward graphs (what Inductor would generate code for,
    without its C++ compile): ``(backend, graphs)``."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    return aot_graphs(decompositions=select_decomp_table(),
                      partition_fn=partial(min_cut_rematerialization_partition, compiler="inductor"))


def program_matmuls(graph) -> Counter:
    """A traced graph's matmuls by the program whose call made them (the
    host path's ``call.programs.<name>(`` line in each node's stack trace)."""
    found = Counter()
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
            names = re.findall(r"programs\.(\w+)\(", node.meta.get("stack_trace") or "")
            found[names[-1] if names else None] += 1
    return found


def boundary_calls(graph, name: str = "forward_boundary") -> int:
    op = getattr(torch.ops.gdn_kcp, name).default
    return sum(node.op == "call_function" and node.target is op for node in graph.graph.nodes)


def test_a_traced_checkpoint_saves_o_and_recomputes_no_output_program():
    """Traced host path, o read after the checkpointed region in the same
    graph (an output projection), Inductor's partitioner: with
    ``checkpoint_policy()`` the backward recomputes the projections and
    replays prep and the tape walk as the light backward does, but runs
    neither scores nor the walk with the output (o is saved through
    ``gdn_kcp::forward_boundary``). Without the policy the same backward held
    all 15 of the walk's matmuls and a second prep (1272 nodes against 974,
    measured under Inductor). The forward boundary is in each forward graph,
    the replay boundary in each backward; gradients bitwise the
    uncheckpointed compiled step's."""
    model = Model(torch.float64)
    gdn = one_rank(OptionsKcp())
    context_fn = partial(create_selective_checkpoint_contexts, checkpoint_policy())
    found = {}
    for form in ("none", "selective"):
        torch._dynamo.reset()

        def step(x, layer):
            o = model.core(x, layer, gdn) if form == "none" else torch.utils.checkpoint.checkpoint(
                model.core, x, layer, gdn, use_reentrant=False, context_fn=context_fn)
            return o @ layer["o"]

        backend, graphs = inductor_partition_graphs()
        for p in (model.x, *model.params):
            p.grad = None
        with trace_host_path():
            torch.compile(step, fullgraph=True, backend=backend)(model.x, model.layers[0]).square().sum().backward()
        found[form] = [p.grad.clone() for p in (model.x, *model.params)], graphs["fw"], graphs["bw"]
    assert_bitwise(found["none"][0], found["selective"][0], "traced selective checkpoint")
    _, fw, bw = found["selective"]
    fw_mm, bw_mm = program_matmuls(fw), program_matmuls(bw)
    assert fw_mm["walk_output"] > 0 and bw_mm["walk_output"] == 0, bw_mm
    assert bw_mm["prep"] == fw_mm["prep"], bw_mm  # the light backward's replay of prep, no second one to rebuild o
    assert (boundary_calls(fw), boundary_calls(bw), boundary_calls(found["none"][1])) == (1, 0, 1)
    assert (boundary_calls(bw, "replay_boundary"), boundary_calls(found["none"][2], "replay_boundary")) == (1, 1)


def test_inductor_lowers_the_boundaries_to_their_inputs():
    """Inductor's output code calls neither ``gdn_kcp::forward_boundary`` nor
    ``replay_boundary`` (no copy; a kernel's name may still list them among
    the ops it fused)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x = torch.randn(4, 8, dtype=torch.float64)

    def fn(x):
        (kept,) = torch.ops.gdn_kcp.forward_boundary([x.sin()])
        (read,) = torch.ops.gdn_kcp.replay_boundary([kept], [x])
        return read * 2

    with trace_host_path():  # registers the lowerings
        got, codes = run_and_get_code(torch.compile(fn), x)
    assert codes and not any("torch.ops.gdn_kcp" in code for code in codes), codes
    assert torch.allclose(got, x.sin() * 2, rtol=0, atol=1e-15)


def test_the_policy_names_a_bad_op():
    for bad in ("fwd", ("forward",), ("bwd",), ("walk_output",)):
        with pytest.raises(ValueError, match="save must be a tuple of gdn_kcp op names"):
            checkpoint_policy(bad)


@pytest.mark.parametrize("save_mode", ["light", "inverse"])
def test_states_through_a_checkpointed_core(save_mode):
    """Initial states (with their gradient) and final states (in the loss) out
    of a region the GDN call closes: bitwise the step without checkpoint under
    each ``reuse_recompute_tapes``, the tapes kept where ``"auto"`` keeps."""
    model = Model(torch.float64)
    layer, cu = model.layers[0], torch.tensor(BOUNDS)
    h0 = torch.randn(len(BOUNDS) - 1, HV, K, V, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(1)).requires_grad_()

    def core(x, options):
        T = x.shape[1]
        q, k = (x @ layer["q"]).view(1, T, H_QK, K), (x @ layer["k"]).view(1, T, H_QK, K)
        return chunk_gated_delta_rule(
            q, k, (x @ layer["v"]).view(1, T, HV, V), torch.nn.functional.logsigmoid(x @ layer["a"]),
            torch.sigmoid(x @ layer["b"]), initial_state=h0, output_final_state=True, cu_seqlens=cu,
            use_qk_l2norm_in_kernel=True, save_mode=save_mode, reuse_recompute_tapes=options.reuse_recompute_tapes)

    def step(checkpointed: bool, options: OptionsKcp) -> list[torch.Tensor]:
        leaves = (model.x, h0, *model.params)
        for p in leaves:
            p.grad = None
        o, ht = (torch.utils.checkpoint.checkpoint(core, model.x, options, use_reentrant=False) if checkpointed
                 else core(model.x, options))
        ((o.flatten(2) @ layer["o"]).square().sum() + ht.square().sum()).backward()
        return [p.grad.clone() for p in leaves]

    for reuse in REUSE:
        options = OptionsKcp(reuse_recompute_tapes=reuse)
        assert_bitwise(step(False, options), step(True, options), f"states, reuse {reuse}")
        record = last_checkpoint_record()
        assert record.kept_tapes == (reuse is not False) and record.output_skipped, record


@pytest.mark.parametrize("keep, skip, into", [(True, True, False), (True, True, True), (False, True, False),
                                              (True, False, False)])
def test_the_recompute_op_passes_opcheck(keep, skip, into):
    """``gdn_kcp::recompute`` (schema, fake kernel, autograd registration, AOT
    dispatch) in each form: tapes as tensors, tapes into a backward's
    workspace, output skipped alone, output launched."""
    ctx = build_kcp_context(list(BOUNDS))
    gen = torch.Generator().manual_seed(0)
    T = BOUNDS[-1]
    q, k = (torch.randn(T, H_QK, K, generator=gen) for _ in range(2))
    v = torch.randn(T, HV, V, generator=gen)
    g, beta = -torch.rand(T, HV, generator=gen), torch.rand(T, HV, generator=gen)
    options = OptionsKcp(use_qk_l2norm=True).op_arg
    workspace = None
    if into:
        nbytes = gdn_workspace_layout_kcp(ctx, H_QK, HV, K, V, options=OptionsKcp(use_qk_l2norm=True)).bwd.bytes
        workspace = torch.empty(nbytes, dtype=torch.uint8)
    index = ctx.index_for(q.device)
    torch.library.opcheck(torch.ops.gdn_kcp.recompute.default, (
        q, k, v, g, beta, None, index.chunk_table, index.frag_table, list(ctx.meta), ctx.group_name, options, 0.25,
        0, None, False, 1.0, keep, skip, workspace))


FIRST_STEP = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from checkpoint_cases import Model, one_rank
from gdn_kcp import OptionsKcp
steps = [Model(torch.float64).step("core", "none", one_rank(OptionsKcp())) for _ in range(2)]
print(all(torch.equal(a, b) for a, b in zip(*steps)))
"""


def test_the_first_step_of_a_process_is_bitwise_the_second():
    """In a fresh process the first projections+GDN step equals the second,
    bit for bit: CPU ``exp`` (MKL's vector math) could return other bits on
    its first multi-threaded call (one process in about 12), so the torch
    programs make one serial call at import. A fresh process each time; one
    run catches a regression only sometimes, the suite's many processes more."""
    env = dict(os.environ, OMP_NUM_THREADS="2")  # the effect needs threads; `make test` gives each worker one
    done = subprocess.run([sys.executable, "-c", FIRST_STEP, str(Path(__file__).parent)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


def test_the_boundary_ops_pass_opcheck():
    """``gdn_kcp::forward_boundary`` and ``replay_boundary``: schema, fake
    kernel, autograd (gradients passed through) and their Dynamo and AOT
    tracing (torch.library.opcheck)."""
    o = torch.randn(7, 2, 4, dtype=torch.float64, requires_grad=True)
    rows = torch.arange(6, dtype=torch.int32).view(2, 3)
    after = torch.randn(3, dtype=torch.float64)
    torch.library.opcheck(torch.ops.gdn_kcp.forward_boundary.default, ([o, o.new_empty(0), rows],))
    torch.library.opcheck(torch.ops.gdn_kcp.replay_boundary.default, ([o, rows], [after]))
    for outputs in (torch.ops.gdn_kcp.forward_boundary([o]), torch.ops.gdn_kcp.replay_boundary([o], [after])):
        (grad,) = torch.autograd.grad(outputs[0], o, torch.ones_like(o))
        assert torch.equal(grad, torch.ones_like(o))

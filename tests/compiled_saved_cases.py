"""What a compiled forward keeps for its backward (tests/test_compiled_saved.py).

The graphs come from Inductor's own pipeline up to its code generation
(:func:`inductor_graphs`: decompositions, joint-graph passes, the min-cut
partitioner, post-grad passes), run as FX graphs, so no C++ is compiled. A
forward graph's saved tensors are its outputs that the backward graph takes
besides the gradients; :func:`saved_split` sorts them by where they come from.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from dataclasses import dataclass
from functools import partial

import torch
from functorch.compile import make_boxed_func
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from checkpoint_cases import BOUNDS, Model
from gdn_kcp import (OptionsKcp, build_kcp_context, checkpoint_policy, chunk_gated_delta_rule, gdn_kcp,
                     gdn_saved_bytes_kcp, trace_host_path)
from gdn_kcp.host.programs import count_programs

MLP = 32
"""The width of the MLP after the call (the model's own activations around GDN)."""


def inductor_graphs():
    """``(backend, graphs)``: Inductor's compile up to code generation; keeps
    the partitioned forward and backward graphs (``graphs["fw"]``, ``["bw"]``)
    and runs them as they are."""
    from torch._inductor.compile_fx import compile_fx

    graphs = {}

    def keep(gm, example_inputs, **kwargs):
        graphs["bw" if kwargs.get("is_backward") else "fw"] = gm
        return make_boxed_func(gm.forward)

    return partial(compile_fx, inner_compile=keep), graphs


VIEWS = {operator.getitem, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
         torch.ops.aten.permute.default, torch.ops.aten.expand.default, torch.ops.aten.slice.Tensor,
         torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim,
         torch.ops.aten.alias.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.t.default}


def origin(node: torch.fx.Node) -> tuple[str, int | None]:
    """The op a saved tensor comes from through views and ``getitem``: its
    ``gdn_kcp`` name and output index (``auto_functionalized`` forms
    unwrapped), or ``("", None)``."""
    index = None
    while node.op == "call_function" and node.target in VIEWS:
        if node.target is operator.getitem and index is None:
            index = node.args[1]
        node = node.args[0]
    if node.op != "call_function":
        return "", None
    target = node.target
    if "auto_functionalized" in str(target):
        target = node.args[0]
    name = str(target)
    return (name.split(".")[1], index) if name.startswith("gdn_kcp.") else ("", None)


@dataclass
class Saved:
    """A compiled forward's saved tensors by source (bytes of distinct
    storages that are not the graph's inputs' storages)."""

    gdn: int
    """The saved layout: what ``gdn_kcp::fwd`` (opaque) or ``gdn_kcp::forward_boundary`` (traced) returns after o and the final states."""
    outputs: int
    """o (and the final states) kept for the model's backward: those ops' first two outputs."""
    other: Counter
    """Everything else, by ``(shape, dtype)``: the model's own activations, GDN's inputs and index tables."""

    @property
    def total(self) -> int:
        return self.gdn + self.outputs + sum(size for (_, _, size), n in self.other.items() for _ in range(n))


def saved_split(fw: torch.fx.GraphModule, bw: torch.fx.GraphModule) -> Saved:
    inputs = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in fw.graph.nodes
              if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    taken = {n.name for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")}
    seen, found = set(inputs), Saved(0, 0, Counter())
    for node in fw.graph.output_node().args[0]:
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if node is None or node.name not in taken or not isinstance(value, torch.Tensor):
            continue
        storage = StorageWeakRef(value.untyped_storage())
        if storage in seen or value.untyped_storage().nbytes() == 0:  # an input's, one seen, or no bytes
            continue
        seen.add(storage)
        nbytes = value.untyped_storage().nbytes()
        name, index = origin(node)
        if name in ("fwd", "forward_boundary"):
            if index >= 2:
                found.gdn += nbytes
            else:
                found.outputs += nbytes
        else:
            found.other[(tuple(value.shape), value.dtype, nbytes)] += 1
    return found


def graph_programs(graph: torch.fx.GraphModule) -> set[str]:
    """The host path's programs whose decomposition is in ``graph`` (the
    ``call.programs.<name>(`` line of each node's stack trace)."""
    found = set()
    for node in graph.graph.nodes:
        names = re.findall(r"programs\.(\w+)\(", node.meta.get("stack_trace") or "")
        if names:
            found.add(names[-1])
    return found


class Step:
    """A model around one GDN call: projections into q, k, v, g, beta (the
    region), then an output projection and an MLP. ``form``: ``"none"`` or
    ``"policy"`` (the region under ``torch.utils.checkpoint`` with
    :func:`gdn_kcp.checkpoint_policy`)."""

    def __init__(self, gdn, form: str, x: torch.Tensor | None = None) -> None:
        self.model = Model(torch.float64, mlp=MLP)
        self.x = self.model.x if x is None else x
        self.gdn, self.form = gdn, form
        self.context_fn = partial(create_selective_checkpoint_contexts, checkpoint_policy())

    def __call__(self, x, layer):
        core = partial(self.model.core, layer=layer, gdn=self.gdn)
        o = core(x) if self.form == "none" else checkpoint(core, x, use_reentrant=False, context_fn=self.context_fn)
        return o @ layer["o"] + torch.relu(o @ layer["up"]) @ layer["down"]

    def run(self, fn) -> list[torch.Tensor]:
        """One step of ``fn``: x's and the weights' gradients."""
        leaves = (self.x, *self.model.params)
        for p in leaves:
            p.grad = None
        fn(self.x, self.model.layers[0]).square().sum().backward()
        return [p.grad.clone() for p in leaves]

    def compiled(self, traced: bool) -> tuple[list[torch.Tensor], dict]:
        """Gradients and graphs of the step compiled through :func:`inductor_graphs`
        (``traced``: inside :func:`trace_host_path`)."""
        torch._dynamo.reset()
        backend, graphs = inductor_graphs()
        with trace_host_path(traced):
            grads = self.run(torch.compile(self, fullgraph=True, backend=backend))
        return grads, graphs

    def eager_programs(self) -> tuple[set[str], set[str]]:
        """The programs an eager step launches in its forward and its backward."""
        leaves = (self.x, *self.model.params)
        for p in leaves:
            p.grad = None
        with count_programs() as forward:
            y = self(self.x, self.model.layers[0])
        with count_programs() as backward:
            y.square().sum().backward()
        return set(forward), set(backward)


def one_rank(save_mode: str, **more):
    cu = torch.tensor(BOUNDS)

    def gdn(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                      save_mode=save_mode, **more)[0]
    return gdn


def saved_query(ctx, options: OptionsKcp) -> int:
    """``gdn_saved_bytes_kcp`` at the model's heads, fp64."""
    H_qk, HV, K, V = Model(torch.float64).heads
    return gdn_saved_bytes_kcp(ctx, H_qk, HV, K, V, dtype=torch.float64, options=options)


def index_tables(ctx) -> Counter:
    """The context's two int32 index tables as :class:`Saved` counts them
    (what the saved query leaves out: docs/bytes.md)."""
    return Counter((tuple(t.shape), t.dtype, t.nbytes) for t in (ctx.index.chunk_table, ctx.index.frag_table))


def check_step(step: Step, query: int, where: str, tables: Counter) -> dict:
    """The step compiled with the opaque ops and traced: each keeps exactly
    the saved layout (``query``) of GDN, o (kept for the output projection)
    and the same other tensors (the MLP's own, its bool ReLU mask among
    them), whose int32 / int64 ones are ``tables`` (the index
    tables a graph builds from ``cu_seqlens``; none when the context comes
    from outside the graph); the traced backward runs the eager backward's
    programs and no other, its forward the eager forward's; the gradients
    agree within 1e-12 (fp64). Returns the figures and the programs of the
    traced backward graph."""
    eager = step.run(step)
    eager_forward, eager_backward = step.eager_programs()
    found, programs = {}, {}
    for traced in (False, True):
        grads, graphs = step.compiled(traced)
        for i, (a, b) in enumerate(zip(grads, eager, strict=True)):
            assert torch.allclose(a, b, rtol=0, atol=1e-12), (where, traced, i, float((a - b).abs().max()))
        found[traced] = saved = saved_split(graphs["fw"], graphs["bw"])
        assert saved.gdn == query, (where, traced, saved, query)
        integers = Counter({key: n for key, n in saved.other.items() if key[1] in (torch.int32, torch.int64)})
        assert integers == tables, (where, traced, integers, tables)
        if traced:
            programs = {name: graph_programs(graphs[name]) for name in ("fw", "bw")}
            assert programs["fw"] == eager_forward, (where, programs["fw"])
            assert programs["bw"] == eager_backward, (where, programs["bw"])
    assert found[True].outputs == found[False].outputs, (where, found)
    assert found[True].other == found[False].other, (where, found)
    return {"query": query, "opaque": found[False].total, "traced": found[True].total,
            "gdn_opaque": found[False].gdn, "gdn_traced": found[True].gdn, "traced_backward": programs["bw"]}


def run_ranks(rank: int, R: int, option_sets: list[dict], form: str) -> None:
    """On each rank of R: :func:`check_step` for ``gdn_kcp`` on the rank's
    slice, for each set of ``OptionsKcp`` keywords (with the in-kernel norm)."""
    ctx = build_kcp_context(torch.tensor(BOUNDS))
    start, end = ctx.rank_ranges[rank]
    x = Model(torch.float64, mlp=MLP).x.detach()[:, start:end].clone().requires_grad_()
    for keywords in option_sets:
        options = OptionsKcp(use_qk_l2norm=True, **keywords)

        def gdn(q, k, v, g, beta):
            return gdn_kcp(q, k, v, g, beta, ctx, options=options)[0]
        check_step(Step(gdn, form, x=x), saved_query(ctx, options), f"rank {rank} of {R}, {keywords}, {form}",
                   Counter())  # the context's tables are the graph's inputs

"""Capture once (docs/design.md, "Capture once"): a compiled training loop over a new packing
every step. Shared by the single-rank tests and the 2-rank gloo workers."""

from __future__ import annotations

import random

import torch
from gdn_inputs import max_abs
from gdn_layer import KcpLayer, loss_and_grads
from torch import nn
from torch._dynamo.utils import counters

from gdn_kcp import OptionsKcp, WorkspaceKcp, build_kcp_context, chunk_gated_delta_rule, chunk_kda

T_GLOBAL = 200
MAX_DOCS = 6
STEPS = 8
FP64_TOLERANCE = 1e-10  # compiled and eager differ by Inductor's fusions of the projections only


def random_packing(rng: random.Random, T: int = T_GLOBAL, max_docs: int = MAX_DOCS) -> list[int]:
    """1..max_docs documents, zero-length ones among them now and then."""
    n = rng.randint(1, max_docs)
    cuts = [rng.randint(0, T) if rng.random() < 0.8 else rng.choice([0, T]) for _ in range(n - 1)]
    return [0, *sorted(cuts), T]


_RNG = random.Random(0)
FLAT_PACKINGS = [random_packing(_RNG) for _ in range(STEPS)]
LENGTHS_SEEN = len({len(bounds) for bounds in FLAT_PACKINGS})


class FlatLayer(nn.Module):
    """Projections and chunk_gated_delta_rule over a packed batch (the FLA entry;
    ``kda``: chunk_kda, a gate per key channel)."""

    def __init__(self, d_model=32, H=2, K=16, V=16, kda=False):
        super().__init__()
        self.H, self.K, self.V, self.kda = H, K, V, kda
        self.qkv = nn.Linear(d_model, H * (2 * K + V))
        self.gates = nn.Linear(d_model, H * (K if kda else 1) + H)
        self.out = nn.Linear(H * V, d_model)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        T, H, K, V = x.shape[1], self.H, self.K, self.V
        q, k, v = self.qkv(x).split([H * K, H * K, H * V], dim=-1)
        gate, beta = self.gates(x).split([self.gates.out_features - H, H], dim=-1)
        gate = nn.functional.logsigmoid(gate + 3.0)
        o, _ = (chunk_kda if self.kda else chunk_gated_delta_rule)(
            q.view(1, T, H, K), k.view(1, T, H, K), v.view(1, T, H, V), gate.view(1, T, H, K) if self.kda else gate,
            beta.sigmoid(), cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
        return self.out(o.flatten(2))


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def check_steps(run_step, packings) -> None:
    """``run_step(bounds, compiled)`` returns ``(y, grads)``; compiled equals eager
    every step, and no graph is added after the first step (a recompile raises)."""
    torch._dynamo.reset()
    counters.clear()
    try:
        for step, bounds in enumerate(packings):
            y_eager, g_eager = run_step(bounds, False)
            y, grads = run_step(bounds, True)
            assert not counters["graph_break"], dict(counters["graph_break"])
            if step == 0:
                first = graphs()
                assert first >= 1
                torch.compiler.set_stance("fail_on_recompile")
            assert graphs() == first, (step, bounds, graphs())
            assert max_abs(y, y_eager) < FP64_TOLERANCE, (step, bounds)
            for a, b in zip(grads, g_eager):
                assert max_abs(a, b) < FP64_TOLERANCE, (step, bounds, max_abs(a, b))
    finally:
        torch.compiler.set_stance("default")


def flat_loop(cu_length: int | None = MAX_DOCS + 1, kda: bool = False) -> int:
    """The FLA entry, compiled once: ``cu_seqlens`` of ``cu_length`` entries
    (trailing repeats of T), or of each packing's own length (None). Returns
    the graph count."""
    torch.manual_seed(0)
    layer = FlatLayer(kda=kda).double()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(1, T_GLOBAL, 32, dtype=torch.float64)

    def run_step(bounds, use_compiled):
        padded = bounds + [bounds[-1]] * ((cu_length or len(bounds)) - len(bounds))
        cu = torch.tensor(padded)
        return loss_and_grads(lambda inp: (compiled if use_compiled else layer)(inp, cu), layer, x)

    if cu_length is None:
        torch._dynamo.reset()
        counters.clear()
        for bounds in FLAT_PACKINGS:
            y, grads = run_step(bounds, True)
            y_eager, g_eager = run_step(bounds, False)
            assert max_abs(y, y_eager) < FP64_TOLERANCE and all(
                max_abs(a, b) < FP64_TOLERANCE for a, b in zip(grads, g_eager)), bounds
        return graphs()
    check_steps(run_step, FLAT_PACKINGS)
    return graphs()


def kcp_loop(rank: int = 0, R: int = 1, kda: bool = False) -> None:
    """gdn_kcp (``kda``: kda_kcp) compiled once over capped contexts built per
    step, with a held workspace made once; on every rank of the group."""
    rng = random.Random(1)
    options = OptionsKcp(use_qk_l2norm=True, gate="channel" if kda else "head")
    packings = [random_packing(rng) for _ in range(STEPS)]
    first_ctx = build_kcp_context(packings[0], max_docs=MAX_DOCS)
    workspace = WorkspaceKcp(first_ctx, 2, 4, 16, 16, dtype=torch.float64, options=options)
    torch.manual_seed(0)
    layer = KcpLayer(first_ctx, options=options, workspace=workspace, kda=kda).double()
    compiled = torch.compile(layer, fullgraph=True)
    x_all = torch.randn(1, T_GLOBAL, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def run_step(bounds, use_compiled):
        ctx = build_kcp_context(bounds, max_docs=MAX_DOCS)
        assert ctx.layout_key == first_ctx.layout_key
        start, end = ctx.rank_ranges[rank]
        fn = compiled if use_compiled else layer
        return loss_and_grads(lambda inp: fn(inp, ctx), layer, x_all[:, start:end].contiguous())

    check_steps(run_step, packings)

"""The GatedDeltaNet and KimiDeltaAttention layers under KCP on real gloo
groups: every rank's rows and the parameter gradients summed over the ranks
equal the one-rank layer on the whole stream (fp64)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gdn_kcp import (build_kcp_context, gdn_comm_bytes_kcp, gdn_saved_layout_kcp, kda_comm_bytes_kcp,
                     kda_saved_layout_kcp)
from gdn_kcp.exchange import record_comm_bytes
from gdn_kcp.layers import GatedDeltaNet, KimiDeltaAttention

# (bounds, ranges) per R: documents crossing one and several ranks, a rank of
# one token (the halo reaches two ranks back), an empty rank, zero-length documents
LAYER_CASES = {
    1: [((0, 5, 5, 90), None)],
    2: [((0, 30, 130, 131, 200), ((0, 70), (70, 200))), ((0, 70, 200), ((0, 70), (70, 200)))],
    3: [((0, 20, 160), ((0, 100), (100, 101), (101, 160)))],
    4: [((0, 10, 10, 150, 151, 180), ((0, 60), (60, 60), (60, 62), (62, 180)))],
}


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0  # an empty rank holds no row


LAYERS = {
    # kind: (layer, its comm-bytes and saved-layout queries)
    "gdn": (GatedDeltaNet, gdn_comm_bytes_kcp, gdn_saved_layout_kcp),
    "kda": (KimiDeltaAttention, kda_comm_bytes_kcp, kda_saved_layout_kcp),
}


def make_layer(kind: str = "gdn"):
    torch.manual_seed(0)
    layer = LAYERS[kind][0](hidden_size=32, head_dim=8, num_heads=2, num_v_heads=4, conv_bias=True).double()
    with torch.no_grad():  # a decay that does not vanish in a few tokens
        layer.A_log.copy_(torch.linspace(-3, -1, layer.num_v_heads))
    return layer


def conv_node(o: torch.Tensor):
    """The autograd node of the layer's short convolution under ``o``."""
    seen, todo = set(), [o.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "gdn_kcp_short_conv" in node.name():
            return node
        todo.extend(next_node for next_node, _ in node.next_functions)
    raise AssertionError("no short convolution node under o")


def conv_kept_bytes(o: torch.Tensor, layer, ctx) -> int:
    """Bytes the convolution keeps besides the parameters and the context's index
    tables, less its own [T_r, D] input (which it keeps on one rank too): the
    halo that OptionsKcp(with_conv=True) counts."""
    held = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), ctx.index.frag_table, ctx.index.chunk_table)}
    kept = [t for t in conv_node(o).saved_tensors if t is not None and t.untyped_storage().data_ptr() not in held]
    D = 2 * layer.key_dim + layer.value_dim
    return sum(t.numel() * t.element_size() for t in kept) - o.shape[1] * D * o.element_size()


def check_layer_on_rank(rank: int, R: int, kind: str = "gdn") -> None:
    _, comm_bytes, saved_layout = LAYERS[kind]
    for bounds, ranges in LAYER_CASES[R]:
        for max_docs in (None, len(bounds) + 1):
            layer = make_layer(kind)
            T = bounds[-1]
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(1, T, 32, generator=gen, dtype=torch.float64)
            do = torch.randn(1, T, 32, generator=gen, dtype=torch.float64)
            leaf = x.clone().requires_grad_()
            ref, _, _ = layer(leaf, cu_seqlens=torch.tensor(bounds))
            ref_grads = torch.autograd.grad((ref * do).sum(), [leaf, *layer.parameters()])

            ctx = build_kcp_context(list(bounds), rank_ranges=ranges and list(ranges), max_docs=max_docs)
            start, end = ctx.rank_ranges[rank]
            mine = x[:, start:end].clone().requires_grad_()
            with record_comm_bytes() as log:
                o, _, _ = layer(mine, kcp_context=ctx)
                kept = conv_kept_bytes(o, layer, ctx)
                grads = torch.autograd.grad((o * do[:, start:end]).sum(), [mine, *layer.parameters()])
            where = (kind, R, rank, bounds, max_docs)
            # with_conv=True: the halo's traffic and the rows the convolution keeps equal the queries exactly
            shapes = dict(H_qk=layer.num_heads, HV=layer.num_v_heads, K=layer.head_k_dim, V=layer.head_v_dim)
            options = layer.kcp_options()
            assert options.with_conv and options.conv_size == layer.conv_size
            queried = comm_bytes(ctx, shapes["HV"], shapes["K"], shapes["V"], dtype=torch.float64,
                                         options=options, H_qk=shapes["H_qk"])
            assert set(queried) == {"c1", "c2", "b1", "b2", "halo", "halo_grad"}, where
            for name, figure in queried.items():
                assert log.get(name, {"send": 0, "recv": 0}) == figure, (where, name, log.get(name), figure)
            saved = saved_layout(ctx, **shapes, dtype=torch.float64, options=options)
            halo = saved.get("conv_halo")
            assert kept == (halo.nbytes if halo else 0), (where, kept, halo)
            assert (halo is not None) == (R > 1), where
            assert o.shape == (1, end - start, 32) and max_abs(o, ref[:, start:end]) < 1e-9, where
            assert max_abs(grads[0], ref_grads[0][:, start:end]) < 1e-9, where
            for name, ours, expected in zip([n for n, _ in layer.named_parameters()], grads[1:], ref_grads[1:]):
                total = ours.clone()
                if R > 1:
                    dist.all_reduce(total)
                assert max_abs(total, expected) < 1e-9, (where, name, max_abs(total, expected))


def layer_compiles_once(rank: int, R: int, kind: str = "gdn") -> None:
    """The layer with kcp_context under torch.compile(fullgraph=True) over
    three capped packings: one graph (a recompile raises), equal to eager."""
    from torch._dynamo.utils import counters

    layer = make_layer(kind)
    compiled = torch.compile(layer, fullgraph=True)
    torch._dynamo.reset()
    counters.clear()
    try:
        for step, bounds in enumerate(([0, 30, 130, 131, 200], [0, 200], [0, 5, 5, 199, 200])):
            ctx = build_kcp_context(bounds, max_docs=6)
            start, end = ctx.rank_ranges[rank]
            x = torch.randn(1, 200, 32, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            mine = x[:, start:end].clone().requires_grad_()
            o, _, _ = compiled(mine, kcp_context=ctx)
            grads = torch.autograd.grad(o.square().sum(), [mine, *layer.parameters()])
            ref = x[:, start:end].clone().requires_grad_()
            o_eager, _, _ = layer(ref, kcp_context=ctx)
            ref_grads = torch.autograd.grad(o_eager.square().sum(), [ref, *layer.parameters()])
            assert max_abs(o, o_eager) < 1e-10 and not counters["graph_break"], (rank, step)
            assert all(max_abs(a, b) < 1e-10 for a, b in zip(grads, ref_grads)), (rank, step)
            if step == 0:
                torch.compiler.set_stance("fail_on_recompile")
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch.compiler.set_stance("default")


def every_layer_compiles_once(rank: int, R: int) -> None:
    """:func:`layer_compiles_once` for each layer kind, in one spawn."""
    for kind in LAYERS:
        layer_compiles_once(rank, R, kind)

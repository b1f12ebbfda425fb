"""The arena check: run the real host path under a recording workspace on every
rank, for every valid option combination, and require the recorded bytes to
equal the byte queries exactly (tolerance 0)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch
from gdn_inputs import channel_gates, make_inputs, max_abs, rel_rms

from gdn_kcp import (OptionsKcp, build_kcp_context, chunk_gated_delta_rule, chunk_kda, gdn_comm_bytes_kcp, gdn_kcp,
                     kda_comm_bytes_kcp, kda_kcp, kda_saved_layout_kcp, kda_workspace_layout_kcp)
from gdn_kcp.exchange import record_comm_bytes
from gdn_kcp.plan import segment_range
from gdn_kcp.queries import COLLECTIVES
from gdn_kcp.queries.layout import gdn_saved_layout_kcp, gdn_workspace_layout_kcp
from gdn_kcp.workspace import record_workspace

FIELDS = dict(
    save_mode=("light", "inverse", "full"),
    boundary_mode=("saved", "replay"),
    save_transfer=(False, True),
    save_for_backward=(True, False),
    graph=("off", "replay"),
    exchange=("a2a", "ring"),
    schedule=("serial", "overlap"),
    use_qk_l2norm=(False, True),
)


def valid_options() -> list[OptionsKcp]:
    out = []
    for values in itertools.product(*FIELDS.values()):
        try:
            out.append(OptionsKcp(**dict(zip(FIELDS, values))))
        except ValueError:
            pass
    return out


# (bounds, ranges) per R: fragments crossing in and out, a document over every
# rank, an empty rank, zero-length documents.
PACKINGS = {
    1: [((0, 0, 70, 70, 200), None)],
    2: [((0, 50, 190, 250), ((0, 120), (120, 250)))],
    4: [((0, 3, 3, 300), None), ((0, 40, 200, 230, 330), ((0, 90), (90, 90), (90, 210), (210, 330)))],
    5: [((0, 20, 150, 151, 400), ((0, 60), (60, 160), (160, 160), (160, 300), (300, 400)))],
}
H_QK, HV, K, V = 1, 3, 16, 8

# Segments: fragments of many chunks (P up to 7 on some rank), crossing in and
# out, a middle rank and an empty one.
SEGMENT_PACKINGS = {
    1: [((0, 0, 70, 70, 500), None)],
    2: [((0, 50, 600, 700), ((0, 420), (420, 700)))],
    4: [((0, 40, 900), ((0, 300), (300, 300), (300, 700), (700, 900)))],
}
SEGMENT_CAPPED_T = 300


def segment_options() -> list[OptionsKcp]:
    """The option combinations that change what the segments bind: save mode,
    boundary mode, save_transfer, save_for_backward and the exchange (graph
    replay and the L2 norm bind no segment pool of their own)."""
    return [o for o in valid_options() if o.graph == "off" and not o.use_qk_l2norm]


# Capped contexts (max_docs = 6): random packings per R, document counts up to the cap.
CAPPED_MAX_DOCS = 6
CAPPED_R = (1, 2, 4)


def capped_packings(R: int, n: int = 2, T: int | None = None) -> list[tuple[tuple[int, ...], None]]:
    import random

    rng, T = random.Random(R), 64 * R + 37 if T is None else T
    packings = []
    for _ in range(n):
        cuts = sorted(rng.randint(0, T) for _ in range(rng.randint(0, CAPPED_MAX_DOCS - 1)))
        packings.append(((0, *cuts, T), None))
    return packings


def saved_bytes(o: torch.Tensor, inputs: list[torch.Tensor], ctx) -> int:
    """Bytes of what the autograd node of ``o`` really keeps besides the inputs
    and the context's index tables (which the caller holds anyway)."""
    node = o.grad_fn.next_functions[0][0]  # o is a view of the node's output
    held = [*inputs, ctx.index.chunk_table, ctx.index.frag_table]
    input_storages = {x.untyped_storage().data_ptr() for x in held}
    kept = [t for t in node.saved_tensors if t is not None and t.untyped_storage().data_ptr() not in input_storages]
    return sum(t.numel() * t.element_size() for t in kept)


def check_layout(record, layout, where) -> None:
    for call in ("fwd", "bwd"):
        expected = getattr(layout, call)
        recorded = [(kind, name) for kind, name, _, _ in record.runs(call)[-1]]
        assert recorded == list(expected.events), (where, call, recorded, expected.events)
        assert record.phases(call) == dict(expected.phases), (where, call, record.phases(call), dict(expected.phases))
        assert record.peak(call) == expected.bytes, (where, call, record.peak(call), expected.bytes)
        assert record.pools(call) == {n: s.nbytes for n, s in expected.pools.items()}, (where, call)


def run_arena(rank: int, R: int, dtype: torch.dtype = torch.float32, max_docs: int | None = None,
              segments: int | None = None, dims: tuple[int, int, int, int] = (H_QK, HV, K, V),
              kda: bool = False) -> None:
    """Every packing of ``PACKINGS[R]`` (or, with ``max_docs``, the random
    packings of :func:`capped_packings` on capped contexts, whose figures must
    also be one for every packing). ``segments``: P (cut to each rank's
    range) on the options of :func:`segment_options`, over the longer
    packings of ``SEGMENT_PACKINGS``. ``dims``: ``(H_qk, HV, K, V)``.
    ``kda``: KDA calls (a gate per key channel) against the ``kda_*`` queries."""
    entry, call = (chunk_kda, kda_kcp) if kda else (chunk_gated_delta_rule, gdn_kcp)
    queries = ((kda_comm_bytes_kcp, kda_workspace_layout_kcp, kda_saved_layout_kcp) if kda else
               (gdn_comm_bytes_kcp, gdn_workspace_layout_kcp, gdn_saved_layout_kcp))
    figures: dict[OptionsKcp, tuple] = {}
    H_QK, HV, K, V = dims
    if segments is not None:
        packings = SEGMENT_PACKINGS[R] if max_docs is None else capped_packings(R, T=SEGMENT_CAPPED_T * R)
    else:
        packings = PACKINGS[R] if max_docs is None else capped_packings(R)
    for bounds, ranges in packings:
        T = bounds[-1]
        inputs = make_inputs(T, H_QK, HV, K, V, dtype=dtype, seed=R)
        if kda:
            inputs[3] = channel_gates(inputs[3], K, R)
        cu = torch.tensor(bounds)
        ctx = build_kcp_context(cu, rank_ranges=ranges and list(ranges), max_docs=max_docs)
        start, end = ctx.rank_ranges[rank]
        do_all = torch.randn(1, T, HV, V, generator=torch.Generator().manual_seed(3)).to(dtype)
        do = do_all[:, start:end]
        for l2 in (False, True):
            leaves = [x.clone().requires_grad_() for x in inputs]
            ref_o, _ = entry(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2)
            ref = [ref_o, *torch.autograd.grad((ref_o * do_all).sum(), leaves)]  # every rank's loss
            ref = [x[:, start:end] for x in ref]
            for options in valid_options() if segments is None else segment_options():
                if options.use_qk_l2norm != l2:
                    continue
                if segments is not None:
                    options = replace(options, segments=min(segments, segment_range(ctx)))
                where = f"R={R} rank={rank} bounds={bounds} {options}"
                mine = [x[:, start:end].clone().requires_grad_() for x in inputs]
                with record_workspace() as record, record_comm_bytes() as comm:
                    o, _ = call(*mine, ctx, options=options)
                    kept = saved_bytes(o, mine, ctx)
                    grads = torch.autograd.grad((o * do).sum(), mine)
                queried = queries[0](ctx, HV, K, V, dtype=dtype, options=options)
                for name in COLLECTIVES:
                    assert comm.get(name, {"send": 0, "recv": 0}) == queried[name], (where, name)
                layout = queries[1](ctx, H_QK, HV, K, V, dtype=dtype, options=options)
                check_layout(record, layout, where)
                saved = queries[2](ctx, H_QK, HV, K, V, dtype=dtype, options=options)
                assert kept == sum(s.nbytes for s in saved.values()), (where, kept, saved)
                if max_docs is not None:  # the recorded figures of every packing are the first one's
                    seen = (record.peak("fwd"), record.peak("bwd"), record.phases("fwd"), record.phases("bwd"),
                            kept, dict(comm))
                    assert figures.setdefault(options, seen) == seen, (where, figures[options], seen)
                for name, ours, expected in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), [o, *grads], ref):
                    if dtype == torch.float64:
                        assert max_abs(ours, expected) < 1e-9, (where, name, max_abs(ours, expected))
                    else:
                        assert rel_rms(ours, expected) < 1e-4, (where, name, rel_rms(ours, expected))

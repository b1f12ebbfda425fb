"""KCP test cases and the per-rank check against the single-rank run."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gdn_inputs import channel_gates, make_inputs, max_abs, random_bounds, rel_rms

from gdn_kcp import (OptionsKcp, build_kcp_context, chunk_gated_delta_rule, chunk_kda, gdn_comm_bytes_kcp, gdn_kcp,
                     gdn_state_layout_kcp, kda_kcp)
from gdn_kcp.plan import segment_range
from gdn_kcp.queries import COLLECTIVES
from gdn_kcp.exchange import record_comm_bytes


@dataclass(frozen=True)
class KcpCase:
    name: str
    bounds: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...] | None  # None: the default split
    H_qk: int = 2
    HV: int = 4
    K: int = 16
    V: int = 16
    l2: bool = False
    dtype: torch.dtype = torch.float64
    seed: int = 0
    kda: bool = False  # KDA: a gate per key channel (chunk_kda / kda_kcp)


def spanning(T: int, head: int = 7) -> tuple[int, ...]:
    """A zero-length document, a short one, then one long document to the end."""
    return (0, 0, head, T)


CASES = {
    1: [
        KcpCase("random", tuple(random_bounds(200, 1)), None, l2=True),
    ],
    2: [
        KcpCase("ends-on-boundary", (0, 100, 250, 300), ((0, 100), (100, 300)), H_qk=1),
        KcpCase("random-uneven-fp32", tuple(random_bounds(330, 2, 90)), ((0, 70), (70, 330)), l2=True,
                dtype=torch.float32),
        KcpCase("span-all", spanning(260), None, K=32, V=16, l2=True),
        KcpCase("kda-random-uneven", tuple(random_bounds(330, 2, 90)), ((0, 70), (70, 330)), l2=True, kda=True),
    ],
    3: [
        KcpCase("span-all", spanning(410, 5), None, H_qk=1, HV=4),
        KcpCase("one-token-rank", tuple(random_bounds(350, 3, 120)), ((0, 200), (200, 201), (201, 350)), l2=True),
        KcpCase("kda-span-all", spanning(410, 5), None, H_qk=1, HV=4, K=32, kda=True),
    ],
    4: [
        KcpCase("span-all-hv6", spanning(420), None, H_qk=3, HV=6, l2=True),
        KcpCase("empty-rank-hv6", (0, 30, 30, 420, 431, 450), ((0, 100), (100, 100), (100, 300), (300, 450)),
                H_qk=2, HV=6),
        KcpCase("random-fp32", tuple(random_bounds(400, 4, 150)), ((0, 50), (50, 230), (230, 240), (240, 400)),
                H_qk=1, HV=2, dtype=torch.float32),
        KcpCase("kda-empty-rank-fp32", (0, 30, 30, 420, 431, 450), ((0, 100), (100, 100), (100, 300), (300, 450)),
                H_qk=1, HV=4, l2=True, dtype=torch.float32, kda=True),
    ],
    5: [
        KcpCase("span-all-hv12", spanning(500, 3), None, H_qk=4, HV=12, l2=True),
        KcpCase("empty-rank-hv12", tuple(random_bounds(420, 5, 200)),
                ((0, 90), (90, 90), (90, 300), (300, 301), (301, 420)), H_qk=3, HV=12),
    ],
}


STATE_NAMES = ("final_state", "d_initial_state")


def padded_bounds(case: KcpCase, max_docs: int | None) -> tuple[int, ...]:
    """The case's bounds, padded to ``max_docs`` documents with zero-length ones at T."""
    if max_docs is None:
        return case.bounds
    return case.bounds + (case.bounds[-1],) * (max_docs + 1 - len(case.bounds))


def reference(case: KcpCase, states: bool, max_docs: int | None = None):
    """Single-rank output and gradients on the unsplit stream, for a fixed dO
    (with ``states``: from random initial states, with the final states in the
    loss, and then also the final states and the initial-state gradient).
    ``max_docs``: the stream padded with zero-length documents at T, as a
    capped context pads it."""
    bounds = padded_bounds(case, max_docs)
    T, N = bounds[-1], len(bounds) - 1
    inputs = make_inputs(T, case.H_qk, case.HV, case.K, case.V, dtype=case.dtype, seed=case.seed, l2=case.l2)
    if case.kda:
        inputs[3] = channel_gates(inputs[3], case.K, case.seed)
    gen = torch.Generator().manual_seed(case.seed + 7)
    cdt = torch.float64 if case.dtype == torch.float64 else torch.float32
    state0 = torch.randn(N, case.HV, case.K, case.V, generator=gen).to(cdt) if states else None
    leaves = [x.clone().requires_grad_() for x in inputs] + ([state0.clone().requires_grad_()] if states else [])
    cu = torch.tensor(bounds, dtype=torch.int64)
    entry = chunk_kda if case.kda else chunk_gated_delta_rule
    o, fs = entry(*leaves[:5], initial_state=leaves[5] if states else None, cu_seqlens=cu,
                  output_final_state=states, use_qk_l2norm_in_kernel=case.l2)
    do = torch.randn(o.shape, generator=gen).to(case.dtype)
    loss = (o * do).sum()
    dfs = None
    if states:
        dfs = torch.randn(fs.shape, generator=gen).to(cdt)
        loss = loss + (fs * dfs).sum()
    grads = torch.autograd.grad(loss, leaves)
    expected = [o.detach(), *grads[:5]]
    if states:
        expected += [fs.detach(), grads[5]]
    return inputs, (do, state0, dfs), expected


def padded_rows(rows: torch.Tensor, n_rows: int, fill: float) -> torch.Tensor:
    """``rows`` followed by ``fill`` rows up to ``n_rows`` (a capped context's padding)."""
    return torch.cat([rows, rows.new_full((n_rows - rows.shape[0],) + rows.shape[1:], fill)])


def check_case_on_rank(case: KcpCase, rank: int, exchange: str, inputs, given, expected,
                       max_docs: int | None = None, segments: int | None = None, n_sms: int | None = None,
                       modes: dict | None = None) -> None:
    """Run gdn_kcp on this rank's range; compare o and every gradient with the
    single-rank rows (with states: the final states of the documents that end
    here, the initial-state gradient of those that start here), and the
    counted comm bytes with gdn_comm_bytes_kcp. ``max_docs``: a capped
    context; its padding rows of the initial states hold NaN (never read), of
    the final states and initial-state gradients zeros. ``segments``: P, cut
    to the context's range (:func:`gdn_kcp.plan.segment_range`); ``n_sms``:
    the SM count the plan fills (default: the machine's cores). ``modes``:
    more options (e.g. ``boundary_mode="replay"``)."""
    do, state0, dfs = given
    ctx = build_kcp_context(torch.tensor(case.bounds), rank_ranges=case.ranges and list(case.ranges),
                            max_docs=max_docs, n_sms=n_sms)
    start, end = ctx.rank_ranges[rank]
    mine = [x[:, start:end].clone().requires_grad_() for x in inputs]
    if segments is not None:
        segments = min(segments, segment_range(ctx))
    options = OptionsKcp(exchange=exchange, use_qk_l2norm=case.l2, segments=segments,
                         gate="channel" if case.kda else "head", **(modes or {}))
    states = state0 is not None
    call = kda_kcp if case.kda else gdn_kcp
    with record_comm_bytes() as log:
        if states:
            mine.append(padded_rows(state0[ctx.start_docs], ctx.n_start_docs, float("nan")).requires_grad_())
            o, fs = call(*mine[:5], ctx, options=options, initial_state=mine[5], output_final_state=True)
            assert fs.shape == (ctx.n_end_docs, case.HV, case.K, case.V)
            d_fs = padded_rows(dfs[ctx.end_docs], ctx.n_end_docs, 0.0)
            grads = torch.autograd.grad((o * do[:, start:end]).sum() + (fs * d_fs).sum(), mine)
            outputs = [o, *grads[:5], fs, grads[5]]
            queried = gdn_state_layout_kcp(ctx, case.HV, case.K, case.V, dtype=case.dtype)
            for name, tensor in (("final_state", fs), ("initial_state", mine[5]), ("initial_state", grads[5])):
                spec = queried[name]
                assert (tensor.shape, tensor.dtype, tensor.nbytes) == (spec.shape, spec.dtype, spec.nbytes), name
        else:
            o, _ = call(*mine, ctx, options=options)
            outputs = [o, *torch.autograd.grad((o * do[:, start:end]).sum(), mine)]
    where = f"{case.name} rank {rank} exchange={exchange} states={states} segments={segments} {modes or ''}"
    names = ("o", "dq", "dk", "dv", "dg", "dbeta", *STATE_NAMES)
    assert len(outputs) == len(expected) == (8 if states else 6), where
    for name, ours, ref in zip(names, outputs, expected):
        if name == "final_state":
            ref = padded_rows(ref[ctx.end_docs], ctx.n_end_docs, 0.0)
        elif name == "d_initial_state":
            ref = padded_rows(ref[ctx.start_docs], ctx.n_start_docs, 0.0)
        else:
            ref = ref[:, start:end]
        assert ours.shape == ref.shape and ours.dtype == ref.dtype, (where, name)
        if case.dtype == torch.float64:
            assert max_abs(ours, ref) < 1e-9, (where, name, max_abs(ours, ref))
        else:
            assert rel_rms(ours, ref) < 1e-4, (where, name, rel_rms(ours, ref))
    queried = gdn_comm_bytes_kcp(ctx, case.HV, case.K, case.V, dtype=case.dtype, options=options)
    for name in COLLECTIVES:
        counted = log.get(name, {"send": 0, "recv": 0})
        assert counted == queried[name], (where, name, counted, queried[name])


def run_cases(rank: int, R: int) -> None:
    """Every case of R ranks: a2a with initial and final states, ring without;
    then capped (two spare document slots): a2a with states, ring without."""
    for case in CASES[R]:
        for exchange, states, max_docs in (("a2a", True, None), ("ring", False, None),
                                           ("a2a", True, len(case.bounds) + 1), ("ring", False, len(case.bounds))):
            inputs, given, expected = reference(case, states, max_docs)
            check_case_on_rank(case, rank, exchange, inputs, given, expected, max_docs)


STATE_MODES = ({"boundary_mode": "replay"}, {"boundary_mode": "replay", "save_for_backward": False})
"""The modes whose backward replays the forward's boundary: the replayed
summary walk must start from the initial states too."""


def run_state_modes(rank: int, R: int) -> None:
    """Initial and final states under the replaying modes, a2a and ring, on
    every case of R ranks (a document crossing every rank among them)."""
    for case in CASES[R]:
        inputs, given, expected = reference(case, True)
        for exchange in ("a2a", "ring"):
            for modes in STATE_MODES:
                check_case_on_rank(case, rank, exchange, inputs, given, expected, modes=modes)


def expect_metadata_error(rank: int, R: int) -> None:
    """Rank 2 gets other document bounds, rank 1 other ranges: every rank raises
    a ValueError that names the ranks that differ."""
    import pytest

    bounds = torch.tensor([0, 50, 90] if rank != 2 else [0, 40, 90])
    with pytest.raises(ValueError, match=r"ranks \[2\] were given a different cu_seqlens_global than rank 0"):
        build_kcp_context(bounds)
    ranges = [(0, 30), (30, 60), (60, 90)] if rank != 1 else [(0, 30), (30, 61), (61, 90)]
    with pytest.raises(ValueError, match=r"ranks \[1\] were given a different rank_ranges than rank 0"):
        build_kcp_context(torch.tensor([0, 50, 90]), rank_ranges=ranges)

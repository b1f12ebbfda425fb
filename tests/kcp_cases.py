"""KCP test cases and the per-rank check against the single-rank run."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gdn_inputs import make_inputs, max_abs, random_bounds, rel_rms

from gdn_kcp import OptionsKcp, build_kcp_context, chunk_gated_delta_rule, gdn_comm_bytes_kcp, gdn_kcp
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
    ],
    3: [
        KcpCase("span-all", spanning(410, 5), None, H_qk=1, HV=4),
        KcpCase("one-token-rank", tuple(random_bounds(350, 3, 120)), ((0, 200), (200, 201), (201, 350)), l2=True),
    ],
    4: [
        KcpCase("span-all-hv6", spanning(420), None, H_qk=3, HV=6, l2=True),
        KcpCase("empty-rank-hv6", (0, 30, 30, 420, 431, 450), ((0, 100), (100, 100), (100, 300), (300, 450)),
                H_qk=2, HV=6),
        KcpCase("random-fp32", tuple(random_bounds(400, 4, 150)), ((0, 50), (50, 230), (230, 240), (240, 400)),
                H_qk=1, HV=2, dtype=torch.float32),
    ],
    5: [
        KcpCase("span-all-hv12", spanning(500, 3), None, H_qk=4, HV=12, l2=True),
        KcpCase("empty-rank-hv12", tuple(random_bounds(420, 5, 200)),
                ((0, 90), (90, 90), (90, 300), (300, 301), (301, 420)), H_qk=3, HV=12),
    ],
}


def reference(case: KcpCase):
    """Single-rank output and gradients on the unsplit stream, for a fixed dO."""
    T = case.bounds[-1]
    inputs = make_inputs(T, case.H_qk, case.HV, case.K, case.V, dtype=case.dtype, seed=case.seed, l2=case.l2)
    leaves = [x.clone().requires_grad_() for x in inputs]
    cu = torch.tensor(case.bounds, dtype=torch.int64)
    o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=case.l2)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(case.seed + 7)).to(case.dtype)
    grads = torch.autograd.grad((o * do).sum(), leaves)
    return inputs, do, [o.detach(), *grads]


def check_case_on_rank(case: KcpCase, rank: int, exchange: str, inputs, do, expected) -> None:
    """Run gdn_kcp on this rank's range; compare o and every gradient with the
    single-rank rows, and the counted comm bytes with gdn_comm_bytes_kcp."""
    ctx = build_kcp_context(torch.tensor(case.bounds), rank_ranges=case.ranges and list(case.ranges))
    start, end = ctx.rank_ranges[rank]
    mine = [x[:, start:end].clone().requires_grad_() for x in inputs]
    options = OptionsKcp(exchange=exchange, use_qk_l2norm=case.l2)
    with record_comm_bytes() as log:
        o = gdn_kcp(*mine, ctx, options=options)
        grads = torch.autograd.grad((o * do[:, start:end]).sum(), mine)
    where = f"{case.name} rank {rank} exchange={exchange}"
    for name, ours, ref in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), [o, *grads], expected):
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
    for case in CASES[R]:
        inputs, do, expected = reference(case)
        for exchange in ("a2a", "ring"):
            check_case_on_rank(case, rank, exchange, inputs, do, expected)


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

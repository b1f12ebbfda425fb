"""The KCP part of the demo: R CPU processes (gloo) split one packed stream whose
documents cross ranks (one spans all of them), run one forward+backward, and
compare every rank's rows with the single-rank run of the whole stream."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gdn_kcp.chunk import chunk_gated_delta_rule
from gdn_kcp.context import build_kcp_context
from gdn_kcp.exchange import record_comm_bytes
from gdn_kcp.kcp import gdn_kcp
from gdn_kcp.options import OptionsKcp
from gdn_kcp.queries import COLLECTIVES, gdn_comm_bytes_kcp

H_QK, HV, K, V = 4, 8, 64, 64
ERROR_NAMES = ("o", "dq", "dk", "dv", "dg", "dbeta")
EXCHANGES = ("a2a", "ring")


def packed_bounds(T: int, R: int) -> list[int]:
    """Document bounds ``[0, ..., T]`` for ``R <= T``: short documents (one of
    length 0), one that starts on rank 0 and ends on the last rank (rank r
    holds ``[r T // R, (r + 1) T // R)``), and more short ones. The short
    documents before the long one shrink with ``T // (2 R)``, so any T works."""
    span_start, span_end = T // (2 * R), T - T // (2 * R)
    first, second = min(37, span_start // 3), min(127, 2 * span_start // 3)
    bounds = [0, first, first, second, span_start, span_end]
    while bounds[-1] < T:
        bounds.append(min(T, bounds[-1] + 173))
    return bounds


def stream_inputs(T: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, H_QK, K, generator=gen)
    k = torch.randn(1, T, H_QK, K, generator=gen)
    v = torch.randn(1, T, HV, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen) + 7)  # exp(g) ~ 0.999: long memory
    beta = torch.rand(1, T, HV, generator=gen)
    return [q, k, v, g, beta]


def _timed_fwd_bwd(fn, leaves: list[torch.Tensor], do: torch.Tensor):
    start = time.perf_counter()
    o = fn(leaves)
    mid = time.perf_counter()
    grads = torch.autograd.grad(o, leaves, do)
    return o.detach(), grads, mid - start, time.perf_counter() - mid


@dataclass(frozen=True)
class ExchangeReport:
    """One rank's run with one exchange: max |KCP - single rank| per
    ERROR_NAMES, forward and backward ms, bytes received in the forward (c1 + c2)
    and the backward (b1 + b2), and whether every counted byte equals the query."""

    errors: tuple[float, ...]
    ms: tuple[float, float]
    recv_fwd: int
    recv_bwd: int
    matches: bool

    WIDTH = len(ERROR_NAMES) + 5

    def row(self) -> list[float]:
        return [*self.errors, *self.ms, self.recv_fwd, self.recv_bwd, float(self.matches)]

    @classmethod
    def from_row(cls, row: list[float]) -> "ExchangeReport":
        n = len(ERROR_NAMES)
        return cls(errors=tuple(row[:n]), ms=(row[n], row[n + 1]), recv_fwd=int(row[n + 2]),
                   recv_bwd=int(row[n + 3]), matches=bool(row[n + 4]))


@dataclass(frozen=True)
class RankReport:
    """What one rank reports to rank 0: its token range, its single-rank
    reference times (forward, backward ms) and one ExchangeReport per exchange."""

    start: int
    end: int
    ref_ms: tuple[float, float]
    exchanges: dict[str, ExchangeReport]

    WIDTH = 4 + len(EXCHANGES) * ExchangeReport.WIDTH

    def to_tensor(self) -> torch.Tensor:
        """One fp64 row: every field is a float or an int below 2**53 (bytes), so
        it round-trips exactly; gathered as a tensor, it needs no pickling (and
        no numpy, which all_gather_object needs to unpickle)."""
        row = [self.start, self.end, *self.ref_ms]
        for exchange in EXCHANGES:
            row += self.exchanges[exchange].row()
        return torch.tensor(row, dtype=torch.float64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "RankReport":
        row = tensor.tolist()
        width = ExchangeReport.WIDTH
        exchanges = {name: ExchangeReport.from_row(row[4 + i * width : 4 + (i + 1) * width])
                     for i, name in enumerate(EXCHANGES)}
        return cls(start=int(row[0]), end=int(row[1]), ref_ms=(row[2], row[3]), exchanges=exchanges)


def _rank_main(rank: int, R: int, init_file: str, T: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=R)
    bounds = packed_bounds(T, R)
    cu = torch.tensor(bounds)
    inputs = stream_inputs(T)
    do = torch.randn(1, T, HV, V, generator=torch.Generator().manual_seed(1))

    leaves = [x.clone().requires_grad_() for x in inputs]
    ref_o, ref_grads, ref_f, ref_b = _timed_fwd_bwd(
        lambda xs: chunk_gated_delta_rule(*xs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)[0], leaves, do
    )
    ctx = build_kcp_context(cu)
    start, end = ctx.rank_ranges[rank]
    reports = {}
    for exchange in EXCHANGES:
        options = OptionsKcp(exchange=exchange, use_qk_l2norm=True)
        mine = [x[:, start:end].clone().requires_grad_() for x in inputs]
        dist.barrier()
        with record_comm_bytes() as log:
            o, grads, t_f, t_b = _timed_fwd_bwd(lambda xs: gdn_kcp(*xs, ctx, options=options)[0], mine, do[:, start:end])
        errors = tuple(
            (ours - ref[:, start:end]).abs().max().item() for ours, ref in zip([o, *grads], [ref_o, *ref_grads])
        )
        queried = gdn_comm_bytes_kcp(ctx, HV, K, V, options=options)
        counted = {name: log.get(name, {"send": 0, "recv": 0}) for name in COLLECTIVES}
        reports[exchange] = ExchangeReport(
            errors=errors, ms=(t_f * 1e3, t_b * 1e3), recv_fwd=counted["c1"]["recv"] + counted["c2"]["recv"],
            recv_bwd=counted["b1"]["recv"] + counted["b2"]["recv"], matches=counted == queried,
        )
    mine = RankReport(start=start, end=end, ref_ms=(ref_f * 1e3, ref_b * 1e3), exchanges=reports).to_tensor()
    gathered = [torch.empty_like(mine) for _ in range(R)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        _print_reports([RankReport.from_tensor(row) for row in gathered], R, T, len(bounds) - 1)
    dist.destroy_process_group()


def _print_reports(reports: list[RankReport], R: int, T: int, n_docs: int) -> None:
    allgather = R * HV * K * (K + V) * 4
    spans = f"one over all {R} ranks" if R > 1 else "one rank: nothing crosses"
    print(f"KCP: {T} packed tokens ({n_docs} documents, {spans}), H_qk={H_QK}, HV={HV}, "
          f"K=V={K}, fp32, {R} gloo processes")
    for exchange in EXCHANGES:
        print(f"  exchange={exchange}")
        print("    rank  tokens       max |KCP - single rank|: o dq dk dv dg dbeta   fwd ms  bwd ms  "
              "recv B fwd (c1+c2)  bwd (b1+b2)  = query")
        for rank, rep in enumerate(reports):
            res = rep.exchanges[exchange]
            errors = " ".join(f"{err:.0e}" for err in res.errors)
            print(f"    {rank:4d}  {rep.start:5d}-{rep.end:<5d}  {errors:>46s}  {res.ms[0]:6.0f}  {res.ms[1]:6.0f}  "
                  f"{res.recv_fwd:>18,d}  {res.recv_bwd:>11,d}  {'yes' if res.matches else 'NO'}")
    ref_f, ref_b = reports[0].ref_ms
    print(f"  single-rank run of the whole stream: fwd {ref_f:.0f} ms, bwd {ref_b:.0f} ms")
    print(f"  an all-gather of fp32 summaries would receive R*HV*K*(K+V)*4 = {allgather:,d} B per rank "
          f"in the forward (it grows with R; the a2a figure does not)")


def run_kcp_demo(R: int = 4, T: int = 4096) -> None:
    """R gloo processes on this machine split T packed tokens (``1 <= R <= T``)."""
    if not 1 <= R <= T:
        raise ValueError(f"the KCP demo needs 1 <= R <= T (every rank holds a token), got R = {R}, T = {T}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(R, os.path.join(tmp, "rendezvous"), T), nprocs=R, join=True)

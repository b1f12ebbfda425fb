"""The KCP part of the demo: R CPU processes (gloo) split one packed stream whose
documents cross ranks (one spans all of them), run one forward+backward, and
compare every rank's rows with the single-rank run of the whole stream."""

from __future__ import annotations

import os
import tempfile
import time

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


def packed_bounds(T: int, R: int) -> list[int]:
    """Short documents, one that starts on rank 0 and ends on the last rank, and
    more short ones; a zero-length document among them."""
    span_start, span_end = T // (2 * R), T - T // (2 * R)
    bounds, pos = [0], 0
    for length in (37, 0, 90, span_start - 127):
        pos += length
        bounds.append(pos)
    bounds.append(span_end)
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
    report = {"range": (start, end), "ref_ms": (ref_f * 1e3, ref_b * 1e3)}
    for exchange in ("a2a", "ring"):
        options = OptionsKcp(exchange=exchange, use_qk_l2norm=True)
        mine = [x[:, start:end].clone().requires_grad_() for x in inputs]
        dist.barrier()
        with record_comm_bytes() as log:
            o, grads, t_f, t_b = _timed_fwd_bwd(lambda xs: gdn_kcp(*xs, ctx, options=options), mine, do[:, start:end])
        errors = {
            name: (ours - ref[:, start:end]).abs().max().item()
            for name, ours, ref in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), [o, *grads], [ref_o, *ref_grads])
        }
        queried = gdn_comm_bytes_kcp(ctx, HV, K, V, options=options)
        counted = {name: log.get(name, {"send": 0, "recv": 0}) for name in COLLECTIVES}
        report[exchange] = dict(errors=errors, ms=(t_f * 1e3, t_b * 1e3), counted=counted, matches=counted == queried)
    every = [None] * R
    dist.all_gather_object(every, report)
    if rank == 0:
        _print_reports(every, R, T, len(bounds) - 1)
    dist.destroy_process_group()


def _print_reports(reports: list[dict], R: int, T: int, n_docs: int) -> None:
    allgather = R * HV * K * (K + V) * 4
    print(f"KCP: {T} packed tokens ({n_docs} documents, one over all {R} ranks), H_qk={H_QK}, HV={HV}, "
          f"K=V={K}, fp32, {R} gloo processes")
    for exchange in ("a2a", "ring"):
        print(f"  exchange={exchange}")
        print("    rank  tokens       max |KCP - single rank|: o dq dk dv dg dbeta   fwd ms  bwd ms  "
              "recv B fwd (c1+c2)  bwd (b1+b2)  = query")
        for rank, rep in enumerate(reports):
            res = rep[exchange]
            errors = " ".join(f"{err:.0e}" for err in res["errors"].values())
            fwd = res["counted"]["c1"]["recv"] + res["counted"]["c2"]["recv"]
            bwd = res["counted"]["b1"]["recv"] + res["counted"]["b2"]["recv"]
            start, end = rep["range"]
            print(f"    {rank:4d}  {start:5d}-{end:<5d}  {errors:>46s}  {res['ms'][0]:6.0f}  {res['ms'][1]:6.0f}  "
                  f"{fwd:>18,d}  {bwd:>11,d}  {'yes' if res['matches'] else 'NO'}")
    ref_f, ref_b = reports[0]["ref_ms"]
    print(f"  single-rank run of the whole stream: fwd {ref_f:.0f} ms, bwd {ref_b:.0f} ms")
    print(f"  an all-gather of fp32 summaries would receive R*HV*K*(K+V)*4 = {allgather:,d} B per rank "
          f"in the forward (it grows with R; the a2a figure does not)")


def run_kcp_demo(R: int = 4, T: int = 4096) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(R, os.path.join(tmp, "rendezvous"), T), nprocs=R, join=True)

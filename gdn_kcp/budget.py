"""``python -m gdn_kcp budget``: what every rank will hold, before launching.

For a packing given on the command line (or a seeded random one), prints per
rank the workspace per phase of the forward and the backward, the saved set,
and the bytes of every collective, all from the byte queries (no GPU, no
process group).
"""

from __future__ import annotations

import argparse
import random

import torch

from gdn_kcp.cli_args import length_list, positive_int
from gdn_kcp.context import check_ranges, context_from_split, default_ranges
from gdn_kcp.options import OptionsKcp
from gdn_kcp.plan import plan_segments, segments_for
from gdn_kcp.queries import (COLLECTIVES, gdn_comm_bytes_kcp, gdn_saved_layout_kcp, gdn_state_layout_kcp,
                             gdn_workspace_layout_kcp)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=positive_int, help="T of the packed stream (default: the sum of --docs)")
    parser.add_argument("--ranks", type=positive_int, default=1, help="R, ranks of the group")
    parser.add_argument("--docs", type=length_list,
                        help="document lengths, comma-separated (default: random, see --n-docs)")
    parser.add_argument("--n-docs", type=positive_int, default=8, help="documents of the random packing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random packing")
    parser.add_argument("--rank-tokens", type=length_list,
                        help="tokens per rank, comma-separated (default: even split)")
    parser.add_argument("--hq", type=positive_int, default=16, help="H_qk, key heads")
    parser.add_argument("--hv", type=positive_int, default=32, help="HV, value heads (a multiple of --hq)")
    parser.add_argument("--k", type=positive_int, default=128, help="K, key head dim")
    parser.add_argument("--v", type=positive_int, default=128, help="V, value head dim")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype")
    parser.add_argument("--save-mode", choices=("light", "full"), default="light")
    parser.add_argument("--boundary-mode", choices=("saved", "replay"), default="saved")
    parser.add_argument("--save-transfer", action="store_true")
    parser.add_argument("--no-save-for-backward", action="store_true")
    parser.add_argument("--graph", choices=("off", "replay"), default="off")
    parser.add_argument("--exchange", choices=("a2a", "ring"), default="a2a")
    parser.add_argument("--l2", action="store_true", help="in-kernel q/k L2 norm")
    parser.add_argument("--sms", type=positive_int, default=132,
                        help="streaming multiprocessors the segment plan fills (default 132: H100 / H200 SXM)")
    parser.add_argument("--segments", type=positive_int, default=None,
                        help="intra-rank segments P (default: the plan's, printed per rank)")
    parser.add_argument("--max-docs", type=positive_int, default=None,
                        help="a capped context (build_kcp_context(max_docs=)): figures for every packing of up to "
                             "this many documents")


def packing(args: argparse.Namespace) -> list[int]:
    """Document bounds ``[0, ..., T]`` from --docs, or a seeded random packing of --tokens."""
    if args.docs is not None:
        lengths = args.docs
        if sum(lengths) == 0:
            raise ValueError(f"argument --docs: the documents hold no token, got {args.docs}")
        if args.tokens is not None and sum(lengths) != args.tokens:
            raise ValueError(
                f"argument --docs: the lengths add up to {sum(lengths)} tokens, --tokens says {args.tokens}"
            )
    else:
        T = 32768 if args.tokens is None else args.tokens
        rng = random.Random(args.seed)
        cuts = sorted(rng.randint(0, T) for _ in range(args.n_docs - 1))
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, T])]
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    return bounds


def rank_ranges(args: argparse.Namespace, T: int) -> list[tuple[int, int]]:
    """--rank-tokens as contiguous ranges, or the even split."""
    if args.rank_tokens is None:
        return default_ranges(T, args.ranks)
    if len(args.rank_tokens) != args.ranks:
        raise ValueError(f"argument --rank-tokens: lists {len(args.rank_tokens)} ranks, --ranks says {args.ranks}")
    if sum(args.rank_tokens) != T:
        raise ValueError(f"argument --rank-tokens: adds up to {sum(args.rank_tokens)} tokens, the stream has T = {T}")
    edges = [0]
    for length in args.rank_tokens:
        edges.append(edges[-1] + length)
    return check_ranges(list(zip(edges, edges[1:])), T, args.ranks)


def _mib(nbytes: int) -> str:
    return f"{nbytes:>15,d} B {nbytes / 2**20:10.2f} MiB"


def run_budget(args: argparse.Namespace) -> None:
    """Print the budget of every rank. Every figure is computed before the first
    line is printed, so a bad combination raises ``ValueError`` with no output."""
    if args.hv % args.hq:
        raise ValueError(f"argument --hv: HV = {args.hv} must be a multiple of --hq = {args.hq}")
    bounds = packing(args)
    T, R = bounds[-1], args.ranks
    if args.max_docs is not None and len(bounds) - 1 > args.max_docs:
        raise ValueError(f"argument --max-docs: the packing holds {len(bounds) - 1} documents, more than "
                         f"max_docs = {args.max_docs}")
    ranges = rank_ranges(args, T)
    options = OptionsKcp(
        save_mode=args.save_mode, boundary_mode=args.boundary_mode, save_transfer=args.save_transfer,
        save_for_backward=not args.no_save_for_backward, graph=args.graph, exchange=args.exchange,
        use_qk_l2norm=args.l2, segments=args.segments,
    )
    dtype = DTYPES[args.dtype]
    shapes = (args.hq, args.hv, args.k, args.v)
    ranks = []
    for rank in range(R):
        ctx = context_from_split(bounds, ranges, rank, max_docs=args.max_docs, n_sms=args.sms)
        ranks.append((
            ctx,
            gdn_workspace_layout_kcp(ctx, *shapes, dtype=dtype, options=options),
            gdn_saved_layout_kcp(ctx, *shapes, dtype=dtype, options=options),
            gdn_comm_bytes_kcp(ctx, args.hv, args.k, args.v, dtype=dtype, options=options),
            gdn_state_layout_kcp(ctx, args.hv, args.k, args.v, dtype=dtype),
        ))
    print(f"budget: T = {T} tokens in {len(bounds) - 1} documents over R = {R} ranks; "
          f"H_qk = {args.hq}, HV = {args.hv}, K = {args.k}, V = {args.v}, {args.dtype} inputs")
    print(f"  {options}")
    plan = plan_segments(ranks[0][0], args.hv, args.k, args.v)
    print(f"  segments: the plan's P = {plan} on {args.sms} SMs (longest fragment {ranks[0][0].plan_chunks} chunks, "
          f"at most {ranks[0][0].plan_frags} fragments per rank; gdn_kcp.plan), "
          + (f"--segments {args.segments} given" if args.segments else "taken"))
    if args.max_docs is not None:
        print(f"  capped context: max_docs = {args.max_docs}; every figure holds for any packing of up to "
              f"{args.max_docs} documents (chunks and fragments are the caps')")
    for rank, (ctx, layout, saved, comm, states) in enumerate(ranks):
        start, end = ranges[rank]
        flags = f"n_in={ctx.n_in} n_out={ctx.n_out} middle={ctx.rank_middle[rank]}"
        print(f"\nrank {rank}: tokens [{start}, {end}), {ctx.n_frag} fragments, {ctx.index.n_chunks} chunks, {flags}")
        P = segments_for(ctx, args.hv, args.k, args.v, args.segments)
        print(f"  segments P = {P}: {ctx.summary_rows(P)} summary rows")
        print(f"  workspace (gdn_workspace_bytes_kcp) {_mib(layout.bytes)}")
        for call in (layout.fwd, layout.bwd):
            for phase, nbytes in call.phases.items():
                mark = "  <- largest" if nbytes == call.bytes else ""
                print(f"    {phase:<26s}{_mib(nbytes)}{mark}")
        total = sum(spec.nbytes for spec in saved.values())
        print(f"  saved for the backward            {_mib(total)}")
        for name, spec in saved.items():
            print(f"    {name:<10s} {str(list(spec.shape)):<24s}{_mib(spec.nbytes)}")
        print("  states (initial_state= / final_state of gdn_kcp, gdn_state_layout_kcp)")
        for name, spec in states.items():
            print(f"    {name:<13s} {str(list(spec.shape)):<21s}{_mib(spec.nbytes)}")
        print("  comm (send / recv B): " + "  ".join(
            f"{name} {comm[name]['send']:,d} / {comm[name]['recv']:,d}" for name in COLLECTIVES))

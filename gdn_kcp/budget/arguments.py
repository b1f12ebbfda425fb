"""The arguments of ``python -m gdn_kcp budget`` and what they describe: the
packed stream's document bounds, the rank ranges, the options. Each bad value
raises ``ValueError`` naming its argument (argparse turns it into exit 2)."""

from __future__ import annotations

import argparse
import random

import torch

from gdn_kcp.cli_args import length_list, positive_int
from gdn_kcp.context import check_ranges, default_ranges
from gdn_kcp.options import SAVE_MODES, OptionsKcp

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
RANDOM_TOKENS = 32768
"""T of the random packing when neither --tokens nor --docs gives it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every argument has a help text, so ArgumentDefaultsHelpFormatter shows its default."""
    parser.add_argument("--tokens", type=positive_int,
                        help=f"T of the packed stream; if not given, the sum of --docs, or {RANDOM_TOKENS} for a "
                             f"random packing")
    parser.add_argument("--ranks", type=positive_int, default=1, help="R, ranks of the group")
    parser.add_argument("--docs", type=length_list,
                        help="document lengths, comma-separated; if not given, a random packing (see --n-docs)")
    parser.add_argument("--n-docs", type=positive_int, default=8, help="documents of the random packing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random packing")
    parser.add_argument("--rank-tokens", type=length_list,
                        help="tokens per rank, comma-separated; if not given, the even split")
    parser.add_argument("--hq", type=positive_int, default=16, help="H_qk, key heads")
    parser.add_argument("--hv", type=positive_int, default=32, help="HV, value heads (a multiple of --hq)")
    parser.add_argument("--k", type=positive_int, default=128, help="K, key head dim")
    parser.add_argument("--v", type=positive_int, default=128, help="V, value head dim")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype")
    parser.add_argument("--save-mode", choices=SAVE_MODES, default="light",
                        help="OptionsKcp.save_mode: light keeps no tape, inverse keeps A (and the q/k norms), "
                             "full keeps A, w, v_new, h")
    parser.add_argument("--boundary-mode", choices=("saved", "replay"), default="saved",
                        help="OptionsKcp.boundary_mode: keep S_in (and M) for the backward, or replay the exchange")
    parser.add_argument("--save-transfer", action="store_true",
                        help="OptionsKcp.save_transfer: owners keep M for b1 (a2a only)")
    parser.add_argument("--no-save-for-backward", action="store_true",
                        help="OptionsKcp(save_for_backward=False): no saved set, the backward replays the forward")
    parser.add_argument("--graph", choices=("off", "replay"), default="off",
                        help="OptionsKcp.graph: replay accounts for a CUDA-graph-captured call")
    parser.add_argument("--exchange", choices=("a2a", "ring"), default="a2a",
                        help="OptionsKcp.exchange: how boundary states travel")
    parser.add_argument("--l2", action="store_true", help="in-kernel q/k L2 norm (OptionsKcp.use_qk_l2norm)")
    parser.add_argument("--with-conv", action="store_true",
                        help="count the short convolution's halo of a GatedDeltaNet layer under KCP "
                             "(OptionsKcp.with_conv): the saved set gains conv_halo, the traffic halo and halo_grad")
    parser.add_argument("--conv-size", type=positive_int, default=4,
                        help="that convolution's width (OptionsKcp.conv_size; read with --with-conv)")
    parser.add_argument("--kda", action="store_true",
                        help="KDA calls (kda_kcp, a gate per key channel; OptionsKcp.gate='channel'): the kda_* "
                             "queries")
    parser.add_argument("--sms", type=positive_int, default=132,
                        help="streaming multiprocessors the segment plan fills (an H100 / H200 SXM has 132)")
    parser.add_argument("--segments", type=positive_int, default=None,
                        help="intra-rank segments P; if not given, the plan's")
    parser.add_argument("--max-docs", type=positive_int, default=None,
                        help="a capped context (build_kcp_context(max_docs=)): figures for every packing of up to "
                             "this many documents; if not given, the exact context of this packing")
    parser.add_argument("--layers", type=positive_int, default=1,
                        help="N, GDN layers of the model: its estimate per rank is N x the saved set of one layer "
                             "+ one workspace (every layer's saved set lives from its forward to its backward; the "
                             "workspace is bound by one call at a time), and N x one layer's traffic per step")
    parser.add_argument("--detail", action="store_true",
                        help="after the summary, every phase, pool, saved tensor, state and collective of every rank")
    parser.add_argument("--json", action="store_true",
                        help="print every figure (the detail included) as one JSON object instead of text")


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
        T = RANDOM_TOKENS if args.tokens is None else args.tokens
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


def options_of(args: argparse.Namespace) -> OptionsKcp:
    """The OptionsKcp the arguments name (its own checks raise ValueError)."""
    return OptionsKcp(
        save_mode=args.save_mode, boundary_mode=args.boundary_mode, save_transfer=args.save_transfer,
        save_for_backward=not args.no_save_for_backward, graph=args.graph, exchange=args.exchange,
        use_qk_l2norm=args.l2, segments=args.segments, with_conv=args.with_conv, conv_size=args.conv_size,
        gate="channel" if args.kda else "head",
    )

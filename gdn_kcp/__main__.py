"""``python -m gdn_kcp demo`` (the demo) and ``python -m gdn_kcp budget`` (bytes
per rank before a launch); see docs/api.md. Every argument is checked before
anything runs or prints: a bad one exits with status 2 and a message naming it."""

from __future__ import annotations

import argparse

from gdn_kcp.budget import BUDGET_DESCRIPTION, add_arguments, run_budget
from gdn_kcp.cli_args import int_in, non_negative_int, positive_int
from gdn_kcp.demo import run_demo, run_kcp_demo, run_lm_demo

MAX_DEMO_RANKS = 64
"""The KCP demo starts one process per rank on this machine."""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and its two subcommand parsers (``"demo"``, ``"budget"``)."""
    with_defaults = argparse.ArgumentDefaultsHelpFormatter  # every --help shows each argument's default
    parser = argparse.ArgumentParser(prog="python -m gdn_kcp", formatter_class=with_defaults)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", formatter_class=with_defaults,
        help="KCP over R CPU processes against one rank, train a small GDN layer on CPU, then a "
             "GatedDeltaNet (--layer kda: KimiDeltaAttention) byte LM on the standard library's .py files "
             "with KCP over R processes"
    )
    demo.add_argument("--ranks", type=int_in(1, MAX_DEMO_RANKS), default=4,
                      help=f"processes of the KCP run (gloo), 1 to {MAX_DEMO_RANKS}")
    demo.add_argument("--kcp-tokens", type=positive_int, default=4096,
                      help="packed tokens of the KCP run, at least --ranks (every rank holds a token)")
    demo.add_argument("--steps", type=non_negative_int, default=60, help="training steps of the single-rank layer")
    demo.add_argument("--tokens", type=positive_int, default=1024, help="tokens per training batch")
    demo.add_argument("--lm-steps", type=non_negative_int, default=120,
                      help="training steps of the byte LM (KCP over --ranks processes)")
    demo.add_argument("--lm-bytes", type=positive_int, default=256, help="bytes per rank per step of the byte LM")
    demo.add_argument("--layer", choices=("gdn", "kda"), default="gdn",
                      help="the byte LM's token mixer: GatedDeltaNet (gdn) or KimiDeltaAttention (kda, a gate per "
                           "key channel)")
    demo.add_argument("--lm-compile", action="store_true",
                      help="run the byte LM under torch.compile(fullgraph=True): one graph for every packing "
                           "(compiling takes minutes on 2 cores)")
    budget = commands.add_parser("budget", formatter_class=with_defaults,
                                 help="bytes every rank will hold, from the byte queries",
                                 description=BUDGET_DESCRIPTION)
    add_arguments(budget)
    return parser, {"demo": demo, "budget": budget}


def main(argv: list[str] | None = None) -> None:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if args.command == "budget":
        try:
            run_budget(args)
        except ValueError as error:
            commands["budget"].error(str(error))
    if args.command == "demo":
        if args.kcp_tokens < args.ranks:
            commands["demo"].error(
                f"argument --kcp-tokens: must be at least --ranks = {args.ranks} (every rank holds a token), "
                f"got {args.kcp_tokens}"
            )
        run_kcp_demo(R=args.ranks, T=args.kcp_tokens)
        print()
        run_demo(steps=args.steps, T=args.tokens)
        print()
        run_lm_demo(R=args.ranks, steps=args.lm_steps, T_rank=args.lm_bytes, compile=args.lm_compile,
                    layer=args.layer)


if __name__ == "__main__":
    main()

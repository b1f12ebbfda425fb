"""``python -m gdn_kcp demo`` (the demo) and ``python -m gdn_kcp budget`` (bytes
per rank before a launch); see README.md."""

from __future__ import annotations

import argparse

from gdn_kcp.budget import add_arguments, run_budget
from gdn_kcp.demo import run_demo
from gdn_kcp.demo_kcp import run_kcp_demo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gdn_kcp")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="KCP over R CPU processes against one rank, then train a small GDN layer on CPU"
    )
    demo.add_argument("--ranks", type=int, default=4, help="processes of the KCP run (gloo)")
    demo.add_argument("--kcp-tokens", type=int, default=4096)
    demo.add_argument("--steps", type=int, default=60, help="training steps of the single-rank layer")
    demo.add_argument("--tokens", type=int, default=1024, help="tokens per training batch")
    budget = commands.add_parser("budget", help="bytes every rank will hold, from the byte queries")
    add_arguments(budget)
    args = parser.parse_args(argv)
    if args.command == "budget":
        try:
            run_budget(args)
        except ValueError as error:
            parser.error(str(error))
    if args.command == "demo":
        run_kcp_demo(R=args.ranks, T=args.kcp_tokens)
        print()
        run_demo(steps=args.steps, T=args.tokens)


if __name__ == "__main__":
    main()

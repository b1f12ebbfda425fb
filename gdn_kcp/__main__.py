"""``python -m gdn_kcp demo``: the demo (see README.md)."""

from __future__ import annotations

import argparse

from gdn_kcp.demo import run_demo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gdn_kcp")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small GDN layer on CPU and check it against the oracle")
    demo.add_argument("--steps", type=int, default=60)
    demo.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.command == "demo":
        run_demo(steps=args.steps, T=args.tokens)


if __name__ == "__main__":
    main()

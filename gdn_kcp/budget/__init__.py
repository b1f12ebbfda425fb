"""``python -m gdn_kcp budget``: what every rank will hold, before a launch.

For a packing given on the command line (or a seeded random one) it prints a
summary first: per rank the workspace, the saved set of one layer, the states
and the traffic of one layer, then the maximum over the ranks and the estimate
for a model of ``--layers N`` layers. ``--detail`` adds every phase, pool,
saved tensor and collective of every rank; ``--json`` prints all of it as one
JSON object for scripts. Every figure comes from the byte queries (no GPU, no
process group).

    arguments.py  the arguments, the packing and the rank ranges they describe
    figures.py    every rank's figures from the byte queries; the model rule
    report.py     the summary, the detail and the JSON
"""

from __future__ import annotations

import argparse

from gdn_kcp.budget.arguments import add_arguments
from gdn_kcp.budget.figures import MODEL_RULE, budget_of
from gdn_kcp.budget.report import print_detail, print_summary, to_json

__all__ = ["BUDGET_DESCRIPTION", "MODEL_RULE", "add_arguments", "budget_of", "run_budget"]

BUDGET_DESCRIPTION = (
    "Bytes every rank will hold, from the byte queries (no GPU, no process group). First a summary: per rank "
    "the workspace, the saved set of one layer, its states and its traffic, then their maximum over the ranks, "
    f"and a model of --layers N layers per rank: {MODEL_RULE} (each layer's saved set lives from its forward "
    "to its backward; one workspace serves every layer, since a call releases its pools before it returns). "
    "--detail adds every phase, pool, saved tensor and collective; --json prints all of it for scripts."
)


def run_budget(args: argparse.Namespace) -> None:
    """Print the budget of every rank. Every figure is computed before the first
    line is printed, so a bad combination raises ``ValueError`` with no output."""
    budget = budget_of(args)
    if args.json:
        print(to_json(budget))
        return
    print_summary(budget)
    if args.detail:
        print_detail(budget)

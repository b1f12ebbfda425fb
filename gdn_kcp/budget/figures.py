"""Every rank's figures for ``python -m gdn_kcp budget``, from the byte queries,
and the rule that turns one layer's figures into a model's."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gdn_kcp.budget.arguments import DTYPES, options_of, packing, rank_ranges
from gdn_kcp.context import KcpContext, context_from_split
from gdn_kcp.options import OptionsKcp
from gdn_kcp.plan import plan_segments, segments_for
from gdn_kcp.queries import (SavedSpec, WorkspaceLayout, gdn_comm_bytes_kcp, gdn_saved_layout_kcp,
                             gdn_state_layout_kcp, gdn_workspace_layout_kcp)

MODEL_RULE = "N x saved per layer + one workspace"
"""A model of N layers, per rank. Each layer's saved set lives from its forward
until its backward, so all N are held at once (after the last forward); the
workspace is bound by one call at a time (each call releases its pools before
it returns), so one serves every layer. Inputs, outputs, states and the rest
of the model are not in it (the byte queries do not count them)."""


@dataclass(frozen=True)
class RankFigures:
    """One rank's byte-query answers for one layer."""

    rank: int
    tokens: tuple[int, int]
    ctx: KcpContext
    segments: int
    layout: WorkspaceLayout
    saved: dict[str, SavedSpec]
    states: dict[str, SavedSpec]
    comm: dict[str, dict[str, int]]

    @property
    def workspace(self) -> int:
        return self.layout.bytes

    @property
    def saved_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.saved.values())

    @property
    def state_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.states.values())

    @property
    def comm_sent(self) -> int:
        return sum(bytes_["send"] for bytes_ in self.comm.values())

    @property
    def comm_recv(self) -> int:
        return sum(bytes_["recv"] for bytes_ in self.comm.values())

    def model_bytes(self, layers: int) -> int:
        """:data:`MODEL_RULE` on this rank."""
        return layers * self.saved_bytes + self.workspace


@dataclass(frozen=True)
class Budget:
    """What the command prints: the stream, the call's shapes and options, and
    every rank's figures."""

    bounds: list[int]
    ranges: list[tuple[int, int]]
    shapes: dict[str, int]
    dtype_name: str
    options: OptionsKcp
    layers: int
    sms: int
    max_docs: int | None
    plan: int
    ranks: list[RankFigures]

    @property
    def T(self) -> int:
        return self.bounds[-1]

    @property
    def n_docs(self) -> int:
        return len(self.bounds) - 1

    def largest(self, figure) -> tuple[int, int]:
        """``(value, rank)`` of the largest ``figure(rank_figures)`` (the first rank on ties)."""
        values = [figure(r) for r in self.ranks]
        top = max(values)
        return top, values.index(top)


SUMMARY_COLUMNS = {
    "workspace": lambda r: r.workspace,
    "saved_per_layer": lambda r: r.saved_bytes,
    "states": lambda r: r.state_bytes,
    "comm_sent": lambda r: r.comm_sent,
    "comm_recv": lambda r: r.comm_recv,
}
"""The per-rank figures of one layer the summary prints, and their maximum over the ranks."""


def budget_of(args: argparse.Namespace) -> Budget:
    """Every rank's figures for the parsed arguments; raises ``ValueError``
    naming the argument for a bad combination."""
    if args.hv % args.hq:
        raise ValueError(f"argument --hv: HV = {args.hv} must be a multiple of --hq = {args.hq}")
    bounds = packing(args)
    if args.max_docs is not None and len(bounds) - 1 > args.max_docs:
        raise ValueError(f"argument --max-docs: the packing holds {len(bounds) - 1} documents, more than "
                         f"max_docs = {args.max_docs}")
    ranges = rank_ranges(args, bounds[-1])
    options = options_of(args)
    dtype = DTYPES[args.dtype]
    H_qk, HV, K, V = args.hq, args.hv, args.k, args.v
    ranks = []
    for rank, tokens in enumerate(ranges):
        ctx = context_from_split(bounds, ranges, rank, max_docs=args.max_docs, n_sms=args.sms)
        ranks.append(RankFigures(
            rank=rank, tokens=tokens, ctx=ctx, segments=segments_for(ctx, HV, K, V, args.segments),
            layout=gdn_workspace_layout_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=options),
            saved=gdn_saved_layout_kcp(ctx, H_qk, HV, K, V, dtype=dtype, options=options),
            states=gdn_state_layout_kcp(ctx, HV, K, V, dtype=dtype),
            comm=gdn_comm_bytes_kcp(ctx, HV, K, V, dtype=dtype, options=options, H_qk=H_qk),
        ))
    return Budget(
        bounds=bounds, ranges=ranges, shapes=dict(H_qk=H_qk, HV=HV, K=K, V=V), dtype_name=args.dtype,
        options=options, layers=args.layers, sms=args.sms, max_docs=args.max_docs,
        plan=plan_segments(ranks[0].ctx, HV, K, V), ranks=ranks,
    )

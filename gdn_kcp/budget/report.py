"""What ``python -m gdn_kcp budget`` prints: the summary (one row per rank,
then the maximum over the ranks and the model estimate), the per-rank detail
(``--detail``) and the JSON object (``--json``)."""

from __future__ import annotations

import json
from dataclasses import asdict

from gdn_kcp.budget.figures import MODEL_RULE, SUMMARY_COLUMNS, Budget, RankFigures


def _mib(nbytes: int) -> str:
    return f"{nbytes:>15,d} B {nbytes / 2**20:10.2f} MiB"


def _bytes(nbytes: int) -> str:
    """Bytes for a sentence: exact, then in MiB."""
    return f"{nbytes:,d} B ({nbytes / 2**20:,.2f} MiB)"


def _layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def print_header(budget: Budget) -> None:
    shapes = budget.shapes
    print(f"budget: T = {budget.T} tokens in {budget.n_docs} documents over R = {len(budget.ranks)} ranks; "
          f"H_qk = {shapes['H_qk']}, HV = {shapes['HV']}, K = {shapes['K']}, V = {shapes['V']}, "
          f"{budget.dtype_name} inputs")
    print(f"  {budget.options}")
    first = budget.ranks[0].ctx
    given = budget.options.segments
    print(f"  segments: the plan's P = {budget.plan} on {budget.sms} SMs (longest fragment {first.plan_chunks} chunks, "
          f"at most {first.plan_frags} fragments per rank; gdn_kcp.plan), "
          + (f"--segments {given} given" if given else "taken"))
    if budget.max_docs is not None:
        print(f"  capped context: max_docs = {budget.max_docs}; every figure holds for any packing of up to "
              f"{budget.max_docs} documents (chunks and fragments are the caps')")


def print_summary(budget: Budget) -> None:
    """The header, a table of one layer's figures per rank with their maximum,
    and the model of ``budget.layers`` layers."""
    print_header(budget)
    N = budget.layers
    model = f"model, N = {N}"
    header = ["rank", "tokens", "workspace", "saved per layer", "states", "comm sent", "comm recv", model]
    rows = [[str(r.rank), f"[{r.tokens[0]}, {r.tokens[1]})",
             *(f"{column(r):,d}" for column in SUMMARY_COLUMNS.values()), f"{r.model_bytes(N):,d}"]
            for r in budget.ranks]
    tops = [budget.largest(column)[0] for column in SUMMARY_COLUMNS.values()]
    rows.append(["max", "", *(f"{top:,d}" for top in tops), f"{budget.largest(lambda r: r.model_bytes(N))[0]:,d}"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print("\nbytes per rank for one layer (saved: kept from its forward to its backward; states: initial + final; "
          "comm: one forward and backward)")
    for row in [header, *rows]:
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1])] + [c.rjust(w) for c, w in zip(row[2:], widths[2:])]
        print("  ".join(cells).rstrip())
    top, rank = budget.largest(lambda r: r.model_bytes(N))
    print(f"\nmodel of {_layers(N)} (--layers), per rank: {MODEL_RULE}; at most {_bytes(top)}, on rank {rank}")
    sent, rank = budget.largest(lambda r: r.comm_sent)
    print(f"traffic of {_layers(N)} per training step, per rank: N x comm sent; at most {_bytes(N * sent)}, "
          f"on rank {rank}")


def _pools_in_bind_order(r: RankFigures) -> list[tuple[str, list, int]]:
    """``(name, calls that bind it, bytes)`` of every pool, in the order the
    forward and then the backward first bind them (the layouts' own dicts
    have no fixed order)."""
    names = []
    for call in (r.layout.fwd, r.layout.bwd):
        names += [name for kind, name in call.events if kind == "bind" and name not in names]
    sizes = r.layout.pool_bytes
    return [(name, [c for c in (r.layout.fwd, r.layout.bwd) if name in c.pools], sizes[name]) for name in names]


def _print_rank_detail(r: RankFigures) -> None:
    ctx, (start, end) = r.ctx, r.tokens
    flags = f"n_in={ctx.n_in} n_out={ctx.n_out} middle={ctx.rank_middle[r.rank]}"
    print(f"\nrank {r.rank}: tokens [{start}, {end}), {ctx.n_frag} fragments, {ctx.index.n_chunks} chunks, {flags}")
    print(f"  segments P = {r.segments}: {ctx.summary_rows(r.segments)} summary rows")
    print(f"  workspace (gdn_workspace_bytes_kcp) {_mib(r.workspace)}")
    for call in (r.layout.fwd, r.layout.bwd):
        for phase, nbytes in call.phases.items():
            mark = "  <- largest" if nbytes == call.bytes else ""
            print(f"    {phase:<26s}{_mib(nbytes)}{mark}")
    print("  pools (gdn_workspace_layout_kcp: the calls that bind each, its shape and bytes in the arena)")
    for name, calls, nbytes in _pools_in_bind_order(r):
        shape = calls[0].pools[name].shape
        print(f"    {name:<12s} {','.join(c.call for c in calls):<8s} {str(list(shape)):<22s}{_mib(nbytes)}")
    print(f"  saved for the backward            {_mib(r.saved_bytes)}")
    for name, spec in r.saved.items():
        print(f"    {name:<10s} {str(list(spec.shape)):<24s}{_mib(spec.nbytes)}")
    print("  states (initial_state= / final_state of gdn_kcp, gdn_state_layout_kcp)")
    for name, spec in r.states.items():
        print(f"    {name:<13s} {str(list(spec.shape)):<21s}{_mib(spec.nbytes)}")
    print("  comm (send / recv B): " + "  ".join(
        f"{name} {bytes_['send']:,d} / {bytes_['recv']:,d}" for name, bytes_ in r.comm.items()))


def print_detail(budget: Budget) -> None:
    """Every phase, pool, saved tensor, state and collective of every rank."""
    for r in budget.ranks:
        _print_rank_detail(r)


def _specs(specs) -> dict[str, dict[str, object]]:
    return {name: {"shape": list(spec.shape), "dtype": str(spec.dtype).removeprefix("torch."), "bytes": spec.nbytes}
            for name, spec in specs.items()}


def _rank_json(r: RankFigures, layers: int) -> dict[str, object]:
    ctx = r.ctx
    pools = {}
    for name, calls, nbytes in _pools_in_bind_order(r):
        pools[name] = {"calls": [c.call for c in calls], "shape": list(calls[0].pools[name].shape),
                       "dtype": str(calls[0].pools[name].dtype).removeprefix("torch."), "bytes": nbytes}
    return {
        "rank": r.rank, "tokens": list(r.tokens), "fragments": ctx.n_frag, "chunks": ctx.index.n_chunks,
        "n_in": ctx.n_in, "n_out": ctx.n_out, "middle": ctx.rank_middle[r.rank],
        "segments": r.segments, "summary_rows": ctx.summary_rows(r.segments),
        **{name: column(r) for name, column in SUMMARY_COLUMNS.items()},
        "model": r.model_bytes(layers),
        "workspace_fwd": r.layout.fwd.bytes, "workspace_bwd": r.layout.bwd.bytes,
        "phases": dict(r.layout.phases), "pools": pools, "saved": _specs(r.saved), "state_tensors": _specs(r.states),
        "comm": r.comm,
    }


def to_json(budget: Budget) -> str:
    """Every figure of the summary and the detail as one JSON object: the
    stream, ``per_rank`` (one object per rank), ``max`` (each summary figure's
    maximum over the ranks) and ``model`` (the rule, its largest figure and rank)."""
    N = budget.layers
    model, model_rank = budget.largest(lambda r: r.model_bytes(N))
    sent, sent_rank = budget.largest(lambda r: r.comm_sent)
    return json.dumps({
        "tokens": budget.T, "documents": budget.n_docs, "bounds": budget.bounds, "ranks": len(budget.ranks),
        "rank_ranges": [list(pair) for pair in budget.ranges], **budget.shapes, "dtype": budget.dtype_name,
        "options": asdict(budget.options), "sms": budget.sms, "max_docs": budget.max_docs,
        "plan_segments": budget.plan, "layers": N,
        "per_rank": [_rank_json(r, N) for r in budget.ranks],
        "max": {**{name: budget.largest(column)[0] for name, column in SUMMARY_COLUMNS.items()}, "model": model},
        "model": {"layers": N, "rule": MODEL_RULE, "bytes": model, "rank": model_rank,
                  "comm_sent_per_step": N * sent, "comm_rank": sent_rank},
    }, indent=2)

"""Reads the tables of README.md and docs/*.md (each after its ``<!-- marker -->``,
wherever it lives) and evaluates the byte-query formulas; the table tests and
the tests that tie other figures to the docs share it."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from gdn_kcp import OptionsKcp
from gdn_kcp.context import context_from_split, default_ranges
from gdn_kcp.plan import segments_for
from gdn_kcp.queries.layout import align

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DOC_FILES = (README, *sorted(DOCS.glob("*.md")))
"""Every file whose tables, figures and python blocks the tests read."""


def doc(name: str) -> str:
    """The text of ``docs/{name}``."""
    return (DOCS / name).read_text()


def marked_text(marker: str) -> str:
    """The text of the one file of DOC_FILES that holds ``<!-- marker -->``."""
    holders = [path for path in DOC_FILES if f"<!-- {marker} -->" in path.read_text()]
    assert len(holders) == 1, (marker, holders)
    return holders[0].read_text()
EXAMPLE_RANK, EXAMPLE_R, EXAMPLE_T = 1, 5, 40960
EXAMPLE_SHAPES = dict(H_qk=16, HV=48, K=128, V=128)


def example_context():
    """Rank 1 of 5, one document over every rank: a middle rank."""
    return context_from_split([0, EXAMPLE_T], default_ranges(EXAMPLE_T, EXAMPLE_R), EXAMPLE_RANK)


def symbols(options: OptionsKcp) -> dict[str, object]:
    ctx = example_context()
    HV = EXAMPLE_SHAPES["HV"]
    P = segments_for(ctx, HV, EXAMPLE_SHAPES["K"], EXAMPLE_SHAPES["V"], options.segments)
    return dict(F=ctx.index.n_frag, n_sum=ctx.summary_rows(P),
        T=ctx.n_tokens, NC=ctx.index.n_chunks, C=64, e=4, t=EXAMPLE_DTYPE.itemsize, R=ctx.R, **EXAMPLE_SHAPES,
        s_owner=ctx.owner_heads(HV), s_pad=ctx.padded_heads(HV),
        n_in=ctx.n_in, n_out=ctx.n_out, mid=ctx.rank_middle[ctx.rank], n_mid=sum(ctx.rank_middle),
        N_in=sum(ctx.rank_n_in), N_out=sum(ctx.rank_n_out), st=int(options.save_transfer), align=align,
    )


def table_rows(marker: str) -> list[list[str]]:
    """The rows of the markdown table after ``<!-- marker -->``."""
    text = marked_text(marker)
    start = text.index(f"<!-- {marker} -->")
    rows = []
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-", ":"} or cells[0] in ("pool", "saved tensor", "options"):
            continue
        rows.append([re.sub(r"^`|`$", "", cell) for cell in cells])
    return rows


def paragraph_before(marker: str) -> str:
    """The paragraph right above ``<!-- marker -->``, on one line."""
    text = marked_text(marker)
    above = text[: text.index(f"<!-- {marker} -->")].rstrip().split("\n\n")[-1]
    return " ".join(above.split())


def example_label() -> str:
    """How docs/bytes.md names the example a table of figures was computed at, from
    the constants the tests compute it at."""
    shapes = EXAMPLE_SHAPES
    assert shapes["K"] == shapes["V"] and EXAMPLE_DTYPE == torch.bfloat16
    return (
        f"rank {EXAMPLE_RANK} of R = {EXAMPLE_R}, one document of {EXAMPLE_T:,} tokens, "
        f"H_qk = {shapes['H_qk']}, HV = {shapes['HV']}, K = V = {shapes['K']}, bf16 inputs"
    )


def options_of(when: str) -> OptionsKcp:
    return eval(f"OptionsKcp({'' if when == 'default' else when})", {"OptionsKcp": OptionsKcp})


def evaluate(formula: str, options: OptionsKcp) -> int:
    return eval(formula, {"__builtins__": {}}, symbols(options))


def figure(text: str) -> int:
    return int(text.replace(",", ""))


EXAMPLE_DTYPE = torch.bfloat16


CAPS_EXAMPLE = dict(T=32768, R=4, n_docs=16, seed=0, max_docs=64)
"""The cost-of-caps table of docs/compile.md: ``python -m gdn_kcp budget --ranks 4 --n-docs 16``
with and without ``--max-docs 64`` (bf16, H_qk = 16, HV = 32, K = V = 128, default options)."""


def caps_cost_rows() -> list[list[str]]:
    """Per rank: workspace and comm bytes sent (c1 + c2 + b1 + b2) of the exact
    context and of the capped one, as docs/compile.md prints them."""
    import random

    from gdn_kcp import gdn_comm_bytes_kcp, gdn_workspace_bytes_kcp
    from gdn_kcp.queries import COLLECTIVES

    ex = CAPS_EXAMPLE
    rng = random.Random(ex["seed"])
    bounds = [0, *sorted(rng.randint(0, ex["T"]) for _ in range(ex["n_docs"] - 1)), ex["T"]]
    ranges = default_ranges(ex["T"], ex["R"])
    rows = []
    for rank in range(ex["R"]):
        cells = [str(rank)]
        for max_docs in (None, ex["max_docs"]):
            ctx = context_from_split(bounds, ranges, rank, max_docs=max_docs)
            shapes = (32, 128, 128)
            workspace = gdn_workspace_bytes_kcp(ctx, 16, *shapes, dtype=torch.bfloat16)
            comm = gdn_comm_bytes_kcp(ctx, *shapes, dtype=torch.bfloat16)
            cells += [f"{workspace:,}", f"{sum(comm[name]['send'] for name in COLLECTIVES):,}"]
        rows.append(cells)
    return rows

"""Reads the byte-query tables of README.md and evaluates their formulas; the
README tie test and the table writer share it."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from gdn_kcp import OptionsKcp
from gdn_kcp.context import context_from_split, default_ranges
from gdn_kcp.queries.layout import align

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLE_RANK, EXAMPLE_R, EXAMPLE_T = 1, 5, 40960
EXAMPLE_SHAPES = dict(H_qk=16, HV=48, K=128, V=128)


def example_context():
    """Rank 1 of 5, one document over every rank: a middle rank."""
    return context_from_split([0, EXAMPLE_T], default_ranges(EXAMPLE_T, EXAMPLE_R), EXAMPLE_RANK)


def symbols(options: OptionsKcp) -> dict[str, object]:
    ctx = example_context()
    HV = EXAMPLE_SHAPES["HV"]
    return dict(
        T=ctx.n_tokens, NC=ctx.index.n_chunks, C=64, e=4, R=ctx.R, **EXAMPLE_SHAPES,
        s_owner=ctx.owner_heads(HV), s_pad=ctx.padded_heads(HV),
        n_in=ctx.n_in, n_out=ctx.n_out, mid=ctx.rank_middle[ctx.rank], n_mid=sum(ctx.rank_middle),
        N_in=sum(ctx.rank_n_in), N_out=sum(ctx.rank_n_out), st=int(options.save_transfer), align=align,
    )


def table_rows(marker: str) -> list[list[str]]:
    """The rows of the markdown table after ``<!-- marker -->`` in README.md."""
    text = README.read_text()
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
    """The paragraph right above ``<!-- marker -->`` in README.md, on one line."""
    text = README.read_text()
    above = text[: text.index(f"<!-- {marker} -->")].rstrip().split("\n\n")[-1]
    return " ".join(above.split())


def example_label() -> str:
    """How README.md names the example a table of figures was computed at, from
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
